#!/usr/bin/env python3
"""HuggingFace transformers workloads for the pool's memory figures, on a GPU machine.

A Llama-style model built from a config (no weights are downloaded: 8 layers, d_model 768,
12 heads with 4 key/value heads (GQA), vocab 32000), in one of two modes:

  train     AdamW training, bf16 autocast, batch --batch, sequence length drawn per step from
            --min-len..--max-len (the seeds' dynamic-length case);
  generate  serving: --requests calls of model.generate() with a random batch (1..--max-batch),
            prompt length (16..512) and number of new tokens (16..--max-new), so the KV cache
            grows and shrinks from request to request.

It prints one JSON line: tokens/s (timed after --warmup steps or requests), peak allocated and
peak reserved, each from the allocator in use: gpustitch_get_stats() when the gpustitch shim is
loaded (PyTorch's cache is then off and keeps no figures), else torch.cuda's own statistics.

    python3 tools/gpu/hf_workloads.py train --steps 12
    gpustitch run -- python3 tools/gpu/hf_workloads.py generate --requests 16
    GPUSTITCH_CONF=trace:hf_train.csv gpustitch run -- python3 tools/gpu/hf_workloads.py train

The traces in tests/data/traces/hf_*.csv were recorded the last way (README there).
"""
import argparse
import ctypes
import json
import os
import random
import sys
import time


# The record's layout: the repository's Python package (python/gpustitch), which needs no torch.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from gpustitch import DRIVER_OPS, DeviceStats as ShimStats  # noqa: E402


def shim():
    try:
        lib = ctypes.CDLL(None)
        lib.gpustitch_active.restype = ctypes.c_int
        lib.gpustitch_get_stats.restype = ctypes.c_int
        lib.gpustitch_get_stats.argtypes = [ctypes.c_int, ctypes.POINTER(ShimStats),
                                            ctypes.c_size_t]
        return lib if lib.gpustitch_active() else None
    except (AttributeError, OSError):
        return None


def build_model(torch, args):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=args.layers,
                      num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
                      max_position_embeddings=max(8192, args.max_len),
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).to("cuda")


def pool_stats():
    """The pool's statistics now (ShimStats), or None without the shim."""
    lib = shim()
    if lib is None:
        return None
    s = ShimStats()
    lib.gpustitch_get_stats(0, ctypes.byref(s), ctypes.sizeof(s))
    return s


def train(torch, model, args, rng):
    """Returns (tokens, seconds, the pool's statistics when timing started or None)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = 0
    start = at_start = None
    for step in range(args.steps):
        if step == args.warmup:
            torch.cuda.synchronize()
            start, tokens = time.perf_counter(), 0
            at_start = pool_stats()
        n = rng.randint(args.min_len, args.max_len)
        ids = torch.randint(3, 32000, (args.batch, n), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += args.batch * n
    torch.cuda.synchronize()
    return tokens, time.perf_counter() - start, at_start


def generate(torch, model, args, rng):
    """Returns (tokens, seconds, the pool's statistics when timing started or None)."""
    model.eval()
    tokens = 0
    start = at_start = None
    with torch.no_grad():
        for r in range(args.requests):
            if r == args.warmup:
                torch.cuda.synchronize()
                start, tokens = time.perf_counter(), 0
                at_start = pool_stats()
            batch = rng.randint(1, args.max_batch)
            prompt, new = rng.randint(16, 512), rng.randint(16, args.max_new)
            ids = torch.randint(3, 32000, (batch, prompt), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=new, min_new_tokens=new, do_sample=False)
            tokens += batch * (out.shape[1] - prompt)
    torch.cuda.synchronize()
    return tokens, time.perf_counter() - start, at_start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["train", "generate"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8, help="generate: largest batch")
    ap.add_argument("--max-new", type=int, default=256, help="generate: most new tokens")
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    model = build_model(torch, args)
    run = train if args.mode == "train" else generate
    tokens, seconds, at_start = run(torch, model, args, rng)
    result = {"mode": args.mode, "tokens_per_s": round(tokens / seconds, 1),
              "timed_s": round(seconds, 3),
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
              "no_caching": os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "")}
    s = pool_stats()
    if s is not None:
        result.update(source="gpustitch", peak_allocated=s.peak_allocated,
                      peak_reserved=s.peak_reserved, fresh=s.fresh, stitches=s.stitches,
                      peak_reserved_pending=s.peak_reserved_pending,
                      peak_reserved_allocated=s.peak_reserved_allocated)
        if at_start is not None:
            # The pool's own time in the driver inside the timed steps.
            # Of it, the reclaimer thread's (unmap:background), off the thread that launches.
            result.update(pool_driver_calls_timed=s.driver_calls - at_start.driver_calls,
                          pool_driver_ms_timed=round((s.driver_ns - at_start.driver_ns) / 1e6, 3),
                          pool_driver_bg_ms_timed=round(
                              (s.driver_background_ns - at_start.driver_background_ns) / 1e6, 3),
                          # The allocating threads' share by kind: [calls, ms].
                          pool_driver_ops_timed={
                              op: [s.driver_op_calls[i] - at_start.driver_op_calls[i],
                                   round((s.driver_op_ns[i] - at_start.driver_op_ns[i]) / 1e6, 3)]
                              for i, op in enumerate(DRIVER_OPS)},
                          # Time the program's threads waited for the device inside the pool:
                          # fences on their own thread, and waits for the reclaimer's fence
                          # ([count, ms] each, as train_seqlen.py prints them).
                          pool_fence_syncs_timed=[
                              s.fence_syncs - at_start.fence_syncs,
                              round((s.fence_sync_ns - at_start.fence_sync_ns) / 1e6, 3)],
                          pool_fence_waits_timed=[
                              s.fence_waits - at_start.fence_waits,
                              round((s.fence_wait_ns - at_start.fence_wait_ns) / 1e6, 3)],
                          pool_fence_waits_timed_out=(s.fence_waits_timed_out -
                                                      at_start.fence_waits_timed_out))
        # The same instant seen by both (the model and the optimizer's state are live): what the
        # pool serves beyond PyTorch's own count is allocations PyTorch does not make (libraries
        # calling the CUDA allocator directly) plus the pool's rounding (allocated - requested).
        result.update(torch_peak_allocated=torch.cuda.max_memory_allocated(),
                      torch_allocated_now=torch.cuda.memory_allocated(),
                      pool_requested_now=s.bytes_requested, pool_allocated_now=s.bytes_allocated)
    else:
        result.update(source="torch", peak_allocated=torch.cuda.max_memory_allocated(),
                      peak_reserved=torch.cuda.max_memory_reserved())
    result["ratio"] = round(result["peak_reserved"] / max(result["peak_allocated"], 1), 4)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
