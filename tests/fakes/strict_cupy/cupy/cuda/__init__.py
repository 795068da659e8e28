"""cupy.cuda stand-in: runtime (device count from env STRICT_CUPY_DEVICES), Device, Stream,
Event, get_current_stream, get_device_id, cublas (gemmEx and gemmStridedBatchedEx on
pointers) and nccl (over MPI). See cupy/__init__.py."""
from . import runtime
from .device import Device, get_cublas_handle, get_device_id  # noqa: F401
from .stream import Event, Stream, get_current_stream, get_elapsed_time  # noqa: F401
from . import cublas, graph, nccl  # noqa: F401
from .. import _strict
from .._core import MemoryPointer  # noqa: F401


class MemoryPool:
    """A caching pool (cupy.cuda.MemoryPool, get_default_memory_pool()): the counters read by
    memory reports, all zero; `malloc` names the pool in set_allocator."""

    def malloc(self, size):
        raise NotImplementedError("the stand-in allocates NumPy memory; set_allocator only records the pool")

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_bytes(self):
        return 0

    def free_all_blocks(self, stream=None):
        pass

    def set_limit(self, size=None, fraction=None):
        pass

    def get_limit(self):
        return 0


class MemoryAsyncPool(MemoryPool):
    """Stream-ordered allocation (cudaMallocAsync); set_allocator tells it from a caching pool."""

    def __init__(self, pool_handles="current"):
        self.pool_handles = pool_handles


_current = {"allocator": None}


def get_allocator():
    """The allocator set_allocator set last (the default pool's malloc at first)."""
    from .. import get_default_memory_pool
    return _current["allocator"] or get_default_memory_pool().malloc


def set_allocator(allocator=None):
    """Which pool later allocations come from (None: the default pool): a MemoryAsyncPool's is
    stream-ordered, a MemoryPool's other than the default one is a pool of its own."""
    from .. import get_default_memory_pool
    owner = getattr(allocator, "__self__", None)
    kind = ("stream_ordered" if isinstance(owner, MemoryAsyncPool)
            else "default" if owner is None or owner is get_default_memory_pool() else "private")
    _strict._allocator.update(kind=kind, pool=owner if kind != "default" else None)
    _current["allocator"] = allocator
    _strict.log_event("cuda.set_allocator", kind=kind)


def is_available():
    try:
        return runtime.getDeviceCount() > 0
    except runtime.CUDARuntimeError:
        return False


def get_cuda_path():
    return None
