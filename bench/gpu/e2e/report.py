#!/usr/bin/env python3
"""Collects run_e2e.sh's results into OUTDIR/e2e.md and OUTDIR/e2e.json.

    report.py common OUTDIR   prints the common batch: the largest batch every configuration's
                              ladder survived (configurations whose ladder gave no usable result
                              -- skipped, crashed before a rung, failed at the first rung -- do
                              not count); 0 if there is none
    report.py write OUTDIR    writes e2e.md and e2e.json and prints e2e.md
    report.py brief FILE      one line about one run (train_seqlen.py output), for the log

Reads what run_e2e.sh leaves in OUTDIR: meta.json, logs/status.tsv (config, phase, status,
seconds), logs/<config>.<ladder|timed>.out (train_seqlen.py's output: "rung {json}" lines and a
final JSON line), logs/<config>.timed.err (the shim's exit summary), logs/common_batch,
logs/<config>.hf.out and .err (tools/gpu/hf_workloads.py train: one JSON line with tokens_per_s,
peak_allocated, peak_reserved, ratio, source), logs/<config>.<timed|hf>.nvml (nvidia-smi's
memory.used in MiB: "idle N" before the run, then a sample every 50 ms while it ran), logs/hf_status,
logs/replay_status and replay.json (`gpustitch replay --json --gpu`).

Issue 7's targets (item 4) are checked from the same run and each is marked PASS or MISS; a MISS
is where gpustitch loses a comparison, and the table says so.
"""
import json
import os
import re
import sys

GIB = 1 << 30
IN_USE_NOTE = ("*In use, nvidia-smi*: the device memory the run added at its peak as nvidia-smi "
               "showed it (memory.used, device-wide, every 50 ms, less the figure before the run "
               "and the balloon): every byte the process held, whoever allocated it -- the CUDA "
               "context, and cuBLAS's workspaces, which the pool counts as allocated and PyTorch's "
               "statistics leave out -- so rows compare on what an operator sees.")
DEFAULT = "pytorch-default"
SHIM_CACHE = "gpustitch+pytorch-cache"
SHIM = "gpustitch"
PLUGGABLE = "gpustitch-pluggable"
SUMMARY_RE = re.compile(r"gpustitch.*summary device")


def read(path, default=""):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return default


