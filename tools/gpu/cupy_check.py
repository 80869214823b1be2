#!/usr/bin/env python3
"""CuPy with its memory pool disabled: every array is a real device allocation.

CuPy 14 reaches the CUDA runtime and driver through dlopen + dlsym, so this shows whether the shim
sees programs that never call cudaMalloc through the PLT. Array math of many sizes (elementwise,
reductions, matmul, FFT, sort), with a checksum printed for comparison between a native run and
one under LD_PRELOAD=libgpustitch.so. Output lines: PASS|FAIL, checksum:, wall_ms:.
"""
import math
import sys
import time

import cupy as cp


def main():
    cp.cuda.set_allocator(None)  # no CuPy pool: cudaMalloc/cudaFree per array
    cp.cuda.set_pinned_memory_allocator(None)
    t0 = time.perf_counter()
    total = 0.0
    n_arrays = 0
    rng = cp.random.default_rng(1234)
    sizes = [1 << k for k in range(8, 25)]  # 256 .. 16 Mi elements
    for it in range(6):
        for n in sizes:
            x = cp.arange(n, dtype=cp.float64) / n
            y = cp.sin(x * (it + 1)) * 2.0 + cp.sqrt(x + 1.0)
            total += float(y.sum())
            total += float(cp.sort(y[::-1])[n // 2])
            n_arrays += 6
    for n in (256, 1024, 2048):
        a = rng.standard_normal((n, n), dtype=cp.float64)
        b = a @ a.T + n * cp.eye(n)
        total += float(cp.trace(b)) / n
        f = cp.fft.rfft(a[0])
        total += float(cp.abs(f).sum())
        n_arrays += 6
    cp.cuda.Device().synchronize()
    # Byte accounting for the matrix (matrix_bytes.py) while this memory is live.
    import matrix_bytes
    matrix_bytes.report("cupy")
    wall_ms = (time.perf_counter() - t0) * 1000
    ok = math.isfinite(total)
    print(f"{'PASS' if ok else 'FAIL'}: cupy_check (cupy {cp.__version__}, pool disabled, "
          f"~{n_arrays} arrays)")
    print(f"checksum: {total:.9e}")
    print(f"wall_ms: {wall_ms:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
