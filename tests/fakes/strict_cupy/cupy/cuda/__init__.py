"""cupy.cuda stand-in: runtime (device count from env STRICT_CUPY_DEVICES), Device, Stream,
Event, get_current_stream, get_device_id, cublas (gemmEx and gemmStridedBatchedEx on
pointers) and nccl (over MPI). See cupy/__init__.py."""
from . import runtime
from .device import Device, get_cublas_handle, get_device_id  # noqa: F401
from .stream import Event, Stream, get_current_stream, get_elapsed_time  # noqa: F401
from . import cublas, graph, nccl  # noqa: F401
from .. import _strict
from .._core import MemoryPointer  # noqa: F401


class MemoryAsyncPool:
    """Stream-ordered allocation (cudaMallocAsync), which CUDA graphs can capture; counters at 0."""

    def __init__(self, pool_handles="current"):
        self.pool_handles = pool_handles

    def malloc(self, size):
        raise NotImplementedError("the stand-in allocates NumPy memory; set_allocator only records the pool kind")

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_all_blocks(self, stream=None):
        pass


def set_allocator(allocator=None):
    """Which pool later allocations come from: MemoryAsyncPool().malloc is stream-ordered (a
    capture may allocate), anything else not."""
    owner = getattr(allocator, "__self__", None)
    _strict._allocator["stream_ordered"] = isinstance(owner, MemoryAsyncPool)
    _strict.log_event("cuda.set_allocator", stream_ordered=_strict._allocator["stream_ordered"])


def is_available():
    try:
        return runtime.getDeviceCount() > 0
    except runtime.CUDARuntimeError:
        return False


def get_cuda_path():
    return None
