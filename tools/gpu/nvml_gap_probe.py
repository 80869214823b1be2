#!/usr/bin/env python3
"""Where device memory outside the pool sits, while a workload runs (GPU machine, under the shim).

Runs a Python workload in this process (runpy, its arguments after --) and samples every 10 ms:
NVML's device-wide used memory, the pool's reserved bytes (gpustitch_get_stats) and the driver's
default memory pool's reserved and used bytes (cudaMemPoolGetAttribute on the runtime's own
default pool; under the shim that answer includes the pool's own figures, so the driver's part is
that answer minus the pool's reserved and allocated bytes, sampled together). Prints one JSON line
at the end: each figure at NVML's peak, the largest gap between NVML and the pool, and the most the
driver's own default pool held (reserved, and in use by allocations that bypassed the pool).

    gpustitch run -- python3 tools/gpu/nvml_gap_probe.py [--attention A] [--threshold-zero] \
        -- tools/gpu/hf_workloads.py train

--attention: which of PyTorch's scaled-dot-product attention backends may run (default: all;
nocudnn, noflash: neither flash nor cuDNN, math: the math one only), to see which library puts
memory in the driver's pool. --threshold-zero: after PyTorch set its allocator up, set the default
pool's release threshold back to 0 (what the shim's driver_pool_release:on does itself).
"""
import ctypes
import json
import runpy
import sys
import threading
import time

import pynvml

own = sys.argv[1:sys.argv.index("--")]
argv = sys.argv[sys.argv.index("--") + 1:]
attention = own[own.index("--attention") + 1] if "--attention" in own else "default"
threshold_zero = "--threshold-zero" in own
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
        ok = lib.gpustitch_get_stats(0, buf, ctypes.sizeof(buf)) == 0
        pool, pool_alloc = (buf[9], buf[8]) if ok else (0, 0)
        res, inuse = mempool()
        samples.append((used, pool, res or 0, inuse or 0, pool_alloc))
        time.sleep(0.01)


idle = pynvml.nvmlDeviceGetMemoryInfo(dev).used
if attention != "default" or threshold_zero:
    import torch
    sdp = torch.backends.cuda
    if attention in ("nocudnn", "noflash", "math"):
        sdp.enable_cudnn_sdp(False)
    if attention in ("noflash", "math"):
        sdp.enable_flash_sdp(False)
    if attention == "math":
        sdp.enable_mem_efficient_sdp(False)
    if threshold_zero:
        torch.empty(1, device="cuda")  # PyTorch's allocator sets the default pool up on first use
        pool, zero = ctypes.c_void_p(), ctypes.c_uint64(0)
        rt.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), 0)
        rt.cudaMemPoolSetAttribute(pool, 4, ctypes.byref(zero))  # cudaMemPoolAttrReleaseThreshold
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
        "driver_pool_reserved_max_MiB": max(s[2] - s[1] for s in samples) // MiB,
        "driver_pool_used_max_MiB": max(s[3] - s[4] for s in samples) // MiB,
        "driver_pool_first_nonzero_sample": next(
            (i for i, s in enumerate(samples) if s[2] > s[1]), None),
    }), flush=True)