def last_json(text):
    """The last line of text that parses as a JSON object, or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def rungs(text):
    out = []
    for line in text.splitlines():
        if line.startswith("rung {"):
            try:
                out.append(json.loads(line[5:]))
            except ValueError:
                pass
    return out


def statuses(outdir):
    st = {}
    for line in read(os.path.join(outdir, "logs", "status.tsv")).splitlines():
        parts = line.split("\t")
        if len(parts) >= 4:
            st[(parts[0], parts[1])] = {"status": parts[2], "seconds": int(parts[3] or 0)}
    return st


def ladder_result(outdir, name, st):
    """{max_ok_batch, stopped, usable, rungs, status}: from the final JSON, else the rung lines."""
    s = st.get((name, "ladder"), {}).get("status", "not run")
    text = read(os.path.join(outdir, "logs", f"{name}.ladder.out"))
    res = last_json(text)
    rl = rungs(text)
    if res and "max_ok_batch" in res:
        out = {"max_ok_batch": res["max_ok_batch"], "stopped": res.get("stopped"), "rungs": rl,
               "error": res.get("error")}
    else:
        ok = [r["batch"] for r in rl if r.get("ok")]
        stopped = "timeout" if s == "timeout" else ("skipped" if s.startswith("skipped") else
                                                    ("crashed" if s.startswith("exit") else s))
        if res and res.get("error"):
            stopped = "error"
        out = {"max_ok_batch": max(ok) if ok else 0, "stopped": stopped, "rungs": rl,
               "error": (res or {}).get("error")}
    out["status"] = s
    out["seconds"] = st.get((name, "ladder"), {}).get("seconds")
    # Usable for the common batch: it ran at least one rung, successfully.
    out["usable"] = out["max_ok_batch"] > 0
    return out


def common_batch(outdir):
    meta = json.loads(read(os.path.join(outdir, "meta.json"), "{}") or "{}")
    st = statuses(outdir)
    best = [ladder_result(outdir, n, st) for n in meta.get("configs", [])]
    usable = [b["max_ok_batch"] for b in best if b["usable"]]
    return min(usable) if usable else 0


def gib(b):
    return "-" if b is None else f"{b / GIB:.2f}"


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def ratio(a, b):
    return None if a is None or not b else a / b


def fmt_ratio(r, digits=3):
    return "-" if r is None else f"{r:.{digits}f}"


def driver_note(res):
    """The pool's driver calls inside the timed steps (the workloads' pool_driver_*_timed), the
    part of a gpustitch row's step time that is the pool's own; None without them."""
    calls, ms = res.get("pool_driver_calls_timed"), res.get("pool_driver_ms_timed")
    if calls is None or ms is None:
        return None
    bg = res.get("pool_driver_bg_ms_timed") or 0
    note = (f"driver: {calls:,} calls, {ms:.1f} ms in the timed steps"
            + (f" ({bg:.1f} ms of it on the reclaimer thread)" if bg else ""))
    # The time the program's threads waited for the device inside the pool ([count, ms] each).
    syncs, waits = res.get("pool_fence_syncs_timed"), res.get("pool_fence_waits_timed")
    if syncs and waits:
        note += (f"; waits for the device: {syncs[0]:,} fences on the program's threads"
                 f" ({syncs[1]:.1f} ms), {waits[0]:,} for the reclaimer's fence ({waits[1]:.1f} ms,"
                 f" {res.get('pool_fence_waits_timed_out') or 0} ran out)")
    return note


def md_escape(s):
    return str(s).replace("|", "\\|")


def last_line(text):
    """The last non-empty line of text (a traceback's exception line), or None."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else None


def nvml_in_use(outdir, name, phase, subtract=0):
    """Device memory the run added at its peak, as nvidia-smi showed it (peak sample - the figure
    before the run - `subtract`, the balloon), in bytes; None without samples."""
    idle, peak = None, None
    for line in read(os.path.join(outdir, "logs", f"{name}.{phase}.nvml")).splitlines():
        word = line.split()
        try:
            if len(word) == 2 and word[0] == "idle":
                idle = int(word[1])
            elif len(word) == 1:
                peak = max(peak or 0, int(word[0]))
        except ValueError:
            continue  # "[N/A]", a line cut short when the sampler was stopped
    if idle is None or peak is None:
        return None
    return max(0, (peak - idle) * (1 << 20) - subtract)


def lowest_in_use(rows, key, shim_name, what, target):
    """The target that the pool's row holds the least device memory by nvidia-smi, if measured."""
    measured = [r for r in rows if r.get(key) is not None]
    mine = next((r for r in measured if r["config"] == shim_name), None)
    # Against what a user would pick instead, not gpustitch's own other settings.
    others = [r for r in measured if not r["config"].startswith("gpustitch")]
    if mine is None or not others:
        return
    low = min(others, key=lambda r: r[key])
    target(f"gpustitch: lowest device memory in use (nvidia-smi) of all configurations, {what}",
           gib(mine[key]) + " GiB", mine[key] <= low[key],
           f"lowest other: {low['config']} {gib(low[key])} GiB")


def served_by_pool(framework, pool, what, target):
    """The target that the pool served every byte the framework allocated: PyTorch's own peak
    allocated (under backend:cudaMallocAsync the default pool's used high-water mark, which the
    shim answers with its pool's plus the driver pool's own) is no more than the pool's. More on
    PyTorch's side is memory that went past the hooks (2026-12-05: the autograd thread's first
    allocation, 2 GiB on the HF row); the pool may hold more (cuBLAS's workspaces, rounding)."""
    if framework is None or pool is None:
        return
    past = framework - pool
    target(f"gpustitch: every byte PyTorch allocated was served by the pool, {what}",
           f"{gib(max(past, 0))} GiB past it", past <= 0,
           f"PyTorch's peak allocated {gib(framework)} GiB, the pool's {gib(pool)} GiB")


def hf_results(outdir, meta, st):
    """Phase C: per configuration, hf_workloads.py train's JSON result and how the run ended."""
    phase = read(os.path.join(outdir, "logs", "hf_status")).strip() or (
        "not run" if meta.get("hf", True) else "skipped (--no-hf)")
    rows = []
    for name in meta.get("configs", []):
        s = st.get((name, "hf"))
        status = s["status"] if s else (phase if phase.startswith("skipped") else "not run")
        res = last_json(read(os.path.join(outdir, "logs", f"{name}.hf.out"))) if s else None
        ok = bool(res) and status == "ok" and res.get("tokens_per_s") is not None \
            and res.get("peak_reserved") is not None
        err = None
        if s and not ok and not status.startswith("skipped"):
            err = last_line(read(os.path.join(outdir, "logs", f"{name}.hf.err")))
        rows.append({"config": name, "status": status, "seconds": s["seconds"] if s else None,
                     "ok": ok, "result": res if ok else None, "error": err,
                     "in_use_bytes": nvml_in_use(outdir, name, "hf") if ok else None})
    by = {r["config"]: r for r in rows}
    base = by.get(DEFAULT)
    base = base["result"] if base and base["ok"] else None
    for r in rows:
        res = r["result"] or {}
        r["reserved_over_allocated"] = ratio(res.get("peak_reserved"), res.get("peak_allocated"))
        r["reserved_over_demand"] = ratio(res.get("peak_reserved"),
                                          base and base.get("peak_allocated"))
        r["tokens_per_s_vs_default"] = ratio(res.get("tokens_per_s"),
                                             base and base.get("tokens_per_s"))
    return {"status": phase, "steps": meta.get("hf_steps"), "warmup": meta.get("hf_warmup"),
            "demand_bytes": base and base.get("peak_allocated"), "configs": rows}


def hf_markdown(hf):
    L = ["### HF Llama training", ""]
    rows = hf["configs"]
    if not any(r["status"] != "not run" and not r["status"].startswith("skipped")
               for r in rows):
        L.append(f"Not run: {hf['status']}.")
        return L
    L.append(f"`tools/gpu/hf_workloads.py train --steps {hf.get('steps', '?')} --warmup "
             f"{hf.get('warmup', '?')}` under each configuration's environment and prefix: "
             "hf_workloads.py's defaults: HuggingFace transformers `LlamaForCausalLM` from a "
             "config (8 layers, d_model 768, 12 heads, 4 key/value heads, vocab 32000), AdamW, "
             "bf16 autocast, batch 2, sequence length drawn from 256..8192 per step; no balloon "
             "(the figures are absolute, not within the GPT's budget); tokens/s over the steps "
             f"after the warm-up ({hf['status']}).")
    L.append("")
    L.append("| configuration | peak allocated (GiB) | peak reserved (GiB) | "
             "reserved / allocated | reserved / demand | in use, nvidia-smi (GiB) | tokens/s | "
             "vs default | notes |")
    L.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        res = r["result"] or {}
        notes = []
        if r["status"].startswith("skipped") or r["status"] == "not run":
            notes.append(r["status"])
        elif not r["ok"]:
            notes.append("no result line" if r["status"] == "ok" else f"failed: {r['status']}")
            if r["error"]:
                notes.append(r["error"][:160])
        elif res.get("source") == "gpustitch":
            notes.append("figures: pool (gpustitch_get_stats)")
            if driver_note(res):
                notes.append(driver_note(res))
        elif r["config"].startswith("gpustitch"):
            notes.append(f"**pool not active** (figures: {res.get('source')})")
        ok = r["ok"]
        L.append("| " + " | ".join([
            md_escape(r["config"]),
            gib(res.get("peak_allocated")) if ok else "-",
            gib(res.get("peak_reserved")) if ok else "-",
            fmt_ratio(r["reserved_over_allocated"]),
            fmt_ratio(r["reserved_over_demand"]),
            gib(r["in_use_bytes"]) if r["in_use_bytes"] is not None else "-",
            f"{res['tokens_per_s']:,.0f}" if ok else "-",
            fmt_ratio(r["tokens_per_s_vs_default"]),
            md_escape("; ".join(notes)),
        ]) + " |")
    L.append("")
    L.append("Peak allocated and reserved are each allocator's own figures: PyTorch's statistics, "
             "or the pool's `peak_allocated` / `peak_reserved` where the shim is active (under "
             "`--keep-framework-cache` the pool's allocated is PyTorch's cached segments, so "
             "reserved / allocated there says nothing about PyTorch's cache). Demand = "
             "pytorch-default's peak allocated: *reserved / demand* compares device memory "
             "across rows. " + IN_USE_NOTE)
    return L


def write(outdir):
    meta = json.loads(read(os.path.join(outdir, "meta.json"), "{}") or "{}")
    st = statuses(outdir)
    names = meta.get("configs", [])
    common = read(os.path.join(outdir, "logs", "common_batch")).strip() or "?"
    rows = []
    for name in names:
        lad = ladder_result(outdir, name, st) if not meta.get("quick") else None
        tstat = st.get((name, "timed"), {}).get("status", "not run")
        ttext = read(os.path.join(outdir, "logs", f"{name}.timed.out"))
        timed = last_json(ttext) or {}
        summary = [ln.strip() for ln in read(os.path.join(outdir, "logs", f"{name}.timed.err"))
                   .splitlines() if SUMMARY_RE.search(ln)]
        rows.append({"config": name, "ladder": lad, "timed_status": tstat, "timed": timed,
                     "shim_summary": summary[-1] if summary else None,
                     "in_use_bytes": nvml_in_use(outdir, name, "timed",
                                                 (timed or {}).get("balloon_bytes") or 0)})

    by = {r["config"]: r for r in rows}

    def ok_timed(r):
        t = r["timed"]
        return bool(t) and not t.get("oom") and not t.get("error") and t.get("steps_completed")

    demand = None
    if DEFAULT in by and ok_timed(by[DEFAULT]):
        demand = by[DEFAULT]["timed"].get("peak_allocated_bytes")
    base_tps = by[DEFAULT]["timed"].get("tokens_per_s") if DEFAULT in by and ok_timed(
        by[DEFAULT]) else None

    for r in rows:
        t = r["timed"]
        r["reserved_over_demand"] = ratio(t.get("peak_reserved_bytes"), demand) if ok_timed(
            r) else None
        r["tokens_per_s_vs_default"] = ratio(t.get("tokens_per_s"), base_tps) if ok_timed(
            r) else None
        if not ok_timed(r):
            r["in_use_bytes"] = None

    # ---- targets (issue 7, item 4) ----
    targets = []

    def target(what, value, passed, detail=""):
        targets.append({"target": what, "value": value,
                        "result": "n/a" if passed is None else ("PASS" if passed else "MISS"),
                        "detail": detail})

    shim = by.get(SHIM)
    if shim and ok_timed(shim):
        t = shim["timed"]
        alloc = demand or t.get("peak_allocated_bytes")
        rr = ratio(t.get("peak_reserved_bytes"), alloc)
        target("gpustitch: peak reserved <= 1.02 x peak allocated", fmt_ratio(rr),
               None if rr is None else rr <= 1.02,
               "against PyTorch default's peak allocated (the program's demand)" if demand else
               "against the pool's own peak allocated")
        others = [r for r in rows if not r["config"].startswith("gpustitch") and ok_timed(r) and
                  r["timed"].get("peak_reserved_bytes") is not None]
        mine = t.get("peak_reserved_bytes")
        if others and mine is not None:
            low = min(others, key=lambda r: r["timed"]["peak_reserved_bytes"])
            target("gpustitch: lowest peak reserved of all configurations", gib(mine) + " GiB",
                   mine <= low["timed"]["peak_reserved_bytes"],
                   f"lowest other: {low['config']} {gib(low['timed']['peak_reserved_bytes'])} GiB")
    else:
        target("gpustitch: peak reserved <= 1.02 x peak allocated", "-", None,
               "no successful timed run of the gpustitch configuration")
    lowest_in_use(rows, "in_use_bytes", SHIM, "at the common batch", target)
    if shim and ok_timed(shim):
        t = shim["timed"]
        served_by_pool(t.get("torch_peak_allocated_bytes"),
                       (t.get("shim_stats") or {}).get("peak_allocated"), "at the common batch",
                       target)
    if not meta.get("quick"):
        for name in (SHIM, SHIM_CACHE, PLUGGABLE):
            if name not in by or not by[name]["ladder"]:
                continue
            mine = by[name]["ladder"]["max_ok_batch"]
            others = [(r["config"], r["ladder"]["max_ok_batch"]) for r in rows
                      if not r["config"].startswith("gpustitch") and r["ladder"] and
                      r["ladder"]["usable"]]
            if others:
                best = max(others, key=lambda x: x[1])
                target(f"{name}: largest batch >= every PyTorch allocator's", str(mine),
                       mine >= best[1], f"best PyTorch allocator: {best[0]} {best[1]}")
    for name, need in ((SHIM_CACHE, 0.98), (SHIM, 0.95)):
        r = by.get(name)
        v = r["tokens_per_s_vs_default"] if r else None
        target(f"{name}: tokens/s >= {need} x PyTorch default's", fmt_ratio(v),
               None if v is None else v >= need)

    # ---- replay ----
    replay = None
    rj = read(os.path.join(outdir, "replay.json"))
    if rj.strip():
        try:
            replay = json.loads(rj)
        except ValueError:
            replay = {"error": "replay.json is not JSON", "text": rj[:2000]}
    replay_status = read(os.path.join(outdir, "logs", "replay_status")).strip() or "not run"

    hf = hf_results(outdir, meta, st)
    lowest_in_use(hf["configs"], "in_use_bytes", SHIM, "HF training", target)
    mine = next((r for r in hf["configs"] if r["config"] == SHIM and r["ok"]), None)
    if mine and mine["result"].get("source") == "gpustitch":
        served_by_pool(mine["result"].get("torch_peak_allocated"),
                       mine["result"].get("peak_allocated"), "HF training", target)
    doc = {"meta": meta, "common_batch": common, "demand_bytes": demand, "configs": rows,
           "targets": targets, "hf_train": hf, "replay_status": replay_status, "replay": replay}
    with open(os.path.join(outdir, "e2e.json"), "w") as f:
        json.dump(doc, f, indent=1)

    # ---- markdown ----
    L = []
    L.append("## End to end: GPT training, sequence length 256..8192, fixed memory budget")
    L.append("")
    gpu = meta.get("gpu") or next((r["timed"].get("gpu") for r in rows if r["timed"].get("gpu")),
                                  "GPU unknown")
    L.append(f"{meta.get('date', '?')}, {gpu}, "
             f"host {meta.get('host', '?')}. Command: `{meta.get('command', '?')}`")
    m = next((r["timed"].get("model") for r in rows if r["timed"].get("model")), None)
    torch_v = next((r["timed"].get("torch") for r in rows if r["timed"].get("torch")), "?")
    if m:
        L.append("")
        L.append(f"Model: {m['layers']} layers, d_model {m['d_model']}, {m['heads']} heads, "
                 f"vocab {m['vocab']}, bf16 autocast, AdamW; sequence length uniform in "
                 f"{m['min_len']}..{m['max_len']} (same seed, same lengths for every "
                 f"configuration); torch {torch_v}.")
    L.append(f"Budget: {meta.get('budget_gb', '?')} GiB left by a balloon allocation (made first, "
             "with the allocator under test, subtracted from every figure). "
             + ("Quick run: no ladder." if meta.get("quick") else
                f"Largest batch: ladder {meta.get('ladder')}, {meta.get('ladder_steps')} steps "
                "each, one process, stopping at the first OOM.")
             + f" Common batch: {common}, {meta.get('steps')} steps, the first "
             f"{meta.get('warmup')} not timed.")
    L.append("")
    L.append("| configuration | largest batch | peak allocated (GiB) | peak reserved (GiB) | "
             "fragmentation | reserved / demand | in use, nvidia-smi (GiB) | tokens/s | "
             "vs default | notes |")
    L.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        t, lad = r["timed"], r["ladder"]
        notes = []
        if lad is None:
            lb = "-"
        elif lad["status"].startswith("skipped"):
            lb, _ = "skipped", notes.append(lad["status"])
        else:
            lb = str(lad["max_ok_batch"])
            if lad["stopped"] in ("time", "timeout"):
                lb = f">= {lb} (time)"
            elif lad["stopped"] == "done":
                lb = f">= {lb} (ladder top)"
            elif lad["stopped"] not in ("oom",):
                lb += f" ({lad['stopped']})"
                if lad.get("error"):
                    notes.append(f"ladder: {lad['error'][:120]}")
        if r["timed_status"].startswith("skipped"):
            notes.append(f"timed run {r['timed_status']}")
        elif not t:
            notes.append(f"timed run: {r['timed_status']}, no result")
        else:
            if t.get("oom"):
                notes.append(f"OOM at batch {t.get('batch')}")
            if t.get("error"):
                notes.append(f"error: {t['error'][:120]}")
            if t.get("time_limited"):
                notes.append(f"cut short: {t.get('steps_completed')} steps")
            if t.get("peak_reserved_source", "").startswith("gpustitch"):
                notes.append("reserved: pool")
            if t.get("driver_pool_peak_reserved_bytes"):
                notes.append(f"plus up to {t['driver_pool_peak_reserved_bytes'] / 2**30:.2f} GiB "
                             "in the driver's default pool")
            if t.get("peak_allocated_source", "").startswith("gpustitch"):
                notes.append("allocated: pool")
            if driver_note(t):
                notes.append(driver_note(t))
            if r["config"].startswith("gpustitch") and not t.get("shim_active"):
                notes.append("**pool not active**")
        if r["config"].startswith("gpustitch") and t and not r["shim_summary"] \
                and not r["timed_status"].startswith("skipped"):
            notes.append("no shim summary line")
        ok = ok_timed(r)
        L.append("| " + " | ".join([
            md_escape(r["config"]), lb,
            gib(t.get("peak_allocated_bytes")) if ok else "-",
            gib(t.get("peak_reserved_bytes")) if ok else "-",
            pct(t.get("fragmentation")) if ok else "-",
            fmt_ratio(r["reserved_over_demand"]),
            gib(r["in_use_bytes"]) if r["in_use_bytes"] is not None else "-",
            f"{t['tokens_per_s']:,.0f}" if ok and t.get("tokens_per_s") else "-",
            fmt_ratio(r["tokens_per_s_vs_default"]),
            md_escape("; ".join(notes)) or "",
        ]) + " |")
    L.append("")
    L.append("Fragmentation = 1 - peak allocated / peak reserved, each allocator's own figures "
             "(PyTorch's statistics; for gpustitch the pool's peak reserved, i.e. the device "
             "memory it held, and PyTorch's peak allocated where PyTorch keeps statistics, else "
             "the pool's). Demand = PyTorch default's peak allocated at the common batch: the same "
             "tensors for every configuration, so *reserved / demand* compares device memory "
             "across configurations. " + IN_USE_NOTE)
    L.append("")
    L.append("### Targets (issue 7)")
    L.append("")
    L.append("| target | value | result | detail |")
    L.append("| --- | --- | --- | --- |")
    for tg in targets:
        L.append(f"| {md_escape(tg['target'])} | {tg['value']} | {tg['result']} | "
                 f"{md_escape(tg['detail'])} |")
    misses = [tg for tg in targets if tg["result"] == "MISS"]
    if misses:
        L.append("")
        L.append("Where gpustitch loses: " + "; ".join(tg["target"] for tg in misses) +
                 ". (What would close each gap: see the note that goes with this run.)")
    summaries = [(r["config"], r["shim_summary"]) for r in rows if r["shim_summary"]]
    if summaries:
        L.append("")
        L.append("Shim exit summaries (timed runs):")
        L.append("")
        for name, s in summaries:
            L.append(f"- {name}: `{s}`")
    L.append("")
    L.extend(hf_markdown(hf))
    L.append("")
    L.append("### Trace replay on the GPU")
    L.append("")
    if replay and "policies" in replay:
        cap = replay.get("capacity_bytes")
        L.append(f"`gpustitch replay --gpu` of {os.path.basename(str(replay.get('trace', '?')))}: "
                 f"{replay.get('events', '?')} events, device capacity "
                 f"{gib(cap) if cap else '?'} GiB ({replay_status}).")
        L.append("")
        L.append("| policy | peak reserved (GiB) | peak allocated (GiB) | fragmentation at peak | "
                 "OOMs | ns per op | ns per alloc | ns per free |")
        L.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for p in replay["policies"]:
            L.append("| " + " | ".join([
                md_escape(p.get("policy")), gib(p.get("peak_reserved_bytes")),
                gib(p.get("peak_allocated_bytes")), pct(p.get("fragmentation_at_peak")),
                str(p.get("ooms", "-")),
                *(f"{p[k]:.0f}" if isinstance(p.get(k), (int, float)) else "-"
                  for k in ("ns_per_op", "ns_per_alloc", "ns_per_free"))]) + " |")
    else:
        L.append(f"Not available: {replay_status}.")
    L.append("")
    L.append("Logs of every run: `logs/` next to this file.")
    text = "\n".join(L) + "\n"
    with open(os.path.join(outdir, "e2e.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def brief(path):
    """One line about one run's result, for run_e2e.sh's progress log."""
    text = read(path)
    r = last_json(text) or {}
    parts = []
    for key in ("max_ok_batch", "stopped", "batch", "steps_completed", "tokens_per_s", "oom",
                "error", "source", "ratio"):
        if r.get(key) not in (None, False, ""):
            parts.append(f"{key}={r[key]}")
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_allocated", "peak_reserved"):
        if r.get(key) is not None:
            parts.append(f"{key.removesuffix('_bytes')}={gib(r[key])}GiB")
    if not r:
        n = len(rungs(text))
        parts.append(f"no result line ({n} rungs)")
    return " ".join(str(p)[:160] for p in parts)


def main(argv):
    if len(argv) != 3 or argv[1] not in ("common", "write", "brief"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[1] == "brief":
        print(brief(argv[2]))
        return 0
    if argv[1] == "common":
        print(common_batch(argv[2]))
        return 0
    return write(argv[2])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
