#!/usr/bin/env python3
"""Checks a gpustitch snapshot pickle against the structure torch.cuda.memory._snapshot()
documents (the one pytorch.org/memory_viz reads), then prints a JSON summary for the C++ test.

usage: check_snapshot.py snapshot FILE   -> checks, prints {"segments": n, ...} or exits 1
       check_snapshot.py repr FILE       -> prints repr() of the unpickled object
Importable: summarize(snapshot_dict) returns the summary and raises SnapshotError;
history_error(snapshot_dict) replays the timeline as memory_viz's Allocator State History does
(None: every step can be drawn). The printed summary has it as "history_error".
"""
import json
import pickle
import sys

SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size", "stream",
                "segment_type", "blocks"}
BLOCK_KEYS = {"size", "requested_size", "address", "state", "frames"}
FRAME_KEYS = {"filename", "line", "name"}
TRACE_KEYS = {"action", "frames", "size", "stream"}
STATES = {"active_allocated", "active_pending_free", "inactive"}
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "oom", "snapshot"}


class SnapshotError(ValueError):
    pass


def fail(msg):
    raise SnapshotError(msg)


def summarize(snap):
    if not isinstance(snap, dict):
        fail("top level is not a dict")
    for key in ("segments", "device_traces"):
        if key not in snap:
            fail("missing top-level key " + key)
    allocated = 0
    blocks = 0
    frames_seen = []
    for s in snap["segments"]:
        missing = SEGMENT_KEYS - set(s)
        if missing:
            fail("segment lacks %s" % sorted(missing))
        if s["segment_type"] not in ("small", "large"):
            fail("bad segment_type %r" % s["segment_type"])
        at = s["address"]
        active = 0
        seg_allocated = 0
        for b in s["blocks"]:
            missing = BLOCK_KEYS - set(b)
            if missing:
                fail("block lacks %s" % sorted(missing))
            if b["state"] not in STATES:
                fail("bad state %r" % b["state"])
            if b["address"] != at:
                fail("blocks of segment 0x%x are not contiguous at 0x%x" % (s["address"], at))
            at += b["size"]
            for f in b["frames"]:
                if set(f) != FRAME_KEYS:
                    fail("frame keys %s" % sorted(f))
                frames_seen.append(f["name"])
            if b["state"] != "inactive":
                active += b["size"]
                if b["requested_size"] > b["size"]:
                    fail("requested_size > size")
            if b["state"] == "active_allocated":
                seg_allocated += b["size"]
                blocks += 1
        if at != s["address"] + s["total_size"]:
            fail("blocks do not cover segment 0x%x" % s["address"])
        if seg_allocated != s["allocated_size"]:
            fail("allocated_size %d != sum of allocated blocks %d"
                 % (s["allocated_size"], seg_allocated))
        if active != s["active_size"]:
            fail("active_size %d != sum of active blocks %d" % (s["active_size"], active))
        allocated += seg_allocated
    traces = snap["device_traces"]
    if not isinstance(traces, list):
        fail("device_traces is not a list")
    entries = 0
    actions = {}
    alloc_sizes = []
    trace_frames = 0
    times = []
    for per_device in traces:
        if not isinstance(per_device, list):
            fail("a device's trace is not a list")
        for e in per_device:
            missing = TRACE_KEYS - set(e)
            if missing:
                fail("trace entry lacks %s" % sorted(missing))
            if e["action"] not in ACTIONS:
                fail("bad action %r" % e["action"])
            if e["action"] != "oom" and "addr" not in e:
                fail("trace entry lacks addr")
            if e["action"] == "oom" and "device_free" not in e:
                fail("oom entry lacks device_free")
            for f in e["frames"]:
                if set(f) != FRAME_KEYS:
                    fail("trace frame keys %s" % sorted(f))
            if e["frames"]:
                trace_frames += 1
            if e["action"] == "alloc":
                alloc_sizes.append(e["size"])
            if "time_us" in e:
                times.append(e["time_us"])
            actions[e["action"]] = actions.get(e["action"], 0) + 1
            entries += 1
    return {"segments": len(snap["segments"]), "blocks": blocks, "allocated": allocated,
            "devices": len(traces), "entries": entries, "frames": frames_seen,
            "actions": actions, "alloc_sizes": alloc_sizes, "trace_frames": trace_frames,
            "time_us": [min(times), max(times)] if times else []}


