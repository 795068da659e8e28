"""cupy.cuda.Device stand-in, after CuPy's cupy/cuda/device.pyx: `Device()` is the current
device, `Device(i)` does not check i until it is used, `use()` makes it current for the calling
thread, `with Device(i):` switches temporarily, `synchronize()` waits for the device."""
from .. import _strict
from . import runtime


class Device:
    """A CUDA device by index; validated (CUDARuntimeError) when used, as CUDA does."""

    __hash__ = None     # Cython's __richcmp__ without __hash__: unhashable, as in CuPy

    def __init__(self, device=None):
        self.id = runtime.getDevice() if device is None else int(device)

    def __int__(self):
        return self.id

    def __repr__(self):
        return f"<CUDA Device {self.id}>"

    def __eq__(self, other):
        return isinstance(other, Device) and self.id == other.id

    def __ne__(self, other):
        return not self == other

    def use(self):
        runtime.setDevice(self.id)
        _strict.log_event("device.use", device=self.id)
        return self

    def __enter__(self):
        state = _strict.thread_state()
        stack = state.__dict__.setdefault("device_stack", [])
        stack.append(runtime.getDevice())
        runtime.setDevice(self.id)
        _strict.log_event("device.enter", device=self.id)
        return self

    def __exit__(self, *exc):
        runtime.setDevice(_strict.thread_state().device_stack.pop())
        _strict.log_event("device.exit", device=self.id)

    def synchronize(self):
        runtime.check_device(self.id)
        _strict.log_event("device.synchronize", device=self.id)
        _strict.note("sync", "device.synchronize")

    @property
    def pci_bus_id(self):
        return runtime.deviceGetPCIBusId(self.id)

    @classmethod
    def from_pci_bus_id(cls, pci_bus_id):
        return cls(runtime.deviceGetByPCIBusId(pci_bus_id))

    @property
    def compute_capability(self):
        runtime.check_device(self.id)
        return "90"

    @property
    def mem_info(self):
        runtime.check_device(self.id)
        return (80 << 30, 80 << 30)


def get_device_id():
    return runtime.getDevice()


def get_cublas_handle():
    """The current device's cuBLAS handle (an opaque integer; the stand-in's cuBLAS ignores it)."""
    return 0x1000 + runtime.getDevice()
