"""A stand-in for the parts of PyTorch train_seqlen.py (and, with ../transformers,
tools/gpu/hf_workloads.py train) uses, for selftest.sh on machines without
PyTorch or a GPU. Tensors carry only a shape; memory is modelled as tokens in flight: a forward
pass with batch * length above $FAKE_TORCH_TOKENS raises OutOfMemoryError, as a real device
would past its budget. It checks train_seqlen.py's control flow (ladder, OOM handling, time
limit, JSON result), not numerics.
"""
import contextlib
import math
import os

__version__ = "0.0-fake"
bfloat16 = "bfloat16"
uint8 = "uint8"
_GIB = 1 << 30
_state = {"peak": 0, "pluggable": False, "step": 0, "balloon": 0}


class OutOfMemoryError(RuntimeError):
    pass


def _limit():
    return int(os.environ.get("FAKE_TORCH_TOKENS", str(5 * 8192)))


class Tensor:
    device = "cuda:0"

    def __init__(self, shape):
        self.shape = tuple(shape)

    def view(self, *shape):
        return Tensor(shape)

    def reshape(self, *shape):
        n = math.prod(self.shape)
        known = math.prod(s for s in shape if s != -1)
        return Tensor(tuple(n // known if s == -1 else s for s in shape))

    def permute(self, *dims):
        return Tensor(tuple(self.shape[d] for d in dims))

    def __len__(self):
        return self.shape[0]

    def __iter__(self):
        return iter(self.unbind(0))

    def unbind(self, dim):
        return tuple(Tensor(self.shape[:dim] + self.shape[dim + 1:])
                     for _ in range(self.shape[dim]))

    def transpose(self, a, b):
        s = list(self.shape)
        s[a], s[b] = s[b], s[a]
        return Tensor(s)

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        shape = list(self.shape)
        for i, sl in enumerate(idx):
            if isinstance(sl, slice):
                shape[i] = len(range(*sl.indices(shape[i])))
        return Tensor(shape)

    def __add__(self, other):
        return Tensor(self.shape if len(self.shape) >= len(other.shape) else other.shape)

    def numel(self):
        return math.prod(self.shape)

    def item(self):
        _state["step"] += 1
        return 9.0 / (1 + 0.1 * _state["step"])

    def backward(self):
        pass


class device:
    def __init__(self, kind, index=0):
        self.type, self.index = kind, index


def manual_seed(seed):
    pass


class Generator:
    def __init__(self, device=None):
        pass

    def manual_seed(self, seed):
        return self


def randint(lo, hi, shape, device=None, generator=None):
    tokens = shape[0] * (shape[1] - 1)
    if tokens > _limit():
        raise OutOfMemoryError(f"CUDA out of memory (fake): {tokens} tokens")
    _state["peak"] = max(_state["peak"], tokens)
    return Tensor(shape)


def arange(n, device=None):
    return Tensor((n,))


def empty(n, dtype=None, device=None):
    _state["balloon"] += n
    return Tensor((n,))


@contextlib.contextmanager
def autocast(kind, dtype=None):
    yield


class _Cuda:
    class memory:
        class CUDAPluggableAllocator:
            def __init__(self, lib, alloc, free):
                self.lib = lib

        @staticmethod
        def change_current_allocator(a):
            _state["pluggable"] = True

    @staticmethod
    def init():
        pass

    @staticmethod
    def get_device_name(i):
        return "Fake GPU"

    @staticmethod
    def mem_get_info(i):
        return 140 * _GIB, 141 * _GIB

    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def max_memory_allocated(i=0):
        if _state["pluggable"]:
            raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")
        return _state["balloon"] + _state["peak"] * 400_000

    @staticmethod
    def max_memory_reserved(i=0):
        return _Cuda.max_memory_allocated(i) + _GIB


cuda = _Cuda()


class _Backends:
    class cuda:
        class matmul:
            allow_tf32 = False


backends = _Backends()

from . import nn, optim  # noqa: E402,F401
