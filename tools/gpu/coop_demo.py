#!/usr/bin/env python3
"""coop_demo.py: cooperative release between two PyTorch processes on one GPU (issue 10).

On one GPU a balloon process (no shim) takes all but --budget-gib of the device. Then, under
`gpustitch run` (LD_PRELOAD=libgpustitch.so, PYTORCH_NO_CUDA_MEMORY_CACHING=1):
  A allocates a live tensor and --a-cache-gib of tensors it then frees: gpustitch keeps that memory
    cached and idle in A's pool; A sleeps.
  B allocates --b-gib, more than the device has free.
With coop on (the default) B's allocation must succeed because A releases idle cache; A's live
tensor must keep its values. With coop:off in A, B must get PyTorch's out-of-memory error.
Prints one PASS/FAIL line per scenario with figures (B's allocation time, bytes A gave, from A's
coop_give events in `gpustitch show --json`), and a final PASS/FAIL.

  python3 tools/gpu/coop_demo.py --build .devbuild [--budget-gib 6] [--a-cache-gib 4] [--b-gib 3]

Runs from the repo root with a packed build (tools/gpu/pack-build.sh build .devbuild): it needs
BUILD/preload/libgpustitch.so and BUILD/tools/gpustitch. Exit status 0 only if everything passed.
"""
import argparse
import json
import os
import subprocess
import sys
import time

GiB = 1 << 30

BALLOON = r"""
import sys, torch
budget = int(sys.argv[1])
free, total = torch.cuda.mem_get_info()
take = free - budget
blocks = []
chunk = 1 << 30
while take >= chunk:
    blocks.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
    take -= chunk
if take > (2 << 20):
    blocks.append(torch.empty(take, dtype=torch.uint8, device="cuda"))
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
print(f"balloon ready free={free} total={total}", flush=True)
sys.stdin.readline()
"""

HOLDER = r"""
import os, sys, torch
cache = int(sys.argv[1])
live = torch.arange(64 << 20, dtype=torch.int64, device="cuda")  # 512 MiB, values known
expected = int(live.sum().item())
parts = [torch.ones(cache // 8, dtype=torch.uint8, device="cuda") for _ in range(8)]
torch.cuda.synchronize()
del parts  # freed to gpustitch (caching off): cached, idle
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
print(f"A ready pid={os.getpid()} free={free}", flush=True)
sys.stdin.readline()
ok = int(live.sum().item()) == expected
print(f"A live_ok={int(ok)}", flush=True)
"""

ASKER = r"""
import sys, time, torch
want = int(sys.argv[1])
torch.cuda.init()
torch.empty(1, device="cuda")  # context and shim initialised before timing
free, total = torch.cuda.mem_get_info()
t0 = time.perf_counter()
try:
    x = torch.empty(want, dtype=torch.uint8, device="cuda")
    x.fill_(7)
    torch.cuda.synchronize()
    ok = int(x[-1].item()) == 7 and int(x[0].item()) == 7
    ms = (time.perf_counter() - t0) * 1000
    print(f"B result=ok bytes_ok={int(ok)} ms={ms:.1f} free_before={free}", flush=True)
except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
    # With PYTORCH_NO_CUDA_MEMORY_CACHING=1 PyTorch reports a failed cudaMalloc as a generic
    # AcceleratorError ("CUDA error: out of memory"), natively as under the shim.
    if "out of memory" not in str(e):
        raise
    ms = (time.perf_counter() - t0) * 1000
    print(f"B result=oom ms={ms:.1f} free_before={free}", flush=True)
"""


def start(cmd, env):
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_line(p, prefix, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        line = line.strip()
        if line.startswith(prefix):
            return line
    err = p.stderr.read() if p.poll() is not None else ""
    raise RuntimeError(f"no '{prefix}' line (exit {p.poll()}): {err[-2000:]}")


def fields(line):
    return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)


def coop_given(cli, pid, env):
    """Bytes A released on request, from its coop_give events (gpustitch show --json)."""
    r = subprocess.run([cli, "show", str(pid), "--json"], env=env, capture_output=True, text=True)
    try:
        doc = json.loads(r.stdout)
    except json.JSONDecodeError:
        return None, r.stdout[-500:] + r.stderr[-500:]
    proc = doc.get("process", {}) if isinstance(doc, dict) else {}
    events = proc.get("events", [])
    gives = [e for e in events if e.get("kind") == "coop_give"]
    return sum(int(e.get("size", 0)) for e in gives), gives


