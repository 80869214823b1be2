#!/usr/bin/env python3
"""JAX under the shim: a jitted MLP training step in plain JAX, checksum, bytes, speed and memory.

One run (the matrix row, tools/gpu/run-matrix.sh): XLA_PYTHON_CLIENT_ALLOCATOR=platform unless
set (preallocation off unless set; `gpustitch run` sets cuda_async, docs/frameworks.md). A jitted
MLP trained for a few steps with real gradients on fixed data, plus jitted array math of several
shapes; the checksum is printed for comparison between a native run and one under the shim.
Output lines: PASS|FAIL, checksum:, wall_ms:, bytes: (matrix_bytes.py), result: (one JSON line).

--compare --build BUILD runs that program once per configuration, each in its own process, and
prints one table and a verdict:
  native default     no XLA_PYTHON_CLIENT_* (BFC, 75% of the device preallocated)
  native platform    XLA_PYTHON_CLIENT_ALLOCATOR=platform, no preallocation
  shim run           BUILD/tools/gpustitch run (cuda_async: every buffer from the pool)
  shim platform      gpustitch run with the user's XLA_PYTHON_CLIENT_ALLOCATOR=platform (XLA's own
                     cuMemCreate/cuMemRelease per buffer, served with the pool's idle handles)
  shim default       gpustitch run with the user's bfc and preallocation (one region mapped by
                     XLA itself: counted, nothing to serve)
with XLA autotuning off everywhere (autotuning times GEMM algorithms, so processes whose timing
differs may round differently). PASS needs: every checksum equal to native default's (relative
1e-7); under shim run the pool served at least the bytes of JAX's live arrays; under shim platform
the pool lent handles (program_served_bytes > 0) and, lent and served together, covered the live
arrays. Per configuration it reports ms per training step (median after warm-up), JAX's peak
bytes in use (memory_stats, where the allocator keeps them), NVML's figure for the process, the
pool's served/held bytes and what the program mapped itself (held, of it lent by the pool).
"""
import json
import math
import os
import statistics
import subprocess
import sys
import time

if "--compare" not in sys.argv:
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


def run_once():
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
    losses, step_ms = [], []
    for _ in range(40):
        s0 = time.perf_counter()
        params, loss = step(params, x, y)
        losses.append(float(loss))  # waits for the step
        step_ms.append((time.perf_counter() - s0) * 1000)
    total = sum(losses)
    for n in (128, 512, 1024, 2048):
        a = jax.random.normal(jax.random.PRNGKey(n), (n, n))
        total += float(math_block(a)) / n
    # Byte accounting for the matrix (matrix_bytes.py) while this memory is live.
    import matrix_bytes
    matrix_bytes.report("jax")
    wall_ms = (time.perf_counter() - t0) * 1000
    ok = all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    try:
        peak = int((jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)) or None
    except Exception:  # noqa: BLE001 - the platform allocator keeps no statistics
        peak = None
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    print(f"{'PASS' if ok else 'FAIL'}: jax_check (40 jitted training steps, 4 shapes)")
    print(f"checksum: {total:.9e}")
    print(f"wall_ms: {wall_ms:.1f}")
    print("result: " + json.dumps({"ok": ok, "checksum": total, "wall_ms": wall_ms,
                                   "step_ms": statistics.median(step_ms[5:]), "peak": peak}),
          flush=True)
    return 0 if ok else 1


# ---- --compare ------------------------------------------------------------------------------

MiB = 1 << 20


def configurations(build):
    cli = os.path.join(build, "tools", "gpustitch")
    run = [cli, "run", "--"]
    return [
        ("native default", {}, []),
        ("native platform", {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform",
                             "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, []),
        ("shim run", {}, run),
        ("shim platform", {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, run),
        ("shim default", {"XLA_PYTHON_CLIENT_ALLOCATOR": "bfc",
                          "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, run),
    ], cli


def child(name, extra, prefix, cli, timeout):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("XLA_PYTHON_CLIENT_") and k not in ("LD_PRELOAD", "GPUSTITCH_CONF")}
    env.update(extra)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    env["GPUSTITCH_CLI"] = cli
    cmd = prefix + [sys.executable, os.path.abspath(__file__)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = {"name": name, "status": r.returncode}
    import matrix_bytes
    out["bytes"] = matrix_bytes.find_measurement(r.stdout)
    for line in r.stdout.splitlines():
        if line.startswith("result: "):
            out.update(json.loads(line[len("result: "):]))
    if "checksum" not in out:
        out["error"] = (r.stdout + r.stderr)[-2000:]
    return out


def served_figures(m):
    """(pool served, pool held, program held, program served by the pool) in bytes, or Nones."""
    pool = (m or {}).get("pool") or {}
    return (pool.get("served"), pool.get("held"), pool.get("program_held"),
            pool.get("program_served"))


def mib(v):
    return "-" if v is None else f"{v / MiB:,.0f}"


def compare(build, timeout):
    configs, cli = configurations(build)
    if not os.access(cli, os.X_OK):
        print(f"FAIL: jax_check --compare ({cli} not found; pass --build BUILD)")
        return 1
    rows = [child(name, extra, prefix, cli, timeout) for name, extra, prefix in configs]
    base = rows[0].get("checksum")
    why = []
    print("| configuration | checksum | ms/step | JAX peak in use (MiB) | NVML (MiB) | "
          "pool served / held (MiB) | program held / of it lent (MiB) | JAX live arrays (MiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        m = r.get("bytes") or {}
        served, held, prog, lent = served_figures(m)
        live = ((m.get("framework") or {}).get("live"))
        print(f"| {r['name']} | {r.get('checksum', float('nan')):.9e} | "
              f"{r.get('step_ms', float('nan')):.2f} | {mib(r.get('peak'))} | "
              f"{mib(m.get('nvml'))} | {mib(served)} / {mib(held)} | {mib(prog)} / {mib(lent)} | "
              f"{mib(live)} |")
        if "error" in r or r["status"] != 0:
            why.append(f"{r['name']}: exit {r['status']} {r.get('error', '')[-300:]}")
            continue
        if base is None or abs(r["checksum"] - base) > 1e-7 * abs(base):
            why.append(f"{r['name']}: checksum {r['checksum']:.9e} vs native {base}")
        if r["name"] == "shim run" and (served is None or live is None or served < live):
            why.append(f"shim run: pool served {mib(served)} MiB < live arrays {mib(live)} MiB")
        if r["name"] == "shim platform":
            if not lent:
                why.append("shim platform: no handle lent by the pool")
            elif live is not None and (served or 0) + lent < live:
                why.append(f"shim platform: served {mib(served)} + lent {mib(lent)} MiB < live "
                           f"arrays {mib(live)} MiB")
    print()
    print(("PASS" if not why else "FAIL") + ": jax_check --compare" +
          ("" if not why else " (" + "; ".join(why) + ")"))
    return 0 if not why else 1


def main():
    if "--compare" in sys.argv:
        args = sys.argv[1:]
        build = args[args.index("--build") + 1] if "--build" in args else "build"
        return compare(os.path.abspath(build), timeout=600)
    return run_once()


if __name__ == "__main__":
    sys.exit(main())
