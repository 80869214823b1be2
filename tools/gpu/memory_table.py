#!/usr/bin/env python3
"""memory_table.py: the table README's "On the GPU" shows, from memory_compare.sh's JSON lines.

    tools/gpu/memory_compare.sh --build .devbuild --rounds 3 > runs.jsonl   # on the GPU machine
    python3 tools/gpu/memory_table.py runs.jsonl                            # anywhere

Per workload, one row per configuration (in the order they first ran) and one column per round:

  memory    peak reserved / PyTorch default's peak allocated in the same round (the README's
            measure: what the program's own allocator says it needed; for the GPT workload both
            less its balloon), then the median over the rounds;
  tokens/s  / PyTorch default's in the same round (the rounds are interleaved so that they share
            the machine's drift; the ratio within a round is the comparable figure), then the
            median;
  pool's driver time and waits for the GPU inside the timed steps, for the gpustitch rows.

A round without a PyTorch default run gives "-" where a ratio needs it; a run that failed gives
its error's first words. --json prints the same figures as one JSON object. --self-test checks the
arithmetic on canned lines (no GPU needed; ctest runs it).
"""
import argparse
import json
import statistics
import sys

BASELINE = "pytorch"


def figures(run):
    """(peak reserved, peak allocated) of one run, in bytes, as its workload script reports them."""
    if "peak_reserved_bytes" in run:  # bench/gpu/e2e/train_seqlen.py (balloon already taken off)
        return run.get("peak_reserved_bytes"), run.get("peak_allocated_bytes")
    # tools/gpu/hf_workloads.py: under the pool, peak_allocated is the pool's own; PyTorch's is
    # torch_peak_allocated (the baseline row's peak_allocated is PyTorch's either way).
    return run.get("peak_reserved"), run.get("torch_peak_allocated", run.get("peak_allocated"))


def ratio(a, b):
    return a / b if a and b else None


def build(runs):
    """{workload: {"rounds": [r...], "configs": {name: {"memory": {r: x}, "speed": {r: x},
    "driver_ms": {r: ms}, "waits": {r: [n, ms]}, "error": {r: text}}}}}"""
    out = {}
    for run in runs:
        wl, name, rnd = run.get("workload"), run.get("config"), run.get("round")
        if wl is None or name is None or rnd is None:
            continue
        w = out.setdefault(wl, {"rounds": [], "configs": {}, "_runs": {}})
        if rnd not in w["rounds"]:
            w["rounds"].append(rnd)
        w["configs"].setdefault(name, {"memory": {}, "speed": {}, "driver_ms": {}, "waits": {},
                                       "error": {}})
        w["_runs"][(name, rnd)] = run
    for w in out.values():
        runs_of = w.pop("_runs")
        w["rounds"].sort()
        for name, row in w["configs"].items():
            for rnd in w["rounds"]:
                run = runs_of.get((name, rnd))
                if run is None:
                    continue
                if run.get("error") or run.get("oom"):
                    row["error"][rnd] = str(run.get("error") or "out of memory")[:60]
                    continue
                base = runs_of.get((BASELINE, rnd), {})
                reserved, _ = figures(run)
                _, base_alloc = figures(base) if base else (None, None)
                m = ratio(reserved, base_alloc)
                s = ratio(run.get("tokens_per_s"), base.get("tokens_per_s"))
                if m is not None:
                    row["memory"][rnd] = round(m, 4)
                if s is not None:
                    row["speed"][rnd] = round(s, 3)
                if run.get("pool_driver_ms_timed") is not None:
                    row["driver_ms"][rnd] = run["pool_driver_ms_timed"]
                if run.get("pool_fence_waits_timed") is not None:
                    row["waits"][rnd] = run["pool_fence_waits_timed"]
            for key in ("memory", "speed"):
                vals = list(row[key].values())
                row[key + "_median"] = round(statistics.median(vals), 4) if vals else None
    return out


def cell(values, rounds, fmt):
    return "; ".join(fmt(values[r]) if r in values else "-" for r in rounds)


