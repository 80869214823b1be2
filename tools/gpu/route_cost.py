#!/usr/bin/env python3
"""route_cost.py: what one tensor allocation costs PyTorch's CPU thread, per allocator route.

Tokens/s of a training run move by 10-25% from run to run on a shared GPU machine, so they cannot
tell apart routes that differ by a few percent. This measures the part of the difference that
lies on the CPU thread, where a CPU-bound training step pays it: the wall time of
torch.empty + del (an allocation and a free through whatever allocator PyTorch has), and of a
small elementwise op whose result is a fresh tensor (allocation, kernel launch, free), in
microseconds per iteration, median of --repeats timed loops. The device is not synchronised
inside a loop: the GPU work queued behind is what a training step has queued too.

Run it once per route, in separate processes, e.g.

    python3 tools/gpu/route_cost.py --label default
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 tools/gpu/route_cost.py --label expandable
    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python3 tools/gpu/route_cost.py --label async
    BUILD/tools/gpustitch run -- python3 tools/gpu/route_cost.py --label gpustitch
    python3 tools/gpu/route_cost.py --label pluggable --pluggable BUILD/preload/libgpustitch.so

Prints one JSON line: {"label", "torch", "alloc_free_us": {size: us}, "op_us": us, ...}.
"""
import argparse
import json
import statistics
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="unnamed", help="name of the route in the output")
    ap.add_argument("--iters", type=int, default=20000, help="iterations per timed loop")
    ap.add_argument("--repeats", type=int, default=7, help="timed loops per figure (median)")
    ap.add_argument("--pluggable", default="",
                    help="use this library as PyTorch's CUDAPluggableAllocator "
                         "(gpustitch_malloc / gpustitch_free)")
    args = ap.parse_args()

    import torch

    if args.pluggable:
        alloc = torch.cuda.memory.CUDAPluggableAllocator(args.pluggable, "gpustitch_malloc",
                                                         "gpustitch_free")
        torch.cuda.memory.change_current_allocator(alloc)
    dev = torch.device("cuda")
    torch.empty(1, device=dev)
    torch.cuda.synchronize()

    def timed(body):
        body(args.iters // 10)  # warm: the pool and PyTorch's cache hold the sizes
        torch.cuda.synchronize()
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            body(args.iters)
            runs.append((time.perf_counter() - t0) / args.iters * 1e6)
            torch.cuda.synchronize()
        return round(statistics.median(runs), 3)

    out = {"label": args.label, "torch": torch.__version__, "iters": args.iters,
           "repeats": args.repeats, "alloc_free_us": {}}
    for size in (512, 65536, 4 << 20, 64 << 20):
        def body(n, size=size):
            for _ in range(n):
                t = torch.empty(size, dtype=torch.uint8, device=dev)
                del t
        out["alloc_free_us"][str(size)] = timed(body)

    # Eight live tensors of mixed sizes, freed oldest first: reuse across sizes, not one slot.
    sizes = [512, 3 << 20, 65536, 1 << 20, 24 << 20, 4096, 8 << 20, 300000]

    def mixed(n):
        live = []
        for i in range(n):
            live.append(torch.empty(sizes[i % len(sizes)], dtype=torch.uint8, device=dev))
            if len(live) > 8:
                live.pop(0)
        live.clear()
    out["mixed_us"] = timed(mixed)

    x = torch.ones(256, device=dev)

    def op(n):
        for _ in range(n):
            y = x + 1.0
            del y
    out["op_us"] = timed(op)
    out["empty_loop_us"] = timed(lambda n: [None for _ in range(n)])
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
