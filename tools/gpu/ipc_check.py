#!/usr/bin/env python3
"""CUDA IPC on pool memory with PyTorch: torch.multiprocessing shares a CUDA tensor (GPU machine).

Run on a GPU machine with torch, under the shim, with PyTorch's cache kept (its caching allocator
shares its segments, which are pool blocks, through the shim's IPC), and natively as the control:

    BUILD/tools/gpustitch run --keep-framework-cache -- python3 tools/gpu/ipc_check.py
    python3 tools/gpu/ipc_check.py

Under plain `gpustitch run` (PyTorch's backend:cudaMallocAsync) PyTorch refuses to share CUDA
tensors itself, natively too; the check then fails naming that refusal:

    BUILD/tools/gpustitch run -- python3 tools/gpu/ipc_check.py

A producer process makes CUDA tensors (4 KiB, 1 MiB, 64 MiB: small-pool slots and large blocks
under the shim), fills them with a known pattern and sends them to a consumer started with the
"spawn" method (a fresh interpreter, preloaded through the inherited LD_PRELOAD), which opens them
(cudaIpcOpenMemHandle) and checks:

  bytes          the consumer reads the producer's pattern, bit for bit
  write back     the consumer writes a second pattern; the producer reads it
  producer frees the producer drops its tensors and calls torch.cuda.empty_cache() (under the shim,
                 the pool's blocks are freed), allocates and fills as much again, and the
                 consumer's view still holds the second pattern
  pool memory    under the shim the producer's tensors are pool memory (gpustitch_owns), so the
                 exchange went through the shim's IPC, not around it

Prints one JSON line {"pass": bool, "alloc_conf": ..., "checks": {...}, "error": ...}; exit
status 0 when every check passed. If PyTorch itself refuses to share memory of its allocator
backend (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync: "cudaMallocAsync does not yet support
shareIpcHandle"), "error" says so: that refusal is PyTorch's, before any CUDA call.
"""
import ctypes
import json
import os
import sys
import traceback

SIZES = [4096, 1 << 20, 64 << 20]


def pattern(n, seed):
    import torch

    return (torch.arange(n, dtype=torch.int64, device="cuda") * 7 + seed).to(torch.uint8)


def owns(ptr):
    """gpustitch_owns(ptr) when the shim is loaded in this process, else None."""
    try:
        lib = ctypes.CDLL(None)
        fn = lib.gpustitch_owns
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn(ctypes.c_void_p(ptr)) == 1


def consumer(q_in, q_out):
    import torch

    result = {}
    try:
        tensors = q_in.get(timeout=120)
        torch.cuda.synchronize()
        result["bytes"] = all(
            torch.equal(t, pattern(t.numel(), 11)) for t in tensors
        )
        for t in tensors:
            t.copy_(pattern(t.numel(), 23))
        torch.cuda.synchronize()
        q_out.put(("written", result))
        assert q_in.get(timeout=120) == "freed"
        result["after_producer_freed"] = all(
            torch.equal(t, pattern(t.numel(), 23)) for t in tensors
        )
        del tensors
        torch.cuda.synchronize()
        q_out.put(("done", result))
    except Exception:  # reported to the producer, which prints the verdict
        result["error"] = traceback.format_exc(limit=3)
        q_out.put(("done", result))


def main():
    import torch
    import torch.multiprocessing as mp

    out = {
        "pass": False,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "preloaded": "libgpustitch" in os.environ.get("LD_PRELOAD", ""),
        "checks": {},
        "error": None,
    }
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(q_in, q_out))
    proc.start()
    try:
        tensors = [pattern(n, 11) for n in SIZES]
        torch.cuda.synchronize()
        out["checks"]["producer_pool_memory"] = [owns(t.data_ptr()) for t in tensors]
        try:
            q_in.put(tensors)
        except RuntimeError as e:
            out["error"] = str(e).splitlines()[0]
            if "shareIpcHandle" in str(e):
                out["error"] += (
                    " (PyTorch refuses IPC for this allocator backend itself, natively too;"
                    " run under `gpustitch run --keep-framework-cache`)"
                )
            raise
        what, res = q_out.get(timeout=120)
        out["checks"].update(res)
        if what == "written":
            out["checks"]["write_back"] = all(
                torch.equal(t, pattern(t.numel(), 23)) for t in tensors
            )
            del tensors
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            # Allocate and overwrite as much again: freed memory the consumer still maps must
            # not be handed out here.
            again = [torch.full((n,), 0x5A, dtype=torch.uint8, device="cuda") for n in SIZES]
            torch.cuda.synchronize()
            q_in.put("freed")
            _, res = q_out.get(timeout=120)
            out["checks"].update(res)
            del again
        if out["checks"].get("error"):
            out["error"] = out["checks"].pop("error")
    except Exception:
        if out["error"] is None:
            out["error"] = traceback.format_exc(limit=3)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    c = out["checks"]
    pool_ok = True
    if out["preloaded"]:
        pool_ok = all(c.get("producer_pool_memory", [False]))
    c["pool_memory"] = pool_ok
    out["pass"] = (
        out["error"] is None
        and c.get("bytes") is True
        and c.get("write_back") is True
        and c.get("after_producer_freed") is True
        and pool_ok
    )
    print(json.dumps(out))
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
