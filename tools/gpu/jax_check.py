#!/usr/bin/env python3
"""JAX with XLA's platform allocator: each buffer is a real device allocation.

Run with XLA_PYTHON_CLIENT_ALLOCATOR=platform (set here if unset, with preallocation off). XLA
resolves the driver itself, so this shows whether the shim sees it. A jitted MLP trained for a few
steps with real gradients on fixed data, plus jitted array math of several shapes; the checksum is
printed for comparison between a native run and one under LD_PRELOAD=libgpustitch.so.
Output lines: PASS|FAIL, checksum:, wall_ms:.
"""
import math
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def init(key, sizes):
    params = []
    for din, dout in zip(sizes[:-1], sizes[1:]):
        key, k = jax.random.split(key)
        params.append((jax.random.normal(k, (din, dout)) / math.sqrt(din), jnp.zeros(dout)))
    return params


def forward(params, x):
    for w, b in params[:-1]:
        x = jax.nn.gelu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


@jax.jit
def step(params, x, y):
    def loss_fn(p):
        return jnp.mean((forward(p, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    params = jax.tree_util.tree_map(lambda p, g: p - 1e-2 * g, params, grads)
    return params, loss


@jax.jit
def math_block(a):
    return jnp.sum(jnp.sin(a) @ jnp.cos(a).T) + jnp.sum(jnp.sort(a.ravel())[::7])


def main():
    print(f"jax {jax.__version__}, devices {jax.devices()}, "
          f"XLA_PYTHON_CLIENT_ALLOCATOR={os.environ.get('XLA_PYTHON_CLIENT_ALLOCATOR')}")
    if jax.devices()[0].platform != "gpu":
        print("FAIL: jax_check (no GPU device)")
        return 1
    t0 = time.perf_counter()
    key = jax.random.PRNGKey(0)
    params = init(key, [256, 1024, 1024, 64])
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (4096, 256))
    y = jax.random.normal(ky, (4096, 64))
    losses = []
    for _ in range(40):
        params, loss = step(params, x, y)
        losses.append(float(loss))
    total = sum(losses)
    for n in (128, 512, 1024, 2048):
        a = jax.random.normal(jax.random.PRNGKey(n), (n, n))
        total += float(math_block(a)) / n
    # Byte accounting for the matrix (matrix_bytes.py) while this memory is live.
    import matrix_bytes
    matrix_bytes.report("jax")
    wall_ms = (time.perf_counter() - t0) * 1000
    ok = all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    print(f"{'PASS' if ok else 'FAIL'}: jax_check (40 jitted training steps, 4 shapes)")
    print(f"checksum: {total:.9e}")
    print(f"wall_ms: {wall_ms:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
