#!/usr/bin/env python3
"""PyTorch's own memory tools, errors and graphs under `gpustitch run` (the drop-in path).

Run on a GPU machine, under the shim with run's defaults (PyTorch's backend:cudaMallocAsync):

    BUILD/tools/gpustitch run -- python3 tools/gpu/torch_dropin_check.py

Each check uses PyTorch exactly as its users do and compares with the pool's own figures, read
through the library's C API (gpustitch_get_stats, found in the process since the library is
preloaded):

  backend         torch.cuda.get_allocator_backend() is cudaMallocAsync and the pool is active
  monitor         the seeds' monitor, unchanged: 1 - allocated_bytes.all.current /
                  reserved_bytes.all.current from torch.cuda.memory_stats(), empty_cache() above
                  45%; the figures must be the pool's (reserved = pool reserved, allocated = pool
                  allocated), not zeros
  summary         torch.cuda.memory_summary() runs and shows the pool's reserved bytes
  mem_get_info    torch.cuda.mem_get_info(): 0 < free <= total
  peaks           max_memory_allocated() covers a 1 GiB tensor freed since, and after
                  reset_peak_memory_stats() falls back to what is allocated now
  empty_cache     empty_cache() after freeing 2 GiB lowers memory_reserved() and the pool's
                  reserved bytes by at least 1 GiB
  oom             allocating beyond the device raises torch.OutOfMemoryError (not a generic
                  AcceleratorError/RuntimeError), and allocation works again afterwards
  cuda_graph      torch.cuda.CUDAGraph capture of y = x * 2 + 1 (plus a temporary), replayed on
                  new inputs, gives the right values

Prints one JSON line: {"pass": bool, "checks": {name: {"pass": bool, ...}}, ...}; exit status 0
when every check passed, 1 otherwise. A check that raises is a failure with the error recorded;
the others still run.
"""
import ctypes
import json
import sys
import traceback

import torch

GiB = 1 << 30
MiB = 1 << 20


class PoolStats(ctypes.Structure):
    """gpustitch_device_stats (preload/include/gpustitch/gpustitch.h), field for field."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "allocs", "frees", "cache_hits", "fresh", "stitches", "ooms", "live_blocks",
            "bytes_requested", "bytes_allocated", "bytes_reserved", "bytes_cached",
            "peak_allocated", "peak_reserved", "largest_possible", "device_free", "device_total",
        )
    ]


def _library():
    """The preloaded libgpustitch.so's C API, or None when it is not in the process."""
    try:
        proc = ctypes.CDLL(None)
        proc.gpustitch_active.restype = ctypes.c_int
        proc.gpustitch_get_stats.restype = ctypes.c_int
        proc.gpustitch_get_stats.argtypes = [ctypes.c_int, ctypes.POINTER(PoolStats),
                                             ctypes.c_size_t]
        return proc
    except (OSError, AttributeError):
        return None


LIB = _library()


def pool_stats(device=0):
    if LIB is None:
        return None
    s = PoolStats()
    if LIB.gpustitch_get_stats(device, ctypes.byref(s), ctypes.sizeof(s)) != 0:
        return None
    return s


def close(a, b, rel=0.02, abs_=8 * MiB):
    """Figures read a moment apart: equal up to a small drift (the reclaimer thread)."""
    return abs(a - b) <= max(abs_, rel * max(a, b))


def check_backend():
    backend = torch.cuda.get_allocator_backend()
    active = bool(LIB is not None and LIB.gpustitch_active() == 1)
    return {"pass": backend == "cudaMallocAsync" and active, "backend": backend,
            "gpustitch_active": active}


def check_monitor():
    # A fragmenting pattern: many tensors of mixed sizes, every other one freed.
    keep = []
    for i in range(200):
        t = torch.empty((1 + (i * 37) % 64) * MiB, dtype=torch.uint8, device="cuda")
        if i % 2 == 0:
            keep.append(t)
        del t
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    allocated = stats.get("allocated_bytes.all.current", 0)
    reserved = stats.get("reserved_bytes.all.current", 0)
    pool = pool_stats()  # read beside PyTorch's figures, before the monitor acts
    frag = 1 - allocated / reserved if reserved else 0.0  # the seeds' monitor, verbatim
    emptied = False
    if frag > 0.45:
        torch.cuda.empty_cache()
        emptied = True
    ok = reserved > 0 and allocated > 0 and pool is not None
    if ok:
        ok = close(reserved, pool.bytes_reserved) and close(allocated, pool.bytes_allocated)
    pool_frag = (1 - pool.bytes_allocated / pool.bytes_reserved
                 if pool is not None and pool.bytes_reserved else None)
    del keep
    return {"pass": bool(ok), "allocated": allocated, "reserved": reserved,
            "fragmentation": round(frag, 4),
            "pool_fragmentation": None if pool_frag is None else round(pool_frag, 4),
            "pool_reserved": None if pool is None else pool.bytes_reserved,
            "pool_allocated": None if pool is None else pool.bytes_allocated,
            "empty_cache_called": emptied}


