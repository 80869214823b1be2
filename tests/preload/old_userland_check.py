"""Runs inside the old userland root (tests/preload/old_userland_test.sh) with the root's own
python3, libgpustitch.so preloaded and the simulated backend configured: the exported C API
(gpustitch.h) allocates, writes, reads back and frees, and gpustitch_get_stats accounts for it.
Usage: python3 old_userland_check.py api VERSION | malformed
Kept to what Python 3.6 has (RHEL 8's python3)."""
import ctypes
import os
import sys

FIELDS = ["allocs", "frees", "cache_hits", "fresh", "stitches", "ooms", "live_blocks",
          "bytes_requested", "bytes_allocated", "bytes_reserved", "bytes_cached",
          "peak_allocated", "peak_reserved", "largest_possible", "device_free", "device_total"]


class Stats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in FIELDS]


def shim():
    # The process's global scope: the symbols are there only because LD_PRELOAD put them there.
    lib = ctypes.CDLL(None)
    lib.gpustitch_malloc.restype = ctypes.c_void_p
    lib.gpustitch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.gpustitch_free.restype = None
    lib.gpustitch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                                   ctypes.c_void_p]
    lib.gpustitch_owns.argtypes = [ctypes.c_void_p]
    lib.gpustitch_get_stats.argtypes = [ctypes.c_int, ctypes.POINTER(Stats), ctypes.c_size_t]
    lib.gpustitch_version.restype = ctypes.c_char_p
    return lib


def stats(lib, device):
    s = Stats()
    rc = lib.gpustitch_get_stats(device, ctypes.byref(s), ctypes.sizeof(s))
    return rc, s


def check(cond, what):
    if not cond:
        print("old-userland: FAILED: " + what)
        sys.exit(1)


def api(version):
    lib = shim()
    got = lib.gpustitch_version().decode()
    check(got == version, "gpustitch_version() is %r, expected %r" % (got, version))
    check(lib.gpustitch_active() == 1, "gpustitch_active() is not 1 on the simulated backend")
    sizes = [4096, 1 << 20, 48 << 20 | 123]
    blocks = []
    for size in sizes:
        ptr = lib.gpustitch_malloc(size, 0, None)
        check(ptr, "gpustitch_malloc(%d) returned NULL" % size)
        pattern = os.urandom(size)
        ctypes.memmove(ptr, pattern, size)
        blocks.append((ptr, size, pattern))
    for ptr, size, pattern in blocks:
        check(ctypes.string_at(ptr, size) == pattern, "read back differs at %#x" % ptr)
        check(lib.gpustitch_owns(ptr) == 1, "gpustitch_owns(base) is not 1")
        check(lib.gpustitch_owns(ptr + size - 1) == 1, "gpustitch_owns(last byte) is not 1")
    rc, s = stats(lib, 0)
    check(rc == 0, "gpustitch_get_stats(0) returned %d" % rc)
    check(s.allocs == len(sizes), "allocs %d, expected %d" % (s.allocs, len(sizes)))
    check(s.live_blocks == len(sizes), "live_blocks %d" % s.live_blocks)
    check(s.bytes_requested == sum(sizes), "bytes_requested %d, expected %d"
          % (s.bytes_requested, sum(sizes)))
    check(s.bytes_allocated >= s.bytes_requested, "bytes_allocated below bytes_requested")
    check(s.bytes_reserved >= s.bytes_allocated, "bytes_reserved below bytes_allocated")
    check(s.device_total == 1024 << 20, "device_total %d, expected 1 GiB" % s.device_total)
    for ptr, size, _ in blocks:
        lib.gpustitch_free(ptr, size, 0, None)
    rc, s = stats(lib, 0)
    check(rc == 0 and s.frees == len(sizes), "frees %d after freeing all" % s.frees)
    check(s.live_blocks == 0 and s.bytes_requested == 0, "live after freeing all")
    check(lib.gpustitch_owns(blocks[0][0]) == 0, "gpustitch_owns true after free")
    rc, _ = stats(lib, 99)
    check(rc == -1, "gpustitch_get_stats(99) returned %d, expected -1" % rc)
    print("old-userland: api ok (%d allocations, peak %d bytes)" % (len(sizes), s.peak_allocated))


def malformed():
    lib = shim()
    # Whatever the configuration says, the program goes on: the pool is on or off, and an
    # allocation is served or refused, but nothing stops the process.
    active = lib.gpustitch_active()
    ptr = lib.gpustitch_malloc(4096, 0, None)
    if ptr:
        lib.gpustitch_free(ptr, 4096, 0, None)
    print("old-userland: malformed configuration survived (active %d)" % active)


if __name__ == "__main__":
    if sys.argv[1] == "api":
        api(sys.argv[2])
    else:
        malformed()
