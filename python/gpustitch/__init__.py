"""gpustitch: the pool's figures from Python, under PyTorch's names.

Pure Python over the C API of libgpustitch.so (preload/include/gpustitch/gpustitch.h) with
ctypes; torch is not needed. The library is found in the process first (it is there under
`gpustitch run` or LD_PRELOAD), then, for enable_for_torch(), by name or $GPUSTITCH_LIBRARY.

    import gpustitch
    gpustitch.memory_stats(0)["reserved_bytes.all.current"]
    print(gpustitch.memory_summary())
    gpustitch.fragmentation(0)     # 1 - allocated / reserved
    gpustitch.trim(0)              # bytes given back to the driver
    gpustitch.snapshot("snap.pickle")  # for pytorch.org/memory_viz; snapshot() returns the dict

Every function raises gpustitch.NotLoadedError, saying how to load the library, when the pool is
not active in this process.
"""
import ctypes
import os
import pickle
import tempfile

__all__ = [
    "NotLoadedError", "is_active", "device_count", "memory_stats", "memory_summary",
    "fragmentation", "trim", "snapshot", "enable_for_torch", "version", "DeviceStats",
    "DRIVER_OPS",
]


class NotLoadedError(RuntimeError):
    """libgpustitch.so is not loaded in this process, or its pool is not active."""


class DeviceStats(ctypes.Structure):
    """gpustitch_device_stats (preload/include/gpustitch/gpustitch.h), field for field: the one
    Python copy of the record, also used by the GPU workloads (bench/gpu/e2e, tools/gpu)."""

    _fields_ = [(n, ctypes.c_uint64) for n in (
        "allocs", "frees", "cache_hits", "fresh", "stitches", "ooms", "live_blocks",
        "bytes_requested", "bytes_allocated", "bytes_reserved", "bytes_cached", "peak_allocated",
        "peak_reserved", "largest_possible", "device_free", "device_total",
        "driver_calls", "driver_ns", "driver_background_calls", "driver_background_ns")] + [
        ("driver_op_calls", ctypes.c_uint64 * 5), ("driver_op_ns", ctypes.c_uint64 * 5),
        ("peak_reserved_pending", ctypes.c_uint64), ("peak_reserved_allocated", ctypes.c_uint64)] + [
        (n, ctypes.c_uint64) for n in (
            "fence_syncs", "fence_sync_ns", "fence_waits", "fence_wait_ns",
            "fence_waits_timed_out")]


DRIVER_OPS = ("create", "map", "set_access", "unmap", "release")  # gpustitch_device_stats order
_HOW = ("run the program under `gpustitch run -- python ...` (or LD_PRELOAD=libgpustitch.so), "
        "or call gpustitch.enable_for_torch() before PyTorch allocates")
_lib = None


def _bind(lib):
    lib.gpustitch_active.restype = ctypes.c_int
    lib.gpustitch_get_stats.restype = ctypes.c_int
    lib.gpustitch_get_stats.argtypes = [ctypes.c_int, ctypes.POINTER(DeviceStats),
                                        ctypes.c_size_t]
    lib.gpustitch_version.restype = ctypes.c_char_p
    if hasattr(lib, "gpustitch_snapshot"):
        lib.gpustitch_snapshot.restype = ctypes.c_int
        lib.gpustitch_snapshot.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    if hasattr(lib, "gpustitch_trim"):
        lib.gpustitch_trim.restype = ctypes.c_longlong
        lib.gpustitch_trim.argtypes = [ctypes.c_int]
        lib.gpustitch_device_count.restype = ctypes.c_int
    return lib


def _in_process():
    """The library's C API if libgpustitch.so is already in the process, else None."""
    try:
        proc = ctypes.CDLL(None)
        proc.gpustitch_active  # noqa: B018: raises AttributeError when absent
        return _bind(proc)
    except (OSError, AttributeError):
        return None


def _library(load=False):
    global _lib
    if _lib is None:
        _lib = _in_process()
    if _lib is None and load:
        path = os.environ.get("GPUSTITCH_LIBRARY") or "libgpustitch.so"
        try:
            _lib = _bind(ctypes.CDLL(path))
        except OSError as e:
            raise NotLoadedError(f"cannot load {path} ({e}); set GPUSTITCH_LIBRARY to its path")
    return _lib


def _active():
    lib = _library()
    if lib is None:
        raise NotLoadedError("libgpustitch.so is not loaded in this process: " + _HOW)
    if lib.gpustitch_active() != 1:
        raise NotLoadedError("libgpustitch.so is loaded but its pool is not active (no driver, "
                             "enable:off, or no usable device; see its warning on stderr)")
    return lib


def is_active():
    """Whether the pool serves allocations in this process (False when not loaded)."""
    lib = _library()
    return bool(lib is not None and lib.gpustitch_active() == 1)


def version():
    """The library's version string."""
    lib = _library()
    if lib is None:
        raise NotLoadedError("libgpustitch.so is not loaded in this process: " + _HOW)
    return lib.gpustitch_version().decode()


def device_count():
    """Devices the pool serves."""
    lib = _active()
    return int(lib.gpustitch_device_count()) if hasattr(lib, "gpustitch_device_count") else 1


def _stats(device):
    lib = _active()
    s = DeviceStats()
    if lib.gpustitch_get_stats(int(device), ctypes.byref(s), ctypes.sizeof(s)) != 0:
        raise ValueError(f"device {device} is not served by the pool")
    return s


