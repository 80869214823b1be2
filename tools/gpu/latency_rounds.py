#!/usr/bin/env python3
"""Median over rounds of alloc_latency JSON files named LABEL-LINK-ROUND.json, side by side.

    latency_rounds.py DIR

Prints markdown, one table per CUDA runtime link: for each shim row (allocations through
libgpustitch, cache hits at 512 B, 64 KiB, 2 MiB) and each single call, the median over the
rounds of each label's median, and the range over the rounds, in ns.
"""
import collections
import json
import os
import re
import statistics
import sys

NAME = re.compile(r"^(?P<label>[a-z]+)-(?P<link>[a-z]+)-(?P<round>\d+)\.json$")
SIZES = ("512 B", "64 KiB", "2 MiB")


def fmt(values):
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.0f} ({min(values):.0f}-{max(values):.0f})"


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    # link -> key -> label -> [values over rounds]
    data = collections.defaultdict(lambda: collections.defaultdict(lambda: collections.defaultdict(list)))
    labels, rounds = [], collections.Counter()
    for name in sorted(os.listdir(sys.argv[1])):
        m = NAME.match(name)
        if not m:
            continue
        try:
            with open(os.path.join(sys.argv[1], name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        label, link = m["label"], m["link"]
        if label not in labels:
            labels.append(label)
        rounds[(label, link)] += 1
        for r in doc.get("rows", []):
            if "through libgpustitch" in r["allocator"] and r["size"] in SIZES:
                base = r["allocator"].replace(" (through libgpustitch)", "")
                data[link][(base, r["size"], "alloc")][label].append(r["alloc_median"])
                data[link][(base, r["size"], "free")][label].append(r["free_median"])
        for c in doc.get("calls", []):
            data[link][(c["call"], "", c["kind"])][label].append(c["median"])
    for link, rows in data.items():
        counts = ", ".join(f"{lab}: {rounds[(lab, link)]}" for lab in labels)
        print(f"### {link} CUDA runtime, rounds ({counts}); ns, median (range) over rounds\n")
        print("| call | size | what | " + " | ".join(labels) + " |")
        print("| --- | --- | --- | " + " | ".join("---" for _ in labels) + " |")
        for (call, size, what), per in rows.items():
            print(f"| {call} | {size} | {what} | " + " | ".join(fmt(per.get(lab, [])) for lab in labels) + " |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