def markdown(table):
    lines = []
    for wl, w in table.items():
        rounds = w["rounds"]
        lines.append(f"{wl}, rounds {', '.join(str(r) for r in rounds)}:")
        lines.append("")
        lines.append("| configuration | memory (per round) | median | tokens/s (per round) | median "
                     "| pool's driver ms, timed | waits for the GPU (count, ms) | failed runs |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, row in w["configs"].items():
            err = "; ".join(f"round {r}: {e}" for r, e in row["error"].items())
            med_m = f"{row['memory_median']:.3f}" if row["memory_median"] is not None else "-"
            med_s = f"{row['speed_median']:.3f}" if row["speed_median"] is not None else "-"
            drv = cell(row["driver_ms"], rounds, lambda v: f"{v:.0f}") if row["driver_ms"] else ""
            waits = (cell(row["waits"], rounds, lambda v: f"{v[0]} ({v[1]:.0f})")
                     if row["waits"] else "")
            lines.append(f"| {name} | {cell(row['memory'], rounds, lambda v: f'{v:.3f}')} | "
                         f"{med_m} | {cell(row['speed'], rounds, lambda v: f'{v:.3f}')} | {med_s} "
                         f"| {drv} | {waits} | {err} |")
        lines.append("")
    return "\n".join(lines)


def read(stream):
    runs = []
    for line in stream:
        line = line.strip()
        if line.startswith("{"):
            try:
                runs.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return runs


def self_test():
    G = 1 << 30
    lines = [
        # GPT (train_seqlen.py): figures less the balloon, PyTorch's allocated for every row.
        {"workload": "gpt", "config": "pytorch", "round": 0, "tokens_per_s": 100.0,
         "peak_reserved_bytes": 13 * G, "peak_allocated_bytes": 10 * G},
        {"workload": "gpt", "config": "gpustitch", "round": 0, "tokens_per_s": 95.0,
         "peak_reserved_bytes": int(10.2 * G), "peak_allocated_bytes": 10 * G,
         "pool_driver_ms_timed": 51.4, "pool_fence_waits_timed": [1, 1.2]},
        {"workload": "gpt", "config": "pytorch", "round": 1, "tokens_per_s": 200.0,
         "peak_reserved_bytes": 13 * G, "peak_allocated_bytes": 10 * G},
        {"workload": "gpt", "config": "gpustitch", "round": 1, "tokens_per_s": 210.0,
         "peak_reserved_bytes": int(10.4 * G), "peak_allocated_bytes": 10 * G},
        {"workload": "gpt", "config": "gpustitch", "round": 2, "tokens_per_s": 50.0,
         "peak_reserved_bytes": 10 * G},  # no baseline in round 2
        # HF (hf_workloads.py): under the pool, the ratio is taken of PyTorch's own peak.
        {"workload": "hf", "config": "pytorch", "round": 0, "tokens_per_s": 60.0,
         "peak_reserved": 20 * G, "peak_allocated": 10 * G},
        {"workload": "hf", "config": "gpustitch", "round": 0, "tokens_per_s": 54.0,
         "peak_reserved": int(10.1 * G), "peak_allocated": int(10.2 * G),
         "torch_peak_allocated": 10 * G},
        {"workload": "hf", "config": "expandable", "round": 0, "error": "OutOfMemoryError: x"},
    ]
    t = build(lines)
    g = t["gpt"]["configs"]["gpustitch"]
    assert t["gpt"]["rounds"] == [0, 1, 2], t["gpt"]["rounds"]
    assert g["memory"] == {0: 1.02, 1: 1.04}, g  # round 2 has no baseline
    assert g["speed"] == {0: 0.95, 1: 1.05}, g["speed"]
    assert abs(g["memory_median"] - 1.03) < 1e-9 and abs(g["speed_median"] - 1.0) < 1e-9, g
    assert g["driver_ms"] == {0: 51.4} and g["waits"] == {0: [1, 1.2]}, g
    assert t["gpt"]["configs"]["pytorch"]["memory"] == {0: 1.3, 1: 1.3}
    h = t["hf"]["configs"]
    assert h["gpustitch"]["memory"] == {0: 1.01} and h["gpustitch"]["speed"] == {0: 0.9}, h
    assert h["expandable"]["error"] == {0: "OutOfMemoryError: x"} and not h["expandable"]["memory"]
    md = markdown(t)
    assert "| gpustitch | 1.020; 1.040; - | 1.030 | 0.950; 1.050; - | 1.000 | 51; -; - | 1 (1); -; - |  |" \
        in md, md
    assert "| round 0: OutOfMemoryError: x |" in md, md
    assert read(['noise', '{"a": 1}', '{broken']) == [{"a": 1}]
    print("memory_table self-test: ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", nargs="?", help="memory_compare.sh's output (default: stdin)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of markdown")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        self_test()
        return 0
    with (open(args.file) if args.file else sys.stdin) as f:
        table = build(read(f))
    if not table:
        print("memory_table: no runs in the input", file=sys.stderr)
        return 1
    print(json.dumps(table) if args.json else markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
