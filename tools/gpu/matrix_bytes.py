#!/usr/bin/env python3
"""Byte accounting for the compatibility matrix (run-matrix.sh): does every byte the program holds
on the GPU show up in gpustitch's figures?

Inside a check program (torch_train.py, cupy_check.py, jax_check.py), at a point where its
memory is live, ``report(framework)`` measures and prints one line ``bytes: {json}``; the CUDA
C++ checks (multistream, free_while_busy) run ``matrix_bytes.py program --pid PID --live BYTES``
for themselves at such a point (gpu_common.cuh, report_bytes). The line holds
  * pool: what gpustitch's statistics record says for this process, per device: bytes served by
    the pool (bytes_allocated), held by it (bytes_reserved), and held by memory the program maps
    itself with cuMemCreate/cuMemMap (program_held_bytes, record layout 3 and later), read with
    ``gpustitch show PID --json`` (GPUSTITCH_CLI, default ``gpustitch`` on PATH);
  * framework: the framework's own accounting (PyTorch memory_stats allocated/reserved, CuPy's
    pool and its live arrays, JAX live_arrays() bytes and device.memory_stats());
  * nvml: the driver's per-process used memory (pynvml when installed, else
    ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits``).

run-matrix.sh then calls ``matrix_bytes.py row`` on each shim run's stdout, which judges it:
  * agree: pool held + program held is within MARGIN_FRACTION of NVML plus MARGIN_BYTES (the CUDA
    context, cuBLAS/cuDNN workspaces and kernels images live outside every allocator);
  * covers: pool-served bytes are at least the framework's live bytes (every live tensor/array
    came from the pool). Memory the program maps itself counts for agree, never for covers.
A row passes only if both hold. ``matrix_bytes.py table`` prints the collected rows as a table
and leaves them in the JSON file. ``--self-test`` checks the pure-Python parts on canned numbers
(no GPU needed).
"""
import argparse
import json
import os
import subprocess
import sys
import time

MiB = 1 << 20
MARGIN_FRACTION = 0.10
MARGIN_BYTES = 600 * MiB
PREFIX = "bytes: "


# ---- measuring (inside the program) ---------------------------------------------------------

def framework_bytes(framework):
    """The framework's own figures: {"live": bytes of live tensors/arrays, "reserved": ...}."""
    out = {"framework": framework}
    if framework == "torch":
        import torch
        try:
            s = torch.cuda.memory_stats()
        except RuntimeError as e:
            # CUDAPluggableAllocator keeps no statistics ("does not yet support getDeviceStats"):
            # no live figure, so the row is judged on the pool's bytes against NVML alone.
            out["live"] = None
            out["note"] = str(e).splitlines()[0][:160]
            return out
        out["live"] = int(s.get("allocated_bytes.all.current", torch.cuda.memory_allocated()))
        out["reserved"] = int(s.get("reserved_bytes.all.current", torch.cuda.memory_reserved()))
    elif framework == "cupy":
        import cupy as cp
        pool = cp.get_default_memory_pool()
        out["live"] = int(pool.used_bytes())
        out["reserved"] = int(pool.total_bytes())
    elif framework == "jax":
        import jax
        out["live"] = int(sum(a.nbytes for a in jax.live_arrays()))
        try:
            stats = jax.devices()[0].memory_stats() or {}
            out["reserved"] = int(stats.get("pool_bytes", stats.get("bytes_reserved", 0)))
            out["in_use"] = int(stats.get("bytes_in_use", 0))
        except Exception:  # platform allocator: no statistics
            pass
    return out


def parse_nvidia_smi(text, pid):
    """Used MiB of pid from `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,...`,
    summed over GPUs, in bytes; None when the process is not listed."""
    total, seen = 0, False
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2 or not parts[0].isdigit() or int(parts[0]) != pid:
            continue
        value = parts[1].split()[0] if parts[1] else ""
        if value.replace(".", "", 1).isdigit():
            total += int(float(value) * MiB)
            seen = True
    return total if seen else None


