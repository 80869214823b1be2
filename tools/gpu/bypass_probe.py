#!/usr/bin/env python3
"""Which PyTorch steps leave memory in the driver's default memory pool, outside gpustitch (GPU).

Under `gpustitch run` (PyTorch's backend:cudaMallocAsync) every allocation PyTorch makes should be
the pool's. This runs a few typical steps (matmul, bf16, scaled-dot-product attention forward and
backward, cross entropy, autocast, AdamW) and after each prints one JSON line with the default
pool's reserved bytes as cudaMemPoolGetAttribute answers them (under the shim: the driver's own
figure plus the pool's) minus the pool's own reserved bytes, i.e. what sits in the driver's pool:

    gpustitch run -- python3 tools/gpu/bypass_probe.py

tools/gpu/nvml_gap_probe.py measures the same gap over a whole workload.
"""
import ctypes, json, os, torch
import torch.nn.functional as F
rt = ctypes.CDLL("libcudart.so.13")
lib = ctypes.CDLL("libgpustitch.so")
def pool_reserved():
    buf = (ctypes.c_uint64 * 16)()
    assert lib.gpustitch_get_stats(0, buf, ctypes.sizeof(buf)) == 0
    return buf[9]
def native():
    pool = ctypes.c_void_p(); rt.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), 0)
    out = {}
    for name, a in (("res", 5), ("used", 7)):
        v = ctypes.c_uint64(); rt.cudaMemPoolGetAttribute(pool, a, ctypes.byref(v)); out[name] = v.value
    return out
def report(tag):
    torch.cuda.synchronize()
    n = native(); pr = pool_reserved()
    print(json.dumps({"step": tag, "mempool_reserved_minus_pool_MiB": (n["res"] - pr) / 2**20, "pool_reserved_MiB": pr / 2**20}), flush=True)
d = "cuda"
x = torch.randn(4096, 4096, device=d); report("randn")
y = x @ x; report("matmul fp32")
xb = x.bfloat16(); yb = xb @ xb; report("matmul bf16")
q = torch.randn(4, 12, 2048, 64, device=d, dtype=torch.bfloat16, requires_grad=True)
o = F.scaled_dot_product_attention(q, q, q, is_causal=True); report("sdpa fwd")
o.sum().backward(); report("sdpa bwd")
logits = torch.randn(8192, 8192, device=d, requires_grad=True)
t = torch.randint(0, 8192, (8192,), device=d)
l = F.cross_entropy(logits, t); report("xent fwd"); l.backward(); report("xent bwd")
lin = torch.nn.Linear(768, 3072, device=d, dtype=torch.bfloat16)
with torch.autocast("cuda", dtype=torch.bfloat16):
    z = lin(torch.randn(8, 2048, 768, device=d)); report("autocast linear")
    z.float().pow(2).mean().backward(); report("autocast bwd")
opt = torch.optim.AdamW(lin.parameters()); opt.step(); report("adamw")
