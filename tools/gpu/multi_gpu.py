#!/usr/bin/env python3
"""Two-GPU checks of the shim (needs two GPUs; run natively and under LD_PRELOAD=libgpustitch.so).

    multi_gpu.py pools      per-device pools: arrays on GPU 0 and GPU 1 (CuPy, pool disabled, so each
                            array is a driver allocation), bytes read back, data pointers of GPU 1's
                            arrays on GPU 1 (cuPointerGetAttribute through CuPy)
    multi_gpu.py peer       cudaDeviceEnablePeerAccess, a kernel on GPU 1 reading GPU 0's array and
                            writing its own, cudaMemcpyPeer between the two: bytes checked
    multi_gpu.py ddp        two-process DistributedDataParallel (NCCL) training loop, 20 steps;
                            prints the loss curve's checksum
    multi_gpu.py ipc        PyTorch multiprocessing hands a CUDA tensor to a child (CUDA IPC); the
                            child reads it. Prints PASS, or FAIL with the error the child saw.

Each prints "PASS: ..." or "FAIL: ...", and "checksum: N" where results can be compared with a
native run. NCCL keeps the machine's own multicast settings (NCCL_NVLS_ENABLE=0 is set if unset).
"""
import os
import sys
import time


def pools():
    import cupy as cp
    cp.cuda.set_allocator(None)
    total = 0.0
    arrays = []
    for dev in (0, 1):
        with cp.cuda.Device(dev):
            for n in (1 << 10, 1 << 20, 1 << 24):
                a = cp.arange(n, dtype=cp.float32) * (dev + 1)
                attrs = cp.cuda.runtime.pointerGetAttributes(a.data.ptr)
                if attrs.device != dev:
                    print(f"FAIL: pools: array on GPU {dev} reports device {attrs.device}")
                    return 1
                arrays.append((dev, n, a))
    for dev, n, a in arrays:
        with cp.cuda.Device(dev):
            got = float(a[-1])
            if got != (n - 1) * (dev + 1):
                print(f"FAIL: pools: GPU {dev} array of {n}: last element {got}")
                return 1
            total += float(a.sum())
    print(f"PASS: pools: {len(arrays)} arrays on GPUs 0 and 1 read back")
    print(f"checksum: {total:.9e}")
    return 0


def peer():
    import cupy as cp
    cp.cuda.set_allocator(None)
    if not cp.cuda.runtime.deviceCanAccessPeer(1, 0):
        print("FAIL: peer: GPU 1 cannot access GPU 0 (no P2P on this machine)")
        return 1
    n = 1 << 22
    with cp.cuda.Device(0):
        src = cp.arange(n, dtype=cp.float32)
    with cp.cuda.Device(1):
        cp.cuda.runtime.deviceEnablePeerAccess(0)
        dst = cp.zeros(n, dtype=cp.float32)
        kernel = cp.RawKernel(r'''
extern "C" __global__ void twice(const float* src, float* dst, unsigned n) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = 2.0f * src[i];
}''', "twice")
        kernel(((n + 255) // 256,), (256,), (src, dst, cp.uint32(n)))  # reads GPU 0's memory
        cp.cuda.Device(1).synchronize()
        ok_kernel = bool(cp.all(dst == 2.0 * cp.arange(n, dtype=cp.float32)))
        back = cp.zeros(n, dtype=cp.float32)
    with cp.cuda.Device(0):
        src2 = cp.zeros(n, dtype=cp.float32)
    cp.cuda.runtime.memcpyPeer(src2.data.ptr, 0, dst.data.ptr, 1, n * 4)  # GPU 1 -> GPU 0
    cp.cuda.runtime.memcpyPeer(back.data.ptr, 1, src2.data.ptr, 0, n * 4)  # and back
    with cp.cuda.Device(0):
        ok_copy0 = bool(cp.all(src2 == 2.0 * cp.arange(n, dtype=cp.float32)))
        total = float(src2.sum())
    with cp.cuda.Device(1):
        ok_copy1 = bool(cp.all(back == dst))
    ok = ok_kernel and ok_copy0 and ok_copy1
    print(f"{'PASS' if ok else 'FAIL'}: peer: kernel on GPU 1 reading GPU 0 {ok_kernel}, "
          f"cudaMemcpyPeer 1->0 {ok_copy0}, 0->1 {ok_copy1}")
    print(f"checksum: {total:.9e}")
    return 0 if ok else 1


def _ddp_worker(rank, world, port, out):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda(rank)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(20):
        x = torch.randn(64, 512, generator=gen).cuda(rank)
        loss = ((ddp(x) - x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    if rank == 0:
        out.put(losses)
    dist.barrier()
    dist.destroy_process_group()


def ddp():
    import socket
    import torch.multiprocessing as mp
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ddp_worker, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    losses = out.get(timeout=240)
    for p in procs:
        p.join(60)
    ok = all(p.exitcode == 0 for p in procs) and losses[-1] < losses[0]
    print(f"{'PASS' if ok else 'FAIL'}: ddp: 2 ranks, NCCL, loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    print(f"checksum: {sum(losses):.9e}")
    return 0 if ok else 1


def _ipc_child(q, r):
    try:
        t = q.get(timeout=20)
        r.put(("ok", float(t.sum()), t.device.index))
    except Exception as e:  # what a user would see
        r.put(("error", f"{type(e).__name__}: {e}".splitlines()[0][:300], -1))


def ipc():
    import torch
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(q, r))
    child.start()
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda:1")
    try:
        # Pickle here, as Queue.put's feeder thread would, so that an error surfaces in this thread.
        from multiprocessing.reduction import ForkingPickler
        ForkingPickler.dumps(t)
        q.put(t)
    except Exception as e:
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        print(f"FAIL: ipc: sharing the tensor failed in the parent: {msg}")
        child.kill()
        return 1
    status, value, dev = r.get(timeout=120)
    child.join(30)
    want = float(t.sum())
    if status == "ok" and value == want and dev == 1:
        print(f"PASS: ipc: child read the shared GPU 1 tensor (sum {value:.6e})")
        print(f"checksum: {value:.9e}")
        return 0
    print(f"FAIL: ipc: child saw {status}: {value}")
    return 1


if __name__ == "__main__":
    checks = {"pools": pools, "peer": peer, "ddp": ddp, "ipc": ipc}
    if len(sys.argv) != 2 or sys.argv[1] not in checks:
        print(__doc__)
        sys.exit(2)
    t0 = time.perf_counter()
    rc = checks[sys.argv[1]]()
    print(f"wall_ms: {(time.perf_counter() - t0) * 1000:.1f}")
    sys.exit(rc)
