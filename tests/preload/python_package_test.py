"""The in-tree Python package (python/gpustitch) on the simulated backend.

ctest runs it twice with PYTHONPATH=python: under LD_PRELOAD=libgpustitch.so with
GPUSTITCH_CONF=backend:sim ("loaded"), and without the library ("absent"). Allocations are made
through the library's own gpustitch_malloc/gpustitch_free (no CUDA needed), and the package's
figures are checked against them and against gpustitch_get_stats, and its snapshot() against the
repository's snapshot check (tests/shared/trace/check_snapshot.py). Exit status 0 when all hold.
"""
import ctypes
import os
import pickle
import sys
import tempfile
import time

import gpustitch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared",
                                "trace"))
import check_snapshot  # noqa: E402: the repository's check of PyTorch's snapshot structure

MiB = 1 << 20


def loaded():
    assert gpustitch.is_active()
    assert gpustitch.version()
    assert gpustitch.device_count() == 1
    proc = ctypes.CDLL(None)
    proc.gpustitch_malloc.restype = ctypes.c_void_p
    proc.gpustitch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    proc.gpustitch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                                    ctypes.c_void_p]
    blocks = [proc.gpustitch_malloc(16 * MiB, 0, None) for _ in range(8)]
    assert all(blocks)
    for b in blocks[::2]:
        proc.gpustitch_free(b, 16 * MiB, 0, None)
    stats = gpustitch.memory_stats(0)
    assert stats["allocated_bytes.all.current"] == 4 * 16 * MiB, stats
    check_snapshot_of(blocks)
    assert stats["reserved_bytes.all.current"] >= 8 * 16 * MiB, stats
    assert stats["allocated_bytes.all.peak"] >= 8 * 16 * MiB, stats
    assert stats["gpustitch.live_blocks"] == 4, stats
    # Reserved last rose for the eighth block: seven were allocated then, nothing waited.
    assert stats["gpustitch.peak_reserved_allocated"] == 7 * 16 * MiB, stats
    assert stats["gpustitch.peak_reserved_pending"] == 0, stats
    frag = gpustitch.fragmentation(0)
    expect = 1 - stats["allocated_bytes.all.current"] / stats["reserved_bytes.all.current"]
    assert abs(frag - expect) < 1e-9 and frag >= 0.45, (frag, expect)
    summary = gpustitch.memory_summary(0)
    assert "GPU reserved memory" in summary and "64.00 MiB" in summary, summary
    released = gpustitch.trim(0)
    after = gpustitch.memory_stats(0)
    assert released >= 4 * 16 * MiB, released
    assert after["reserved_bytes.all.current"] == stats["reserved_bytes.all.current"] - released
    assert after["allocated_bytes.all.current"] == stats["allocated_bytes.all.current"]
    # Fresh memory and the trim went through the driver's memory API: counted and timed.
    assert stats["gpustitch.driver_calls"] > 0 and stats["gpustitch.driver_ns"] > 0, stats
    # By kind: the program's threads' calls add up to all calls but the background thread's.
    by_kind = sum(stats[f"gpustitch.driver_op_calls.{op}"]
                  for op in ("create", "map", "set_access", "unmap", "release"))
    assert by_kind == stats["gpustitch.driver_calls"] - stats["gpustitch.driver_background_calls"]
    assert stats["gpustitch.driver_op_calls.create"] > 0, stats
    assert after["gpustitch.driver_calls"] > stats["gpustitch.driver_calls"], after
    workload_readers_agree(after)
    trimmed = gpustitch.snapshot()
    assert any(e["action"] == "segment_unmap" for e in trimmed["device_traces"][0]), trimmed
    assert check_snapshot.history_error(trimmed) is None, check_snapshot.history_error(trimmed)
    for b in blocks[1::2]:
        proc.gpustitch_free(b, 16 * MiB, 0, None)
    for bad in (lambda: gpustitch.memory_stats(5), lambda: gpustitch.trim(-1)):
        try:
            bad()
            raise AssertionError("an unserved device was accepted")
        except ValueError:
            pass