def scenario(args, cli, lib, a_conf):
    env = dict(os.environ, GPUSTITCH_LIBRARY=lib)
    env.pop("GPUSTITCH_CONF", None)
    run = [cli, "run"]
    a = start(run + (["--conf", a_conf] if a_conf else []) +
              ["--", sys.executable, "-c", HOLDER, str(int(args.a_cache_gib * GiB))], env)
    try:
        ready = fields(wait_line(a, "A ready"))
        time.sleep(0.5)  # A's record publishes its cached bytes (every 100 ms)
        b = subprocess.run(run + ["--", sys.executable, "-c", ASKER, str(int(args.b_gib * GiB))],
                           env=env, capture_output=True, text=True, timeout=300)
        bl = next((l for l in b.stdout.splitlines() if l.startswith("B result")), None)
        if bl is None:
            raise RuntimeError(f"B printed no result (exit {b.returncode}): {b.stderr[-2000:]}")
        bf = fields(bl)
        given, gives = coop_given(cli, int(ready["pid"]), env)
        a.stdin.write("check\n")
        a.stdin.flush()
        live_ok = fields(wait_line(a, "A live_ok")).get("live_ok") == "1"
    finally:
        try:
            a.stdin.close()
        except OSError:
            pass
        a.wait(timeout=60)
    return bf, given, gives, live_ok, int(ready["free"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=".devbuild")
    ap.add_argument("--budget-gib", type=float, default=6.0,
                    help="device memory the balloon leaves free")
    ap.add_argument("--a-cache-gib", type=float, default=4.0,
                    help="memory A allocates and frees (kept cached idle by gpustitch)")
    ap.add_argument("--b-gib", type=float, default=3.0, help="B's allocation")
    args = ap.parse_args()
    lib = os.path.abspath(os.path.join(args.build, "preload", "libgpustitch.so"))
    cli = os.path.abspath(os.path.join(args.build, "tools", "gpustitch"))
    for f in (lib, cli):
        if not os.path.exists(f):
            print(f"FAIL: {f} missing (pack a build with tools/gpu/pack-build.sh)")
            return 2
    balloon = start([sys.executable, "-c", BALLOON, str(int(args.budget_gib * GiB))], os.environ)
    ok_all = True
    try:
        bal = fields(wait_line(balloon, "balloon ready"))
        print(f"balloon: device free {int(bal['free']) / GiB:.2f} GiB of "
              f"{int(bal['total']) / GiB:.2f} GiB")
        # 1. coop on (the default): B's allocation succeeds with A's idle cache.
        bf, given, gives, live_ok, a_free = scenario(args, cli, lib, "")
        passed = bf.get("result") == "ok" and bf.get("bytes_ok") == "1" and live_ok and \
            (given or 0) > 0
        ok_all &= passed
        print(f"{'PASS' if passed else 'FAIL'}: coop on: B allocated {args.b_gib:.2f} GiB "
              f"with {int(bf.get('free_before', 0)) / GiB:.2f} GiB free -> {bf.get('result')} in "
              f"{bf.get('ms')} ms; A gave {(given or 0) / GiB:.2f} GiB in {len(gives or [])} "
              f"release(s); A's live tensor intact: {live_ok}")
        # 2. coop:off in A: B gets the native out-of-memory error.
        bf, given, gives, live_ok, a_free = scenario(args, cli, lib, "coop:off")
        passed = bf.get("result") == "oom" and live_ok and not given
        ok_all &= passed
        print(f"{'PASS' if passed else 'FAIL'}: coop:off in A: B -> {bf.get('result')} "
              f"(expected oom) after {bf.get('ms')} ms; A gave {(given or 0) / GiB:.2f} GiB; "
              f"A's live tensor intact: {live_ok}")
    except Exception as e:  # noqa: BLE001 - report, never hang the suite
        ok_all = False
        print(f"FAIL: {e}")
    finally:
        try:
            balloon.stdin.close()
        except OSError:
            pass
        balloon.wait(timeout=60)
    print("PASS: coop_demo" if ok_all else "FAIL: coop_demo")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
