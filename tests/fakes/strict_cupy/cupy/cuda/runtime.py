"""cupy.cuda.runtime stand-in: device count and selection from env STRICT_CUPY_DEVICES.

Real CuPy (cupy_backends/cuda/api/runtime.pyx) raises CUDARuntimeError(status) for every CUDA
error; `getDeviceCount` raises cudaErrorNoDevice (100) on a machine without GPU or driver, and
`setDevice` raises cudaErrorInvalidDevice (101) for an index out of range. `memGetInfo` gives
(free, total) bytes of the current device: env STRICT_CUPY_DEVICE_BYTES (default 80 GiB) for both."""
import os

from .. import _strict

is_hip = False
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14     # cudaDataType, as _runtime_enum.pxd
CUDA_ERROR_NAMES = {
    100: ("cudaErrorNoDevice", "no CUDA-capable device is detected"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
}
_BUS_BASE = 0x10


class CUDARuntimeError(RuntimeError):
    """CUDA runtime error `status`, with CuPy's message format "name: description"."""

    def __init__(self, status):
        self.status = status
        name, text = CUDA_ERROR_NAMES.get(status, ("cudaErrorUnknown", "unknown error"))
        super().__init__(f"{name}: {text}")

    def __reduce__(self):
        return (type(self), (self.status,))


def getDeviceCount():
    count = _strict.device_count()
    if count < 1:
        raise CUDARuntimeError(100)
    return count


def check_device(index):
    """Raise as CUDA does for an index that names no visible device."""
    count = getDeviceCount()
    if not 0 <= index < count:
        raise CUDARuntimeError(101)
    return index


def getDevice():
    getDeviceCount()
    return _strict.current_device()


def setDevice(index):
    _strict.set_current_device(check_device(int(index)))


def getDeviceProperties(index):
    """The properties bench step reads: the name (bytes, as CUDA gives it) and the memory."""
    check_device(int(index))
    return {"name": b"strict CuPy stand-in", "totalGlobalMem": memGetInfo()[1]}


def memGetInfo():
    getDeviceCount()
    total = int(os.environ.get("STRICT_CUPY_DEVICE_BYTES", str(80 << 30)))
    return total, total


def deviceSynchronize():
    getDeviceCount()
    _strict.log_event("device.synchronize", device=_strict.current_device())
    _strict.note("sync", "device.synchronize")


def deviceGetPCIBusId(index):
    """Distinct per index and the same in every process (env STRICT_CUPY_BUS_OFFSET shifts it),
    so ranks agree which physical GPU each one holds."""
    check_device(index)
    bus = _BUS_BASE + int(os.environ.get("STRICT_CUPY_BUS_OFFSET", "0")) + index
    return f"0000:{bus:02X}:00.0"


def deviceGetByPCIBusId(bus_id):
    for index in range(getDeviceCount()):
        if deviceGetPCIBusId(index).lower() == bus_id.lower():
            return index
    raise CUDARuntimeError(101)


def runtimeGetVersion():
    return 12080


def driverGetVersion():
    return 12080
