#!/usr/bin/env python3
"""Where device memory outside the pool sits, while a workload runs (GPU machine, under the shim).

Runs a Python workload in this process (runpy, its arguments after --) and samples every 10 ms:
NVML's device-wide used memory, the pool's reserved bytes (gpustitch_get_stats) and the driver's
default memory pool's reserved and used bytes (cudaMemPoolGetAttribute on the runtime's own
default pool). Prints one JSON line at the end: each figure at NVML's peak and the largest gap
between NVML and the pool.

    gpustitch run -- python3 tools/gpu/nvml_gap_probe.py -- tools/gpu/hf_workloads.py train
"""
import ctypes
import json
import runpy
import sys
import threading
import time

import pynvml

argv = sys.argv[sys.argv.index("--") + 1:]
rt = ctypes.CDLL("libcudart.so.13")
lib = ctypes.CDLL(None)
buf = (ctypes.c_uint64 * 16)()
pynvml.nvmlInit()
dev = pynvml.nvmlDeviceGetHandleByIndex(0)
samples = []
stop = False


def mempool():
    pool = ctypes.c_void_p()
    if rt.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), 0) != 0:
        return None, None
    out = []
    for attr in (5, 7):  # cudaMemPoolAttrReservedMemCurrent, cudaMemPoolAttrUsedMemCurrent
        v = ctypes.c_uint64()
        rt.cudaMemPoolGetAttribute(pool, attr, ctypes.byref(v))
        out.append(v.value)
    return out


def sampler():
    rt.cudaSetDevice(0)
    while not stop:
        used = pynvml.nvmlDeviceGetMemoryInfo(dev).used
        pool = buf[9] if lib.gpustitch_get_stats(0, buf, ctypes.sizeof(buf)) == 0 else 0
        res, inuse = mempool()
        samples.append((used, pool, res or 0, inuse or 0))
        time.sleep(0.01)


idle = pynvml.nvmlDeviceGetMemoryInfo(dev).used
t = threading.Thread(target=sampler, daemon=True)
t.start()
sys.argv = argv
try:
    runpy.run_path(argv[0], run_name="__main__")
finally:
    stop = True
    t.join()
    MiB = 2**20
    peak = max(samples)
    gap = max(samples, key=lambda s: s[0] - s[1])
    print(json.dumps({
        "samples": len(samples), "idle_MiB": idle // MiB,
        "at_nvml_peak": {"nvml_MiB": peak[0] // MiB, "pool_reserved_MiB": peak[1] // MiB,
                         "mempool_reserved_MiB": peak[2] // MiB, "mempool_used_MiB": peak[3] // MiB},
        "largest_gap_nvml_minus_pool_MiB": (gap[0] - gap[1]) // MiB,
        "at_gap": {"nvml_MiB": gap[0] // MiB, "pool_reserved_MiB": gap[1] // MiB,
                   "mempool_reserved_MiB": gap[2] // MiB},
        "mempool_reserved_max_MiB": max(s[2] for s in samples) // MiB,
    }), flush=True)