def workload_readers_agree(stats):
    """The GPU workloads' own readers of gpustitch_get_stats (bench/gpu/e2e/train_seqlen.py,
    tools/gpu/hf_workloads.py; they take the record's layout from this package in the tree, since
    the GPU machine does not install it) see the record the package sees, and their results
    print as JSON."""
    import json
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    sys.path[:0] = [os.path.join(root, "bench", "gpu", "e2e"), os.path.join(root, "tools", "gpu")]
    import hf_workloads
    import train_seqlen
    st = train_seqlen.Shim(None).stats()
    json.dumps(st)
    assert st["driver_calls"] == stats["gpustitch.driver_calls"], (st, stats)
    assert st["driver_op_calls"][0] == stats["gpustitch.driver_op_calls.create"], st
    assert st["peak_reserved_allocated"] == stats["gpustitch.peak_reserved_allocated"], st
    s = hf_workloads.pool_stats()
    assert list(s.driver_op_ns) == st["driver_op_ns"], (list(s.driver_op_ns), st)


def check_snapshot_of(blocks):
    """snapshot(path) writes memory_viz's pickle: the 4 live blocks in the segments and the
    8 allocations and 4 frees made so far in device_traces, stamped in microseconds since the
    epoch; snapshot() returns the same structure."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "snap.pickle")
        assert gpustitch.snapshot(path) == path
        with open(path, "rb") as f:
            snap = pickle.load(f)
    summary = check_snapshot.summarize(snap)
    assert summary["blocks"] == 4 and summary["allocated"] == 4 * 16 * MiB, summary
    blocks_actions = {k: v for k, v in summary["actions"].items() if not k.startswith("segment")}
    assert blocks_actions == {"alloc": 8, "free_requested": 4, "free_completed": 4}, summary
    # The pool's growth is in the timeline too, as expandable segments write it, and replays
    # backwards to nothing before the first allocation (memory_viz's Allocator State History).
    mapped = sum(e["size"] for e in snap["device_traces"][0] if e["action"] == "segment_map")
    assert mapped >= 8 * 16 * MiB, snap["device_traces"][0]
    assert check_snapshot.history_error(snap) is None, check_snapshot.history_error(snap)
    assert summary["alloc_sizes"] == [16 * MiB] * 8, summary
    trace = snap["device_traces"][0]
    assert [e["addr"] for e in trace if e["action"] == "alloc"] == blocks, trace
    assert [e["addr"] for e in trace if e["action"] == "free_requested"] == blocks[::2], trace
    now_us = time.time() * 1e6
    first, last = summary["time_us"]
    assert now_us - 60e6 < first <= last <= now_us + 1e6, (first, last, now_us)
    again = gpustitch.snapshot()
    assert check_snapshot.summarize(again)["actions"] == summary["actions"], again
    try:
        gpustitch.snapshot("/nonexistent-dir/snap.pickle")
        raise AssertionError("an unwritable path was accepted")
    except OSError as e:
        assert "/nonexistent-dir/snap.pickle" in str(e), str(e)


def absent():
    assert not gpustitch.is_active()
    try:
        gpustitch.memory_stats(0)
        raise AssertionError("no error without the library")
    except gpustitch.NotLoadedError as e:
        assert "gpustitch run" in str(e), str(e)
    try:
        gpustitch.snapshot("/tmp/never-written.pickle")
        raise AssertionError("snapshot() without the library")
    except gpustitch.NotLoadedError as e:
        assert "not loaded" in str(e) and "gpustitch run" in str(e), str(e)
    assert not os.path.exists("/tmp/never-written.pickle")


if __name__ == "__main__":
    {"loaded": loaded, "absent": absent}[sys.argv[1]]()
    print("ok")
