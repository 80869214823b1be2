#!/usr/bin/env python3
"""End-to-end benchmark: GPT training with a sequence length drawn from 256..8192 every step.

The scenario of the seed articles (issue 7, item 3): a decoder-only transformer (default 12 layers,
d_model 768, bf16 autocast, AdamW) trains under a fixed memory budget while the sequence length
jumps every step, so the allocation sizes keep changing and a caching allocator fragments.

Memory budget. Before anything else the script allocates one "balloon" tensor that leaves only
--budget-gb of the device's free memory for training. The balloon is allocated with the allocator
under test (PyTorch's, the shim's pool, the pluggable allocator), so every configuration sees the
same physical budget, and it is counted in that allocator's statistics: the figures reported are
peak minus balloon. The balloon is a multiple of 20 MiB so that no allocator rounds it
(expandable_segments maps 20 MiB pages; the others round to 2 MiB).

Sequence lengths come from random.Random(--seed): every configuration and every batch size sees
the same lengths in the same order.

Modes:
    --batch B           one run of --steps steps at batch B (the timed run: tokens/s after
                        --warmup steps, peak memory)
    --ladder 2,3,4,...  ascending batches in one process, --steps each, stopping at the first
                        failure; between rungs everything but the model and optimizer is freed
                        and torch.cuda.empty_cache() is called. Prints one "rung {json}" line
                        per rung as it finishes, so a killed ladder still says how far it got.

The last line printed is one JSON object (see result fields in main()). OOM
(torch.OutOfMemoryError; a CUDA error saying "out of memory", which is how PyTorch reports a
failed cudaMalloc under PYTORCH_NO_CUDA_MEMORY_CACHING=1; or any error after which the pool
counted an out-of-memory, as when the pluggable allocator returns NULL) ends the run with
"oom": true and exit status 0; any other error gives "error" and exit status 1.

Where the memory figures come from:
  - PyTorch's allocators (default, expandable_segments, max_split_size_mb, cudaMallocAsync):
    torch.cuda.max_memory_allocated / max_memory_reserved (for backend:cudaMallocAsync PyTorch
    reads them from the CUDA memory pool's used/reserved high-water marks).
  - libgpustitch loaded (LD_PRELOAD via `gpustitch run`, or --pluggable): peak reserved is the
    pool's peak_reserved (physical memory held from the driver) from gpustitch_get_stats; peak
    allocated is PyTorch's max_memory_allocated when PyTorch keeps statistics (under
    --keep-framework-cache its tensors live in segments the pool serves), else the pool's
    peak_allocated (PYTORCH_NO_CUDA_MEMORY_CACHING=1 and --pluggable, where every tensor is one
    pool allocation).

--pluggable routes PyTorch's allocations through gpustitch_malloc / gpustitch_free of the library
named by $GPUSTITCH_LIB (torch.cuda.memory.CUDAPluggableAllocator), in process, no LD_PRELOAD.
"""
import argparse
import ctypes
import gc
import json
import math
import os
import random
import sys
import time

MIB = 1 << 20
GIB = 1 << 30


# The record's layout: the repository's Python package (python/gpustitch), which needs no torch.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "python"))
from gpustitch import DRIVER_OPS, DeviceStats as ShimStats  # noqa: E402

# The pool's wait counters (gpustitch_device_stats), in the order the timed figures use them.
FENCE_FIGURES = ("fence_syncs", "fence_sync_ns", "fence_waits", "fence_wait_ns",
                 "fence_waits_timed_out")


class TimeUp(Exception):
    """--time-limit reached before a run's steps were done."""

    def __init__(self, steps_done):
        super().__init__(f"time limit reached after {steps_done} steps")
        self.steps_done = steps_done


class Shim:
    """libgpustitch's C API if the library is in this process (preloaded or pluggable), else off."""

    def __init__(self, pluggable_lib):
        self.lib = None
        try:
            lib = ctypes.CDLL(pluggable_lib) if pluggable_lib else ctypes.CDLL(None)
            lib.gpustitch_get_stats.restype = ctypes.c_int
            lib.gpustitch_get_stats.argtypes = [ctypes.c_int, ctypes.POINTER(ShimStats),
                                                ctypes.c_size_t]
            lib.gpustitch_active.restype = ctypes.c_int
            self.lib = lib
        except (OSError, AttributeError):
            self.lib = None

    def loaded(self):
        return self.lib is not None

    def active(self):
        return bool(self.lib and self.lib.gpustitch_active())

    def stats(self, device=0):
        if not self.lib:
            return None
        s = ShimStats()
        if self.lib.gpustitch_get_stats(device, ctypes.byref(s), ctypes.sizeof(s)) != 0:
            return None
        # Arrays (the per-kind driver counters) as lists, so that the result stays JSON.
        return {name: (list(v) if isinstance(v, ctypes.Array) else v)
                for name, v in ((n, getattr(s, n)) for n, _ in ShimStats._fields_)}