def memory_stats(device=0):
    """The pool's figures for device under torch.cuda.memory_stats()'s key names.

    allocated_bytes / reserved_bytes / requested_bytes .all.current and .peak, num_alloc_retries
    and num_ooms as PyTorch names them, plus the pool's own figures under "gpustitch.*".
    """
    s = _stats(device)
    out = {
        "allocated_bytes.all.current": s.bytes_allocated,
        "allocated_bytes.all.peak": s.peak_allocated,
        "reserved_bytes.all.current": s.bytes_reserved,
        "reserved_bytes.all.peak": s.peak_reserved,
        "requested_bytes.all.current": s.bytes_requested,
        "active_bytes.all.current": s.bytes_allocated,
        "inactive_split_bytes.all.current": s.bytes_cached,
        "allocation.all.allocated": s.allocs,
        "allocation.all.freed": s.frees,
        "allocation.all.current": s.live_blocks,
        "num_ooms": s.ooms,
    }
    for name, _ in DeviceStats._fields_:
        value = getattr(s, name)
        if isinstance(value, int):
            out["gpustitch." + name] = value
        else:  # by driver call kind: gpustitch.driver_op_ns.set_access, ...
            for op, v in zip(DRIVER_OPS, value):
                out[f"gpustitch.{name}.{op}"] = v
    return out


def fragmentation(device=0):
    """1 - allocated / reserved, the figure PyTorch users compute (0.0 when nothing is reserved)."""
    s = _stats(device)
    return 0.0 if s.bytes_reserved == 0 else 1.0 - s.bytes_allocated / s.bytes_reserved


def trim(device=0):
    """Gives device's idle cached memory back to the driver; returns the bytes released."""
    lib = _active()
    released = lib.gpustitch_trim(int(device))
    if released < 0:
        raise ValueError(f"device {device} is not served by the pool")
    return int(released)


def snapshot(path=None):
    """A PyTorch memory snapshot of the pool, as torch.cuda.memory._snapshot() gives PyTorch's.

    With path: writes the pickle there (what torch.cuda.memory._dump_snapshot(path) writes and
    pytorch.org/memory_viz or torch.cuda._memory_viz read) and returns path. Without: returns the
    dict. 'segments' are the pool's mapped ranges and their blocks; 'device_traces' the recent
    allocation events (GPUSTITCH_CONF trace_events:N, 10,000 by default), with native stacks
    where allocation sites are sampled (sites_min_mb / sites_sample).
    """
    lib = _active()
    if not hasattr(lib, "gpustitch_snapshot"):
        raise NotLoadedError(f"libgpustitch.so {version()} predates snapshots; use a newer one")
    if path is None:
        fd, tmp = tempfile.mkstemp(prefix="gpustitch-snapshot-", suffix=".pickle")
        os.close(fd)
        try:
            snapshot(tmp)
            with open(tmp, "rb") as f:
                return pickle.load(f)
        finally:
            os.unlink(tmp)
    target = os.fspath(path)
    error = ctypes.create_string_buffer(512)
    rc = lib.gpustitch_snapshot(os.fsencode(target), error, ctypes.sizeof(error))
    if rc == -1:
        raise NotLoadedError("libgpustitch.so is loaded but its pool is not active")
    if rc != 0:
        raise OSError(f"cannot write the snapshot to {target}: {error.value.decode(errors='replace')}")
    return path


def _fmt(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024.0
    return f"{n} B"


def memory_summary(device=0):
    """A table of the pool's figures for device, laid out like torch.cuda.memory_summary()."""
    s = _stats(device)
    rule = "|" + "=" * 75 + "|"
    rows = [
        ("Allocated memory", s.bytes_allocated, s.peak_allocated),
        ("Requested memory", s.bytes_requested, None),
        ("GPU reserved memory", s.bytes_reserved, s.peak_reserved),
        ("Cached (reserved, not allocated)", s.bytes_cached, None),
        ("Largest possible allocation", s.largest_possible, None),
        ("Device free", s.device_free, None),
    ]
    lines = [rule,
             "|{:^75}|".format(f"gpustitch memory summary, device {device}"),
             "|{:^75}|".format(f"fragmentation {100 * fragmentation(device):.1f}%  "
                               f"stitches {s.stitches}  OOMs {s.ooms}"),
             rule,
             "| {:<34}| {:>18} | {:>18} |".format("Metric", "Cur Usage", "Peak Usage"),
             "|" + "-" * 75 + "|"]
    for name, cur, peak in rows:
        lines.append("| {:<34}| {:>18} | {:>18} |".format(
            name, _fmt(cur), "" if peak is None else _fmt(peak)))
    lines.append("| {:<34}| {:>18} | {:>18} |".format("Allocations (live / total)",
                                                      s.live_blocks, s.allocs))
    lines.append(rule)
    return "\n".join(lines)


def enable_for_torch():
    """Makes PyTorch allocate through the pool in process (torch.cuda.CUDAPluggableAllocator),
    without LD_PRELOAD. Call before PyTorch's first CUDA allocation. PyTorch keeps no statistics
    on this path: read them with gpustitch.memory_stats()."""
    import torch  # only this function needs torch

    lib = _library(load=True)
    path = os.environ.get("GPUSTITCH_LIBRARY") or "libgpustitch.so"
    found = _dladdr(lib)  # the very file already in the process, when it is
    if found:
        path = found
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "gpustitch_malloc", "gpustitch_free")
    torch.cuda.memory.change_current_allocator(alloc)
    return alloc


def _dladdr(lib):
    """The file the library's gpustitch_active comes from, or None."""
    class _DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        libdl = ctypes.CDLL(None)
        info = _DlInfo()
        addr = ctypes.cast(lib.gpustitch_active, ctypes.c_void_p)
        if libdl.dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            return info.dli_fname.decode()
    except (OSError, AttributeError):
        pass
    return None
