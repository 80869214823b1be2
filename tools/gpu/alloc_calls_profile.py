#!/usr/bin/env python3
"""Which CUDA allocation calls reach the driver past the pool, and under which operator (GPU).

Under the shim every allocation the pool serves is answered inside the hook: the real runtime's
cudaMallocAsync and the driver's cuMemAllocAsync never run for it. CUPTI (torch.profiler's CUDA
activity) records the runtime and driver API calls of every copy of the runtime in the process,
the static ones inside cuBLAS and cuDNN included. So an allocation call CUPTI records under the
shim is one that bypassed the pool, and the PyTorch operator it ran under tells what made it.

Profiles --steps HF Llama training steps (tools/gpu/hf_workloads.py's model; the longest sequence
first) after --warmup unprofiled ones, and prints one JSON line: per allocation-related API name,
the calls and the operators (innermost and outermost) they ran under, and the driver's default
pool's reserved bytes after the steps (the shim's answer minus the pool's own reserved bytes).

    gpustitch run --conf driver_pool_release:off -- python3 tools/gpu/alloc_calls_profile.py
    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python3 tools/gpu/alloc_calls_profile.py
"""
import argparse
import collections
import ctypes
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ALLOC_API = re.compile(r"(?i)(malloc|memalloc|mempool|memcreate|memfree|^cudaFree|^cuMemFree"
                       r"|memmap|memrelease|memaddressreserve)")


def driver_pool(rt, lib):
    """The driver's default pool's (reserved, used) MiB: the shim's answers less the pool's own."""
    pool, res, used = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_uint64()
    if rt.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), 0) != 0:
        return None
    rt.cudaMemPoolGetAttribute(pool, 5, ctypes.byref(res))  # cudaMemPoolAttrReservedMemCurrent
    rt.cudaMemPoolGetAttribute(pool, 7, ctypes.byref(used))  # cudaMemPoolAttrUsedMemCurrent
    ours_res = ours_alloc = 0
    if hasattr(lib, "gpustitch_get_stats"):
        buf = (ctypes.c_uint64 * 16)()  # [8] bytes_allocated, [9] bytes_reserved
        if lib.gpustitch_get_stats(0, buf, ctypes.sizeof(buf)) == 0:
            ours_alloc, ours_res = buf[8], buf[9]
    return [(res.value - ours_res) >> 20, (used.value - ours_alloc) >> 20]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2, help="unprofiled steps first (0: profile all)")
    ap.add_argument("--len", type=int, default=8192, help="sequence length of the profiled steps")
    ap.add_argument("--attention", default="default", choices=["default", "nocudnn", "math"])
    ap.add_argument("--threshold-max", action="store_true",
                    help="set the default pool's release threshold to the maximum first, as "
                         "PyTorch's cudaMallocAsync backend does, so that what reaches it stays")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    if args.attention in ("nocudnn", "math"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.attention == "math":
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    rt, lib = ctypes.CDLL("libcudart.so.13"), ctypes.CDLL(None)
    if args.threshold_max:
        torch.empty(1, device="cuda")
        pool, v = ctypes.c_void_p(), ctypes.c_uint64(2**64 - 1)
        rt.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), 0)
        rt.cudaMemPoolSetAttribute(pool, 4, ctypes.byref(v))  # cudaMemPoolAttrReleaseThreshold
    from hf_workloads import build_model
    ns = argparse.Namespace(layers=8, max_len=args.len)
    model = build_model(torch, ns)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    phases = []  # (step, phase, driver pool [reserved, used] MiB) after each phase, synchronised

    def mark(i, what):
        torch.cuda.synchronize()
        phases.append((i, what, driver_pool(rt, lib)))

    def step(i, n):
        ids = torch.randint(3, 32000, (2, n), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        mark(i, "forward")
        loss.backward()
        mark(i, "backward")
        opt.step()
        mark(i, "optimizer")
        opt.zero_grad(set_to_none=True)

    mark(-1, "model built")
    for i in range(args.warmup):
        step(i, args.len // (i + 1))
    before = driver_pool(rt, lib)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps):
            step(args.warmup + i, args.len if i == 0 else max(256, args.len // (2 * i)))
        torch.cuda.synchronize()
    after = driver_pool(rt, lib)

    calls = collections.Counter()
    where = collections.defaultdict(collections.Counter)
    names = collections.Counter()
    for ev in prof.events():
        names[ev.name] += 1
        if not ALLOC_API.search(ev.name) or ev.name.startswith("aten::"):
            continue
        calls[ev.name] += 1
        inner, outer, p = None, None, ev.cpu_parent
        while p is not None:
            if inner is None and p.name.startswith("aten::"):
                inner = p.name
            outer = p.name
            p = p.cpu_parent
        where[ev.name][f"{inner} < {outer}"] += 1
    print(json.dumps({
        "shim": hasattr(lib, "gpustitch_get_stats"),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "attention": args.attention,
        "driver_pool_reserved_used_MiB": {"before_profiling": before, "after": after},
        "phases": [f"{i}:{w}:{d}" for i, w, d in phases],
        "alloc_calls": dict(calls),
        "where": {k: dict(v.most_common(12)) for k, v in where.items()},
        "api_names": {k: v for k, v in names.most_common() if k.startswith(("cu", "cuda"))},
    }), flush=True)


if __name__ == "__main__":
    main()