def nvml_bytes(pid):
    try:
        import pynvml
        pynvml.nvmlInit()
        total, seen = 0, False
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory is not None:
                    total += int(p.usedGpuMemory)
                    seen = True
        return total if seen else None
    except Exception:
        pass
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20).stdout
    except Exception:
        return None
    return parse_nvidia_smi(text, pid)


def parse_show_json(answer):
    """gpustitch show --json: the pool's per-process sums (None when no record was read)."""
    proc = answer.get("process", answer) if isinstance(answer, dict) else None
    if not isinstance(proc, dict) or not isinstance(proc.get("devices"), list):
        return None
    layout = int(proc.get("layout_version", 0) or 0)
    out = {"served": 0, "held": 0, "program_held": 0, "program_mapped": 0, "program_served": 0,
           "layout": layout, "program_known": layout == 0 or layout >= 3}
    for d in proc["devices"]:
        out["served"] += int(d.get("bytes_allocated", 0))
        out["held"] += int(d.get("bytes_reserved", 0))
        out["program_held"] += int(d.get("program_held_bytes", 0))
        out["program_mapped"] += int(d.get("program_mapped_bytes", 0))
        # Layout 4: of the program's own handles, those the pool lent (docs/preload.md).
        out["program_served"] += int(d.get("program_served_bytes", 0))
    return out


def pool_bytes(pid):
    cli = os.environ.get("GPUSTITCH_CLI", "gpustitch")
    try:
        r = subprocess.run([cli, "show", str(pid), "--json", "--direct"], capture_output=True,
                           text=True, timeout=20)
        return parse_show_json(json.loads(r.stdout)) if r.stdout.strip() else None
    except Exception:
        return None


def measure(pid, framework):
    """The `bytes:` line's measurement of process pid; `framework` gives its own figures."""
    try:
        # Let the shim publish at least once more after the last allocation (default 100 ms).
        time.sleep(0.35)
        return {"pid": pid, "framework": framework(), "pool": pool_bytes(pid),
                "nvml": nvml_bytes(pid)}
    except Exception as e:  # noqa: BLE001 - a measurement must never fail the check itself
        return {"error": f"{type(e).__name__}: {e}"}


def report(framework):
    """Prints the `bytes:` line for this process; never raises."""
    m = measure(os.getpid(), lambda: framework_bytes(framework))
    print(PREFIX + json.dumps(m, sort_keys=True), flush=True)


def report_program(pid, live):
    """Prints the `bytes:` line for a program that is not Python (the CUDA C++ checks run this,
    with their memory live, through GPUSTITCH_MATRIX_BYTES: gpu_common.cuh): its own count of
    the bytes it holds live stands for the framework's."""
    m = measure(pid, lambda: {"framework": "program", "live": int(live)})
    print(PREFIX + json.dumps(m, sort_keys=True), flush=True)


# ---- judging (run-matrix.sh) ----------------------------------------------------------------

def evaluate(m, margin_fraction=MARGIN_FRACTION, margin_bytes=MARGIN_BYTES):
    """Verdict for one measurement: {"verdict": pass|FAIL|not measured, "why": [...], ...}."""
    out = {"verdict": "not measured", "why": []}
    if not isinstance(m, dict) or "error" in m:
        out["why"].append(m.get("error", "no measurement") if isinstance(m, dict) else "none")
        return out
    pool, nvml, fw = m.get("pool"), m.get("nvml"), m.get("framework") or {}
    if pool is None:
        out["why"].append("no gpustitch record (shim not active, or publish:off)")
        return out
    if nvml is None:
        out["why"].append("no NVML figure for the process")
        return out
    accounted = pool["held"] + pool["program_held"]
    limit = margin_fraction * nvml + margin_bytes
    out.update({"pool_served": pool["served"], "pool_held": pool["held"],
                "program_held": pool["program_held"], "program_mapped": pool["program_mapped"],
                "nvml": nvml, "framework_live": fw.get("live"),
                "framework_reserved": fw.get("reserved"), "accounted": accounted,
                "margin": int(limit)})
    agree = abs(accounted - nvml) <= limit
    if not agree:
        out["why"].append(f"pool held + program held {accounted / MiB:.0f} MiB vs NVML "
                          f"{nvml / MiB:.0f} MiB (margin {limit / MiB:.0f} MiB)")
    if not pool.get("program_known", True):
        out["why"].append(f"record layout {pool.get('layout')} has no program-mapped figure")
    live = fw.get("live")
    # Served: the pool's blocks, and the handles it lent to the program's own cuMemCreate.
    served = pool["served"] + pool.get("program_served", 0)
    covers = live is None or served >= live
    if not covers:
        out["why"].append(f"pool served {served / MiB:.0f} MiB < framework live "
                          f"{live / MiB:.0f} MiB")
    out["verdict"] = "pass" if agree and covers else "FAIL"
    return out


