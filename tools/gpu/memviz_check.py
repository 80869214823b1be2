#!/usr/bin/env python3
"""A live process's gpustitch snapshot read by PyTorch's own memory_viz tools (GPU machine).

Run on a GPU machine with torch, under the shim, with allocation sites sampled so the timeline's
allocations carry stacks:

    PYTHONPATH=python BUILD/tools/gpustitch run --conf sites_min_mb:1 -- \\
        python3 tools/gpu/memviz_check.py --cli BUILD/tools/gpustitch [--out DIR]

A small PyTorch training loop (an MLP, tensors of 1-64 MiB, forward/backward/step, some freed
every step) allocates through the pool; then the process's snapshot is written twice, by
gpustitch.snapshot(path) (in process, the library's C API) and by `gpustitch snapshot PID` (the
CLI asking this process through its request channel), and each is fed to
torch.cuda._memory_viz:

  structure     the repository's snapshot check (tests/shared/trace/check_snapshot.py) passes;
                device_traces has at least as many allocations as the workload made, time_us is
                microseconds since the epoch within this run, with sites sampled some
                allocations carry frames, the pool's growth is there as segment_map entries,
                and the timeline replays backwards from the segments as memory_viz's
                Allocator State History does (check_snapshot.history_error)
  stats         _memory_viz.segsum() (the `stats` action) runs its own consistency asserts and
                reports the pool's segments and reserved bytes
  trace         _memory_viz.trace() (the text timeline) lists the allocations ("Device 0", one
                line per alloc) and free_completed entries
  trace_plot    _memory_viz.trace_plot() builds the "Active Memory Timeline" page; the snapshot
                embedded in it unpickles, and replaying its device_traces as memory_viz's
                process_alloc_data does (alloc opens an element, free / free_completed closes
                it) gives a non-empty timeline with a peak above 0
  segment_plot  _memory_viz.segment_plot() builds the segment page

Prints one JSON line {"pass": bool, "snapshots": {"api": {...}, "cli": {...}}}; exit status 0 when
every check of both snapshots passed. --out DIR keeps the pickles and the HTML pages.
"""
import argparse
import base64
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
for extra in (os.path.join(REPO, "python"), os.path.join(REPO, "tests", "shared", "trace")):
    if os.path.isdir(extra) and extra not in sys.path:
        sys.path.insert(0, extra)

MiB = 1 << 20


def workload(torch, steps=20):
    """An MLP trained for a few steps with a batch that changes size: allocations of several
    sizes, freed and reallocated every step. Returns the number of tensors it allocated (a lower
    bound on what reaches the pool)."""
    dev = torch.device("cuda", 0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 2048)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    keep = []
    for step in range(steps):
        batch = 256 + 128 * (step % 4)
        x = torch.randn(batch, 2048, device=dev)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        keep.append(torch.empty((1 + step % 8) * MiB, dtype=torch.uint8, device=dev))
        if len(keep) > 4:
            keep.pop(0)
    torch.cuda.synchronize()
    return steps * 2, keep


def replay_timeline(snap, device=0):
    """memory_viz's process_alloc_data (MemoryViz.js), for the Active Memory Timeline: the
    number of elements drawn and the peak of the summed live sizes over the events."""
    elements = 0
    live = {}
    total = peak = 0
    for e in snap["device_traces"][device]:
        if e["action"] == "alloc":
            elements += 1
            live[e["addr"]] = e["size"]
            total += e["size"]
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            if e["action"] == "free_completed":
                total -= live.pop(e["addr"])
        peak = max(peak, total)
    return elements, peak


def embedded_snapshot(html):
    """The snapshot _memory_viz._format_viz embedded in its page (base64 of the pickle)."""
    m = re.search(r'"base64":\s*"([^"]+)"', html)
    if not m:
        return None
    return pickle.loads(base64.b64decode(m.group(1)))