def check_summary():
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    text = torch.cuda.memory_summary()
    reserved = torch.cuda.memory_reserved()
    ok = "reserved" in text.lower() and reserved >= 256 * MiB
    del x
    return {"pass": bool(ok), "memory_reserved": reserved, "lines": len(text.splitlines())}


def check_mem_get_info():
    free, total = torch.cuda.mem_get_info()
    return {"pass": 0 < free <= total, "free": free, "total": total}


def check_peaks():
    torch.cuda.synchronize()
    x = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    with_tensor = torch.cuda.memory_allocated()
    del x
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    after_reset = torch.cuda.max_memory_allocated()
    now = torch.cuda.memory_allocated()
    ok = peak >= with_tensor >= GiB and after_reset < peak - GiB // 2 and after_reset >= now
    return {"pass": bool(ok), "peak": peak, "after_reset": after_reset, "allocated_now": now,
            "max_reserved": torch.cuda.max_memory_reserved()}


def check_empty_cache():
    x = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    del x
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    pool_before = pool_stats()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    pool_after = pool_stats()
    ok = after <= before - GiB
    if pool_before is not None and pool_after is not None:
        ok = ok and pool_after.bytes_reserved <= pool_before.bytes_reserved - GiB
    return {"pass": bool(ok), "reserved_before": before, "reserved_after": after,
            "pool_reserved_before": None if pool_before is None else pool_before.bytes_reserved,
            "pool_reserved_after": None if pool_after is None else pool_after.bytes_reserved}


def check_oom():
    _, total = torch.cuda.mem_get_info()
    caught = None
    try:
        too_big = torch.empty(total + 64 * GiB, dtype=torch.uint8, device="cuda")
        del too_big
        caught = "no error"
    except torch.OutOfMemoryError:
        caught = "torch.OutOfMemoryError"
    except Exception as e:  # noqa: BLE001: what else it raised is the finding
        caught = f"{type(e).__module__}.{type(e).__name__}: {str(e)[:200]}"
    # Afterwards the process must still allocate and compute.
    y = torch.ones(MiB, device="cuda")
    again = float(y.sum().item()) == float(MiB)
    return {"pass": caught == "torch.OutOfMemoryError" and again, "caught": caught,
            "allocates_after": again}


def check_cuda_graph():
    static_x = torch.zeros(4096, device="cuda")
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as PyTorch's docs do
        for _ in range(3):
            tmp = static_x * 2
            static_y = tmp + 1
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        tmp = static_x * 2  # a temporary allocated inside the capture
        static_y = tmp + 1
    results = []
    for k in (1.0, 2.5, -3.0):
        static_x.copy_(torch.full((4096,), k, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        results.append(bool(torch.all(static_y == k * 2 + 1).item()))
    return {"pass": all(results), "replays_correct": results}


CHECKS = [
    ("backend", check_backend),
    ("monitor", check_monitor),
    ("summary", check_summary),
    ("mem_get_info", check_mem_get_info),
    ("peaks", check_peaks),
    ("empty_cache", check_empty_cache),
    ("oom", check_oom),
    ("cuda_graph", check_cuda_graph),
]


def main():
    out = {"torch": torch.__version__, "checks": {}}
    if not torch.cuda.is_available():
        out.update({"pass": False, "error": "no CUDA device"})
        print(json.dumps(out), flush=True)
        return 1
    torch.cuda.init()
    for name, fn in CHECKS:
        try:
            out["checks"][name] = fn()
        except Exception as e:  # noqa: BLE001: a failing check must not stop the others
            out["checks"][name] = {"pass": False, "error": f"{type(e).__name__}: {e}"[:400],
                                   "where": traceback.format_exc().splitlines()[-3:]}
        torch.cuda.synchronize()
    out["pass"] = all(c.get("pass") for c in out["checks"].values())
    print(json.dumps(out), flush=True)
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