def history_error(snap):
    """Replays every device's trace backwards from the segments, as memory_viz's "Allocator State
    History" page does when an event is selected (MemoryView.simulate_memory in MemoryViz.js):
    segment_unmap puts its range back, merging with touching segments of the same stream,
    segment_map takes its range out of the one segment holding it, segment_free/segment_alloc put
    back/take out a whole segment, free puts a block back and alloc takes it out. Returns None when
    every step is one the page can draw, else what would break it: a segment_map whose range no
    single segment holds, a segment_unmap or block over mapped/unmapped memory, a block outside
    every segment."""
    for device in range(len(snap["device_traces"])):
        segs = sorted(([s["address"], s["total_size"], s["stream"]] for s in snap["segments"]
                       if s["device"] == device), key=lambda x: x[0])
        blocks = {}
        for s in snap["segments"]:
            if s["device"] != device:
                continue
            for b in s["blocks"]:
                if b["state"] in ("active_allocated", "active_pending_free"):
                    blocks[b["address"]] = b["size"]

        def holder(lo, hi):
            for i, (a, n, _) in enumerate(segs):
                if a <= lo and hi <= a + n:
                    return i
            return None

        def overlaps(lo, hi):
            return any(a < hi and lo < a + n for a, n, _ in segs)

        # annotate_snapshot: free_requested directly followed by its free_completed is one free.
        trace = []
        for e in snap["device_traces"][device]:
            if (e["action"] == "free_completed" and trace and trace[-1]["action"] == "free_requested"
                    and trace[-1]["addr"] == e["addr"]):
                trace[-1] = dict(trace[-1], action="free")
                continue
            trace.append(e)
        # Selecting event k draws the state after it: events after k are undone, never event 0.
        for i in range(len(trace) - 1, 0, -1):
            e = trace[i]
            a = e["action"]
            where = "device %d event %d (%s 0x%x+%d)" % (device, i, a, e.get("addr", 0), e["size"])
            lo, hi = e.get("addr", 0), e.get("addr", 0) + e["size"]
            if a in ("free", "free_completed"):
                if holder(lo, hi) is None:
                    return where + ": the block lies outside every segment"
                blocks[lo] = e["size"]
            elif a == "free_requested":
                if lo not in blocks:
                    return where + ": no such block"
            elif a == "alloc":
                blocks.pop(lo, None)
            elif a in ("segment_unmap", "segment_free"):
                if overlaps(lo, hi):
                    return where + ": the range is mapped"
                seg = [lo, e["size"], e["stream"]]
                segs.append(seg)
                segs.sort(key=lambda x: x[0])
                if a == "segment_unmap":
                    k = segs.index(seg)
                    if k + 1 < len(segs) and hi == segs[k + 1][0] and segs[k + 1][2] == seg[2]:
                        seg[1] += segs[k + 1][1]
                        del segs[k + 1]
                    if k > 0 and segs[k - 1][0] + segs[k - 1][1] == lo and segs[k - 1][2] == seg[2]:
                        segs[k - 1][1] += seg[1]
                        del segs[k]
            elif a in ("segment_map", "segment_alloc"):
                k = holder(lo, hi)
                if k is None or (a == "segment_alloc" and segs[k][:2] != [lo, e["size"]]):
                    return where + ": no segment holds the range"
                s_lo, s_n, s_stream = segs[k]
                del segs[k]
                if s_lo < lo:
                    segs.append([s_lo, lo - s_lo, s_stream])
                if hi < s_lo + s_n:
                    segs.append([hi, s_lo + s_n - hi, s_stream])
                segs.sort(key=lambda x: x[0])
                for b, n in blocks.items():
                    if b < hi and lo < b + n:
                        return where + ": block 0x%x would lie outside every segment" % b
    return None


def main():
    mode, path = sys.argv[1], sys.argv[2]
    with open(path, "rb") as f:
        obj = pickle.load(f)
    if mode == "repr":
        print(repr(obj))
        return
    try:
        summary = summarize(obj)
        summary["history_error"] = history_error(obj)
        print(json.dumps(summary))
    except SnapshotError as e:
        print("FAIL: %s" % e)
        sys.exit(1)


if __name__ == "__main__":
    main()