def mempool_peaks(device=0):
    """The default CUDA memory pool's (reserved high, used high) in bytes, read through the CUDA
    runtime PyTorch already loaded; None if unavailable. Used for backend:cudaMallocAsync when
    PyTorch's own statistics are empty."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            rt = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return None
    pool = ctypes.c_void_p()
    if rt.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), device) != 0:
        return None
    vals = []
    for attr in (6, 8):  # cudaMemPoolAttrReservedMemHigh, cudaMemPoolAttrUsedMemHigh
        v = ctypes.c_uint64()
        if rt.cudaMemPoolGetAttribute(pool, attr, ctypes.byref(v)) != 0:
            return None
        vals.append(v.value)
    return tuple(vals)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="unnamed", help="configuration name for the result")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--batch", type=int, help="one run at this batch size")
    mode.add_argument("--ladder", help="comma-separated ascending batch sizes, one process")
    ap.add_argument("--steps", type=int, default=12, help="steps per run (per rung)")
    ap.add_argument("--warmup", type=int, default=3, help="steps not timed (timed run)")
    ap.add_argument("--budget-gb", type=float, default=24.0,
                    help="device memory left for training (GiB); 0: no balloon")
    ap.add_argument("--pluggable", action="store_true",
                    help="use libgpustitch as CUDAPluggableAllocator ($GPUSTITCH_LIB)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=0,
                    help="seconds from the start after which no step is started (a run cut short "
                         "reports time_limited; a ladder does not start a rung expected to end "
                         "after it); 0: no limit")
    return ap.parse_args()


RESULT = {}  # the result object; printed by finish(), or by the last-resort handler below


def main():
    args = parse_args()
    t_start = time.perf_counter()
    result = RESULT
    result.update({"config": args.config, "mode": "ladder" if args.ladder else "batch",
              "steps_requested": args.steps, "budget_bytes": int(args.budget_gb * GIB),
              "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads,
                        "vocab": args.vocab, "min_len": args.min_len, "max_len": args.max_len},
              "env": {k: os.environ.get(k, "") for k in (
                  "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING", "GPUSTITCH_CONF")},
              "oom": False, "error": None})
    result["env"]["LD_PRELOAD"] = os.path.basename(os.environ.get("LD_PRELOAD", ""))

    def finish(code):
        result["wall_s"] = round(time.perf_counter() - t_start, 2)
        print(json.dumps(result), flush=True)
        return code

    try:
        import torch
        import torch.nn.functional as F
        # The model, shared with the compatibility matrix (tools/gpu/gpt_model.py).
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "..", "..", "..", "tools", "gpu"))
        from gpt_model import Gpt
    except ImportError as e:
        result["error"] = f"import torch: {e}"
        return finish(1)

    # --- allocator under test: must be chosen before CUDA allocates anything ---
    lib = None
    if args.pluggable:
        lib = os.environ.get("GPUSTITCH_LIB")
        if not lib or not os.path.exists(lib):
            result["error"] = f"--pluggable needs GPUSTITCH_LIB (got {lib!r})"
            return finish(1)
        alloc = torch.cuda.memory.CUDAPluggableAllocator(lib, "gpustitch_malloc", "gpustitch_free")
        torch.cuda.memory.change_current_allocator(alloc)
    result["allocator"] = ("pluggable" if args.pluggable else
                           os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "pytorch-default")
    shim = Shim(lib)
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    result["gpu"] = torch.cuda.get_device_name(0)
    result["torch"] = torch.__version__

    # --- balloon: everything but the budget, with the allocator under test ---
    free, total = torch.cuda.mem_get_info(0)
    budget = int(args.budget_gb * GIB)
    grain = 20 * MIB  # expandable_segments maps 20 MiB pages; everyone else rounds to 2 MiB
    balloon_bytes = max(0, (free - budget) // grain * grain) if budget > 0 else 0
    result.update(device_total_bytes=total, device_free_at_start_bytes=free,
                  balloon_bytes=balloon_bytes)
    try:
        balloon = torch.empty(balloon_bytes, dtype=torch.uint8, device=dev) if balloon_bytes else None
    except torch.OutOfMemoryError as e:
        result["error"] = f"balloon of {balloon_bytes / GIB:.2f} GiB failed: {e}"
        return finish(1)
    result["shim_loaded"] = shim.loaded()
    result["shim_active"] = shim.active()

    # --- model ---
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        model = Gpt(args.vocab, args.d_model, args.heads, args.layers, args.max_len,
                    attention="sdpa").to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    except torch.OutOfMemoryError as e:
        result["oom"] = True
        result["error"] = f"model did not fit: {str(e).splitlines()[0]}"
        return finish(0)
    result["params"] = sum(p.numel() for p in model.parameters())

    def lengths():
        rng = random.Random(args.seed)
        return [rng.randint(args.min_len, args.max_len) for _ in range(args.steps)]

    def run(batch, timed, partial_ok):
        """args.steps steps at this batch. Returns a dict; raises on OOM/error, and TimeUp when
        the time limit comes first (unless partial_ok and some timed steps are done)."""
        gen = torch.Generator(device=dev).manual_seed(args.seed)
        lens = lengths()
        warm = min(args.warmup, max(0, args.steps - 1)) if timed else 0
        done, tokens, losses, time_limited = 0, 0, [], False
        t_measure = None
        drv_measure = None  # the pool's driver (calls, ns) when timing starts
        t0 = time.perf_counter()
        for i, t in enumerate(lens):
            if args.time_limit and time.perf_counter() - t_start > args.time_limit:
                if not partial_ok or done <= warm:
                    raise TimeUp(done)
                time_limited = True
                break
            if i == warm:
                torch.cuda.synchronize()
                t_measure = time.perf_counter()
                st = shim.stats()
                drv_measure = ((st["driver_calls"], st["driver_ns"], st["driver_background_ns"],
                                list(st["driver_op_calls"]), list(st["driver_op_ns"]),
                                [st.get(k, 0) for k in FENCE_FIGURES])
                               if st else None)
            seq = torch.randint(0, args.vocab, (batch, t + 1), device=dev, generator=gen)
            x, y = seq[:, :-1], seq[:, 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            del seq, x, y, logits, loss
            done += 1
            if i >= warm:
                tokens += batch * t
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        out = {"batch": batch, "steps": done, "wall_s": round(t1 - t0, 3),
               "time_limited": time_limited,
               "max_len_seen": max(lens[:done]), "loss_first": losses[0], "loss_last": losses[-1],
               "finite": all(math.isfinite(v) for v in losses)}
        if t_measure is not None and t1 > t_measure:
            out["timed_steps"] = done - warm
            out["tokens_per_s"] = round(tokens / (t1 - t_measure), 1)
            out["steps_per_s"] = round((done - warm) / (t1 - t_measure), 4)
            st = shim.stats()
            if drv_measure and st:
                # The pool's own time in the driver inside the timed steps: the share of the
                # step time that physical memory cost (cache hits pay none).
                out["pool_driver_calls_timed"] = st["driver_calls"] - drv_measure[0]
                out["pool_driver_ms_timed"] = round((st["driver_ns"] - drv_measure[1]) / 1e6, 3)
                # Of it, the reclaimer thread's (unmap:background), off the launching thread.
                out["pool_driver_bg_ms_timed"] = round(
                    (st["driver_background_ns"] - drv_measure[2]) / 1e6, 3)
                # The launching thread's share by kind: [calls, ms].
                out["pool_driver_ops_timed"] = {
                    op: [st["driver_op_calls"][i] - drv_measure[3][i],
                         round((st["driver_op_ns"][i] - drv_measure[4][i]) / 1e6, 3)]
                    for i, op in enumerate(DRIVER_OPS)}
                # Time the program's threads waited for the device inside the pool: fences on
                # their own thread, and waits for the reclaimer's fence ([count, ms] each).
                f = [st.get(k, 0) - v for k, v in zip(FENCE_FIGURES, drv_measure[5])]
                out["pool_fence_syncs_timed"] = [f[0], round(f[1] / 1e6, 3)]
                out["pool_fence_waits_timed"] = [f[2], round(f[3] / 1e6, 3)]
                out["pool_fence_waits_timed_out"] = f[4]
        return out

    def classify(e, ooms_before):
        """'oom' or 'error' for an exception raised by a step."""
        if isinstance(e, torch.OutOfMemoryError):
            return "oom"
        st = shim.stats()
        if st is not None and ooms_before is not None and st["ooms"] > ooms_before:
            return "oom"  # e.g. the pluggable allocator returned NULL
        # PYTORCH_NO_CUDA_MEMORY_CACHING=1 reports a failed cudaMalloc as a plain CUDA error.
        if "out of memory" in str(e).lower():
            return "oom"
        return "error"

    def shim_ooms():
        st = shim.stats()
        return st["ooms"] if st else None

    def release():
        opt.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    code = 0
    if args.ladder:
        batches = [int(b) for b in args.ladder.split(",") if b.strip()]
        rungs, max_ok, stopped, last = [], 0, "done", None
        for b in batches:
            elapsed = time.perf_counter() - t_start
            if args.time_limit and last is not None:
                # From the last rung's steady-state speed (its first steps include one-off
                # start-up costs that would overestimate).
                if last.get("tokens_per_s"):
                    expected = b * sum(lengths()) / last["tokens_per_s"]
                else:
                    expected = last["wall_s"] * b / last["batch"]
                if elapsed + expected > args.time_limit:
                    stopped = "time"
                    break
            before = shim_ooms()
            try:
                r = run(b, timed=True, partial_ok=False)
                r["ok"] = r["finite"]
            except TimeUp as e:
                print(f"ladder: batch {b} not finished: {e}", flush=True)
                stopped = "time"
                break
            except Exception as e:  # noqa: BLE001 -- classified below
                kind = classify(e, before)
                r = {"batch": b, "ok": False, kind: str(e).splitlines()[0][:300] if str(e) else
                     type(e).__name__}
                stopped = kind
            print("rung " + json.dumps(r), flush=True)
            rungs.append(r)
            if not r["ok"]:
                if stopped == "done":
                    stopped = "nonfinite"
                break
            max_ok, last = b, r
            try:
                release()
            except Exception as e:  # noqa: BLE001
                stopped = classify(e, None)
                break
        result.update(ladder=rungs, max_ok_batch=max_ok, stopped=stopped,
                      oom=stopped == "oom", batch=max_ok)
        result["steps_completed"] = last["steps"] if last else 0  # of the largest batch passed
        if stopped == "error":
            result["error"] = rungs[-1].get("error") if rungs else "error"
            code = 1
    else:
        before = shim_ooms()
        result["batch"] = args.batch
        try:
            r = run(args.batch, timed=True, partial_ok=True)
            result.update(r)
            result["steps_completed"] = r["steps"]
        except TimeUp as e:
            result["steps_completed"] = e.steps_done
            result["time_limited"] = True
            result["error"] = str(e)
            code = 1
        except Exception as e:  # noqa: BLE001
            kind = classify(e, before)
            result["steps_completed"] = None
            if kind == "oom":
                result["oom"] = True
                result["error"] = None
                result["oom_message"] = str(e).splitlines()[0][:300] if str(e) else ""
            else:
                result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                code = 1

    # --- memory figures (peak minus balloon) ---
    torch_alloc = torch_res = None
    try:
        torch_alloc = torch.cuda.max_memory_allocated(0)
        torch_res = torch.cuda.max_memory_reserved(0)
    except Exception:  # noqa: BLE001 -- pluggable allocators keep no statistics
        pass
    if "cudaMallocAsync" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        try:
            peaks = mempool_peaks(0)
        except Exception:  # noqa: BLE001
            peaks = None
        if peaks:
            result["mempool_peak_reserved_bytes"], result["mempool_peak_used_bytes"] = peaks
            if not torch_res:
                torch_res, torch_alloc = peaks
                result["torch_stats_from"] = "cudaMemPool high-water marks"
    st = shim.stats()
    result["torch_peak_allocated_bytes"] = torch_alloc
    result["torch_peak_reserved_bytes"] = torch_res
    if st:
        result["shim_stats"] = st
    if st and result.get("mempool_peak_reserved_bytes") is not None:
        # Under the shim the default pool's high-water mark is the driver's own plus the pool's
        # (preload/src/hooks_mempool.cpp): what is left is memory that reached the driver's pool
        # past the hooks, on top of the pool's figure below (an upper bound: two marks added).
        result["driver_pool_peak_reserved_bytes"] = max(
            0, result["mempool_peak_reserved_bytes"] - st["peak_reserved"])
    if st:
        reserved, res_src = st["peak_reserved"], "gpustitch_get_stats.peak_reserved"
        if torch_alloc:
            allocated, alloc_src = torch_alloc, "torch.cuda.max_memory_allocated"
        else:
            allocated, alloc_src = st["peak_allocated"], "gpustitch_get_stats.peak_allocated"
    elif torch_res:
        reserved, res_src = torch_res, "torch.cuda.max_memory_reserved"
        allocated, alloc_src = torch_alloc, "torch.cuda.max_memory_allocated"
    else:
        reserved = allocated = None
        res_src = alloc_src = "unavailable"
    if reserved is not None:
        reserved = max(0, reserved - balloon_bytes)
    if allocated is not None:
        allocated = max(0, allocated - balloon_bytes)
    result.update(peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
                  peak_allocated_source=alloc_src, peak_reserved_source=res_src)
    result["fragmentation"] = (round(1 - allocated / reserved, 4)
                               if allocated is not None and reserved else None)
    del balloon
    return finish(code)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # noqa: BLE001 -- whatever happened, end with one JSON line
        RESULT["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        RESULT["oom"] = type(e).__name__ == "OutOfMemoryError"
        print(json.dumps(RESULT), flush=True)
        raise