def find_measurement(text):
    m = None
    for line in text.splitlines():
        if line.startswith(PREFIX):
            try:
                m = json.loads(line[len(PREFIX):])
            except ValueError:
                m = {"error": "unreadable bytes line"}
    return m


def cell(v):
    """The markdown table cell of a verdict."""
    if v["verdict"] == "not measured":
        return "not measured (" + "; ".join(v["why"]) + ")"
    text = (f"{v['verdict']}: pool {v['pool_served'] / MiB:.0f} served / "
            f"{v['pool_held'] / MiB:.0f} held + program {v['program_held'] / MiB:.0f} MiB vs "
            f"NVML {v['nvml'] / MiB:.0f} MiB; framework live "
            + ("-" if v["framework_live"] is None else f"{v['framework_live'] / MiB:.0f} MiB"))
    if v["why"]:
        text += " (" + "; ".join(v["why"]) + ")"
    return text.replace("|", "\\|")


def load_rows(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return []


def cmd_row(args):
    try:
        with open(args.log, errors="replace") as f:
            m = find_measurement(f.read())
    except OSError:
        m = None
    v = evaluate(m) if m is not None else {"verdict": "not measured",
                                           "why": ["the program prints no bytes line"]}
    if args.json:
        rows = load_rows(args.json)
        rows.append({"program": args.name, "config": args.config, "measurement": m, **v})
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, sort_keys=True)
    print(cell(v))
    return {"pass": 0, "FAIL": 1}.get(v["verdict"], 3)


def table(rows):
    head = ["program", "config", "verdict", "pool served", "pool held", "program held",
            "NVML", "framework live"]
    lines = [head]
    fmt = lambda b: "-" if b is None else f"{b / MiB:.0f} MiB"  # noqa: E731
    for r in rows:
        lines.append([r.get("program", ""), r.get("config", ""), r.get("verdict", ""),
                      fmt(r.get("pool_served")), fmt(r.get("pool_held")),
                      fmt(r.get("program_held")), fmt(r.get("nvml")),
                      fmt(r.get("framework_live"))])
    widths = [max(len(str(l[i])) for l in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(l, widths)).rstrip()
                     for l in lines)


def cmd_table(args):
    print(table(load_rows(args.json)))
    return 0


