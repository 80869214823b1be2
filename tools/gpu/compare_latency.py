#!/usr/bin/env python3
"""Side by side: alloc_latency run natively and under LD_PRELOAD=libgpustitch.so.

    compare_latency.py NATIVE.json SHIM.json

Prints markdown: the cache-hit allocation and free medians through the shim against the target
(at most 150 ns each), and each pass-through call natively and through the shim (at most 50 ns
more). Reads the JSON files alloc_latency --json writes; exits 1 if a target is missed.
"""
import json
import sys

ALLOC_TARGET_NS = 150
PASS_THROUGH_EXTRA_NS = 50


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        native = json.load(f)
    with open(sys.argv[2]) as f:
        shim = json.load(f)
    missed = 0
    print(f"### alloc_latency, {native.get('cudart', '?')} cudart: native vs LD_PRELOAD shim\n")
    print("| allocator | size | native alloc | shim alloc | native free | shim free | "
          f"target (<= {ALLOC_TARGET_NS} ns) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    native_rows = {(r["allocator"], r["size"]): r for r in native.get("rows", [])}
    for r in shim.get("rows", []):
        name = r["allocator"]
        if "through libgpustitch" not in name or r["size"] not in ("512 B", "64 KiB", "2 MiB"):
            continue
        base = native_rows.get((name.replace(" (through libgpustitch)", ""), r["size"]), {})
        ok = r["alloc_median"] <= ALLOC_TARGET_NS and r["free_median"] <= ALLOC_TARGET_NS
        missed += 0 if ok else 1
        print(f"| {name} | {r['size']} | {base.get('alloc_median', '-')} | {r['alloc_median']:.0f} | "
              f"{base.get('free_median', '-')} | {r['free_median']:.0f} | "
              f"{'met' if ok else 'MISSED'} |")
    print("\n| single call | kind | native median | shim median | extra | "
          f"target (pass-through <= +{PASS_THROUGH_EXTRA_NS} ns) |")
    print("| --- | --- | --- | --- | --- | --- |")
    native_calls = {c["call"]: c for c in native.get("calls", [])}
    for c in shim.get("calls", []):
        base = native_calls.get(c["call"])
        if base is None:
            continue
        extra = c["median"] - base["median"]
        verdict = ""
        if c["kind"] == "pass-through":
            ok = extra <= PASS_THROUGH_EXTRA_NS
            missed += 0 if ok else 1
            verdict = "met" if ok else "MISSED"
        print(f"| {c['call']} | {c['kind']} | {base['median']:.0f} | {c['median']:.0f} | "
              f"{extra:+.0f} | {verdict} |")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
