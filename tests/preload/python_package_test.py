"""The in-tree Python package (python/gpustitch) on the simulated backend.

ctest runs it twice with PYTHONPATH=python: under LD_PRELOAD=libgpustitch.so with
GPUSTITCH_CONF=backend:sim ("loaded"), and without the library ("absent"). Allocations are made
through the library's own gpustitch_malloc/gpustitch_free (no CUDA needed), and the package's
figures are checked against them and against gpustitch_get_stats. Exit status 0 when all hold.
"""
import ctypes
import sys

import gpustitch

MiB = 1 << 20


def loaded():
    assert gpustitch.is_active()
    assert gpustitch.version()
    assert gpustitch.device_count() == 1
    proc = ctypes.CDLL(None)
    proc.gpustitch_malloc.restype = ctypes.c_void_p
    proc.gpustitch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    proc.gpustitch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                                    ctypes.c_void_p]
    blocks = [proc.gpustitch_malloc(16 * MiB, 0, None) for _ in range(8)]
    assert all(blocks)
    for b in blocks[::2]:
        proc.gpustitch_free(b, 16 * MiB, 0, None)
    stats = gpustitch.memory_stats(0)
    assert stats["allocated_bytes.all.current"] == 4 * 16 * MiB, stats
    assert stats["reserved_bytes.all.current"] >= 8 * 16 * MiB, stats
    assert stats["allocated_bytes.all.peak"] >= 8 * 16 * MiB, stats
    assert stats["gpustitch.live_blocks"] == 4, stats
    frag = gpustitch.fragmentation(0)
    expect = 1 - stats["allocated_bytes.all.current"] / stats["reserved_bytes.all.current"]
    assert abs(frag - expect) < 1e-9 and frag >= 0.45, (frag, expect)
    summary = gpustitch.memory_summary(0)
    assert "GPU reserved memory" in summary and "64.00 MiB" in summary, summary
    released = gpustitch.trim(0)
    after = gpustitch.memory_stats(0)
    assert released >= 4 * 16 * MiB, released
    assert after["reserved_bytes.all.current"] == stats["reserved_bytes.all.current"] - released
    assert after["allocated_bytes.all.current"] == stats["allocated_bytes.all.current"]
    for b in blocks[1::2]:
        proc.gpustitch_free(b, 16 * MiB, 0, None)
    for bad in (lambda: gpustitch.memory_stats(5), lambda: gpustitch.trim(-1)):
        try:
            bad()
            raise AssertionError("an unserved device was accepted")
        except ValueError:
            pass


def absent():
    assert not gpustitch.is_active()
    try:
        gpustitch.memory_stats(0)
        raise AssertionError("no error without the library")
    except gpustitch.NotLoadedError as e:
        assert "gpustitch run" in str(e), str(e)


if __name__ == "__main__":
    {"loaded": loaded, "absent": absent}[sys.argv[1]]()
    print("ok")
