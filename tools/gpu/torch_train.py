#!/usr/bin/env python3
"""Short decoder-only transformer training loop for the shim's compatibility matrix.

Real gradients, dynamic sequence lengths (drawn from 256..2048 each step, so allocation sizes keep
changing), fixed seed, deterministic kernels as far as PyTorch allows (fp32, no TF32, explicit
attention instead of fused SDPA, deterministic algorithms). Prints the loss per step and the lines
run-matrix.sh parses:
    PASS|FAIL: torch_train ...
    checksum: <sum of the per-step losses>
    wall_ms: <training time>

--pluggable routes PyTorch's allocations through libgpustitch's CUDAPluggableAllocator entry
points (gpustitch_malloc / gpustitch_free) from the library named by $GPUSTITCH_LIB, in process,
without LD_PRELOAD.
"""
import argparse
import math
import os
import random
import sys
import time

# Must be set before cuBLAS starts, for deterministic GEMMs.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpt_model import Gpt  # noqa: E402


def batch(rng, gen, vocab, b, t):
    """Sequences x[i+1] = (x[i] + step) % vocab with a per-sequence step: learnable."""
    start = torch.randint(0, vocab, (b, 1), generator=gen)
    step = torch.randint(1, 17, (b, 1), generator=gen)
    seq = (start + step * torch.arange(t + 1)) % vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pluggable", action="store_true",
                    help="use libgpustitch as CUDAPluggableAllocator ($GPUSTITCH_LIB)")
    args = ap.parse_args()

    if args.pluggable:
        lib = os.environ.get("GPUSTITCH_LIB")
        if not lib or not os.path.exists(lib):
            print(f"FAIL: torch_train: --pluggable needs GPUSTITCH_LIB (got {lib!r})")
            return 1
        alloc = torch.cuda.memory.CUDAPluggableAllocator(lib, "gpustitch_malloc", "gpustitch_free")
        torch.cuda.memory.change_current_allocator(alloc)
        print(f"allocator: CUDAPluggableAllocator({lib})")
    else:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        nocache = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "")
        print(f"allocator: PyTorch (PYTORCH_CUDA_ALLOC_CONF={conf!r}, "
              f"PYTORCH_NO_CUDA_MEMORY_CACHING={nocache!r})")

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = torch.device("cuda")
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    model = Gpt(args.vocab, args.d_model, args.heads, args.layers, args.max_len).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, foreach=False)
    losses = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(args.steps):
        t = rng.randint(args.min_len, args.max_len)
        x, y = batch(rng, gen, args.vocab, args.batch, t)
        x, y = x.to(dev), y.to(dev)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, args.vocab), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
        losses.append(value)
        print(f"step {step:3d} len {t:4d} loss {value:.6f}", flush=True)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1000

    try:
        peak = torch.cuda.max_memory_allocated() / 2**20
        reserved = torch.cuda.max_memory_reserved() / 2**20
        print(f"peak allocated {peak:.0f} MiB, peak reserved {reserved:.0f} MiB")
    except Exception as e:  # pluggable allocators keep no statistics
        print(f"memory statistics unavailable: {e}")

    # Byte accounting for the matrix (matrix_bytes.py) while this memory is live.
    import matrix_bytes
    matrix_bytes.report("torch")
    ok = all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    print(f"final_loss: {losses[-1]:.6f}")
    print(f"{'PASS' if ok else 'FAIL'}: torch_train ({args.steps} steps, loss "
          f"{losses[0]:.4f} -> {losses[-1]:.4f})")
    print(f"checksum: {sum(losses):.6f}")
    print(f"wall_ms: {wall_ms:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
