#!/usr/bin/env python3
"""After which PyTorch operation memory appears in the driver's default memory pool (GPU machine).

Runs a few operations one by one (a tensor, matmuls, scaled-dot-product attention forward and
backward, a linear layer, AdamW, cross entropy, empty_cache) and after each prints the driver's
own default pool reserved and in-use bytes. Under the shim cudaMemPoolGetAttribute answers with
the pool's figures added (preload/src/hooks_mempool.cpp), so the pool's own reserved and allocated
bytes (gpustitch_get_stats) are taken off; natively there is nothing to take off.

    gpustitch run -- python3 tools/gpu/driver_pool_stages.py
    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python3 tools/gpu/driver_pool_stages.py
"""
import ctypes

import torch

rt = ctypes.CDLL("libcudart.so.13")
lib = ctypes.CDLL(None)
stats = getattr(lib, "gpustitch_get_stats", None) if hasattr(lib, "gpustitch_get_stats") else None
buf = (ctypes.c_uint64 * 16)()  # gpustitch_device_stats: [8] bytes_allocated, [9] bytes_reserved
MiB = 2**20


def report(what):
    torch.cuda.synchronize()
    pool = ctypes.c_void_p()
    rt.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), 0)
    reserved, used = ctypes.c_uint64(), ctypes.c_uint64()
    rt.cudaMemPoolGetAttribute(pool, 5, ctypes.byref(reserved))  # ReservedMemCurrent
    rt.cudaMemPoolGetAttribute(pool, 7, ctypes.byref(used))  # UsedMemCurrent
    ours = stats is not None and stats(0, buf, ctypes.sizeof(buf)) == 0
    pool_reserved, pool_allocated = (buf[9], buf[8]) if ours else (0, 0)
    print(f"{what:26s} driver's pool: reserved {(reserved.value - pool_reserved) / MiB:8.1f} MiB, "
          f"in use {(used.value - pool_allocated) / MiB:8.1f} MiB; gpustitch pool reserved "
          f"{pool_reserved / MiB:8.1f} MiB", flush=True)


report("after init")
x = torch.empty(1024, device="cuda")
report("first tensor")
a = torch.randn(4096, 4096, device="cuda")
report("randn 64 MiB")
b = a @ a
report("fp32 matmul")
with torch.autocast("cuda", dtype=torch.bfloat16):
    c = a @ a
report("bf16 matmul (autocast)")
q = torch.randn(2, 12, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
o = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
report("attention forward")
o.sum().backward()
report("attention backward")
lin = torch.nn.Linear(768, 32000).cuda()
lin(torch.randn(16, 768, device="cuda")).sum().backward()
report("linear forward/backward")
opt = torch.optim.AdamW(lin.parameters())
opt.step()
report("AdamW step")
logits = torch.randn(4096, 32000, device="cuda", requires_grad=True)
torch.nn.functional.cross_entropy(logits, torch.randint(0, 32000, (4096,), device="cuda")).backward()
report("cross entropy")
del x, a, b, c, q, o, lin, opt, logits
torch.cuda.empty_cache()
report("after empty_cache")