def self_test():
    G = 1 << 30
    smi = "1234, 10240\n999, 5\n1234, 2048\nbad line\n"
    assert parse_nvidia_smi(smi, 1234) == 12 * G, parse_nvidia_smi(smi, 1234)
    assert parse_nvidia_smi(smi, 42) is None
    assert parse_nvidia_smi("1234, [N/A]\n", 1234) is None
    show = {"source": "direct", "process": {"pid": 1, "layout_version": 3, "devices": [
        {"bytes_allocated": 6 * G, "bytes_reserved": 7 * G, "program_held_bytes": 2 * G,
         "program_mapped_bytes": 2 * G},
        {"bytes_allocated": 1 * G, "bytes_reserved": 1 * G}]}}
    pool = parse_show_json(show)
    assert pool == {"served": 7 * G, "held": 8 * G, "program_held": 2 * G,
                    "program_mapped": 2 * G, "program_served": 0, "layout": 3,
                    "program_known": True}, pool
    assert parse_show_json({"ok": False}) is None
    old = parse_show_json({"process": {"layout_version": 2, "devices": []}})
    assert old["program_known"] is False

    def m(nvml, held=8 * G, program=0, served=7 * G, live=6 * G):
        return {"pool": {"served": served, "held": held, "program_held": program,
                         "program_mapped": program, "program_known": True},
                "nvml": nvml, "framework": {"framework": "torch", "live": live}}
    # Within 10% + 600 MiB: 8 GiB accounted against 8.5 GiB (context and workspaces) passes.
    assert evaluate(m(8 * G + G // 2))["verdict"] == "pass"
    # The JAX case: the program maps 6 GiB itself, the pool sees 1 GiB. Without the program
    # figure NVML disagrees; with it the bytes agree, but the pool does not cover the live arrays.
    v = evaluate(m(7 * G + 300 * MiB, held=1 * G, served=1 * G, program=0))
    assert v["verdict"] == "FAIL" and "NVML" in v["why"][0], v
    v = evaluate(m(7 * G + 300 * MiB, held=1 * G, served=1 * G, program=6 * G))
    assert v["verdict"] == "FAIL" and len(v["why"]) == 1 and "framework live" in v["why"][0], v
    # The program's own handles lent by the pool (layout 4) count as served.
    lent = m(7 * G + 300 * MiB, held=1 * G, served=1 * G, program=6 * G)
    lent["pool"]["program_served"] = 5 * G
    assert evaluate(lent)["verdict"] == "pass", evaluate(lent)
    # Served by the pool, nothing hidden: passes.
    assert evaluate(m(8 * G + 500 * MiB, program=0, live=6 * G))["verdict"] == "pass"
    # More than the margin away: fails (20 GiB on the GPU, 8 accounted).
    assert evaluate(m(20 * G))["verdict"] == "FAIL"
    # No live figure from the framework (a pluggable allocator keeps no statistics): judged on
    # the pool's bytes against NVML alone.
    assert evaluate(m(8 * G + G // 2, live=None))["verdict"] == "pass"
    assert evaluate(m(20 * G, live=None))["verdict"] == "FAIL"
    # No record, no NVML, error: not measured.
    assert evaluate({"pool": None, "nvml": G})["verdict"] == "not measured"
    assert evaluate({"pool": pool, "nvml": None})["verdict"] == "not measured"
    assert evaluate({"error": "x"})["verdict"] == "not measured"
    # The bytes line round trip and the table.
    line = PREFIX + json.dumps(m(8 * G + G // 2))
    assert find_measurement("PASS: x\n" + line + "\nchecksum: 1\n") == m(8 * G + G // 2)
    c = cell(evaluate(m(8 * G + G // 2)))
    assert c.startswith("pass: pool 7168 served / 8192 held + program 0 MiB vs NVML 8704 MiB"), c
    rows = [{"program": "jax_check", "config": "default", **evaluate(m(9 * G))}]
    t = table(rows)
    assert "jax_check" in t and "9216 MiB" in t, t
    print("matrix_bytes self-test: ok")
    return 0


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--self-test", action="store_true", help="check the pure-Python parts")
    sub = p.add_subparsers(dest="cmd")
    r = sub.add_parser("row", help="judge one shim run's stdout; print its table cell")
    r.add_argument("--name", required=True)
    r.add_argument("--config", default="")
    r.add_argument("--log", required=True, help="the run's stdout")
    r.add_argument("--json", help="append the row to this JSON file")
    t = sub.add_parser("table", help="print the rows of a JSON file as a table")
    t.add_argument("--json", required=True)
    a = sub.add_parser("report", help="measure this process (for tests; programs call report())")
    a.add_argument("framework", nargs="?", default="none")
    g = sub.add_parser("program", help="measure another process that holds --live bytes now")
    g.add_argument("--pid", type=int, required=True)
    g.add_argument("--live", type=int, required=True)
    args = p.parse_args(argv)
    if args.self_test:
        return self_test()
    if args.cmd == "row":
        return cmd_row(args)
    if args.cmd == "table":
        return cmd_table(args)
    if args.cmd == "report":
        report(args.framework)
        return 0
    if args.cmd == "program":
        report_program(args.pid, args.live)
        return 0
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