def check_snapshot_file(path, viz, workload_allocs, started_us, sampled, out_dir, name):
    res = {"path": path, "pass": False}
    with open(path, "rb") as f:
        snap = pickle.load(f)
    checks = {}

    def run(check, fn):
        try:
            checks[check] = fn()
        except Exception as e:  # noqa: BLE001: record and go on with the other checks
            checks[check] = {"pass": False, "error": f"{type(e).__name__}: {e}"[:400],
                             "where": traceback.format_exc().splitlines()[-3:]}

    def structure():
        import check_snapshot
        s = check_snapshot.summarize(snap)
        allocs = s["actions"].get("alloc", 0)
        first, last = s["time_us"] if s["time_us"] else (0, 0)
        now_us = time.time() * 1e6
        history = check_snapshot.history_error(snap)
        ok = (allocs >= workload_allocs and started_us - 1e6 <= first <= last <= now_us + 1e6
              and (s["trace_frames"] > 0 or not sampled)
              and s["actions"].get("segment_map", 0) > 0 and history is None)
        return {"pass": ok, "segments": s["segments"], "blocks": s["blocks"], "allocs": allocs,
                "actions": s["actions"], "trace_frames": s["trace_frames"],
                "time_us": s["time_us"], "history_error": history}

    def stats():
        text = viz.segsum(snap)  # asserts its own free + allocated == reserved
        reserved = sum(seg["total_size"] for seg in snap["segments"])
        return {"pass": "segments:" in text and reserved > 0, "reserved": reserved,
                "tail": text.splitlines()[-12:-9]}

    def text_trace():
        text = viz.trace(snap)
        allocs = len(re.findall(r"^\w+ = (?:seg_\d+|MEM)\[", text, re.M))
        completed = text.count("# free completed for")
        return {"pass": "Device 0" in text and allocs >= workload_allocs and completed > 0,
                "alloc_lines": allocs, "free_completed_lines": completed}

    def trace_plot():
        html = viz.trace_plot(snap)
        # PyTorch >= 2.1 embeds the pickle for MemoryViz.js; older ones drew the data in Python.
        inner = embedded_snapshot(html)
        elements, peak = replay_timeline(inner if inner is not None else snap)
        if out_dir:
            with open(os.path.join(out_dir, f"{name}_trace.html"), "w") as f:
                f.write(html)
        return {"pass": "Active Memory Timeline" in html and elements >= workload_allocs
                and peak > 0, "elements": elements, "peak": peak, "html_bytes": len(html)}

    def segment_plot():
        html = viz.segment_plot(snap)
        inner = embedded_snapshot(html)
        if out_dir:
            with open(os.path.join(out_dir, f"{name}_segments.html"), "w") as f:
                f.write(html)
        return {"pass": inner is not None and len(inner["segments"]) == len(snap["segments"]),
                "html_bytes": len(html)}

    run("structure", structure)
    run("stats", stats)
    run("trace", text_trace)
    run("trace_plot", trace_plot)
    run("segment_plot", segment_plot)
    res["checks"] = checks
    res["pass"] = all(c.get("pass") for c in checks.values())
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli", required=True, help="the gpustitch CLI (BUILD/tools/gpustitch)")
    ap.add_argument("--out", help="keep the snapshots and HTML pages in this directory")
    args = ap.parse_args()
    out = {"pass": False, "snapshots": {}}
    try:
        import torch
        import torch.cuda._memory_viz as viz
        import gpustitch
    except ImportError as e:
        out["error"] = f"cannot import: {e}"
        print(json.dumps(out), flush=True)
        return 1
    out["torch"] = torch.__version__
    if not torch.cuda.is_available() or not gpustitch.is_active():
        out["error"] = "no CUDA device, or the pool is not active (run under `gpustitch run`)"
        print(json.dumps(out), flush=True)
        return 1
    sampled = "sites_min_mb" in os.environ.get("GPUSTITCH_CONF", "") or \
        "sites_sample" in os.environ.get("GPUSTITCH_CONF", "")
    started_us = time.time() * 1e6
    allocs, keep = workload(torch)
    out_dir = args.out or tempfile.mkdtemp(prefix="gpustitch-memviz-")
    os.makedirs(out_dir, exist_ok=True)

    api_path = os.path.join(out_dir, "api.pickle")
    gpustitch.snapshot(api_path)
    out["snapshots"]["api"] = check_snapshot_file(api_path, viz, allocs, started_us, sampled,
                                                  args.out, "api")

    cli_path = os.path.join(out_dir, "cli.pickle")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run([args.cli, "snapshot", str(os.getpid()), "-o", cli_path],
                       env=env, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        out["snapshots"]["cli"] = {"pass": False, "error": (r.stderr or r.stdout)[-400:]}
    else:
        out["snapshots"]["cli"] = check_snapshot_file(cli_path, viz, allocs, started_us, sampled,
                                                      args.out, "cli")
    del keep
    out["pass"] = all(s.get("pass") for s in out["snapshots"].values())
    if not args.out:
        for p in (api_path, cli_path):
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(out_dir)
    print(json.dumps(out), flush=True)
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
