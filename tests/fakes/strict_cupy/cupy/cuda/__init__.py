"""cupy.cuda stand-in: runtime (device count from env STRICT_CUPY_DEVICES), Device, Stream,
Event, get_current_stream, get_device_id, cublas (gemmEx and gemmStridedBatchedEx on
pointers) and nccl (over MPI). See cupy/__init__.py."""
from . import runtime
from .device import Device, get_cublas_handle, get_device_id  # noqa: F401
from .stream import Event, Stream, get_current_stream, get_elapsed_time  # noqa: F401
from . import cublas, nccl  # noqa: F401
from .._core import MemoryPointer  # noqa: F401


def is_available():
    try:
        return runtime.getDeviceCount() > 0
    except runtime.CUDARuntimeError:
        return False


def get_cuda_path():
    return None
