"""The real CuPy + NCCL, installed on a machine without a GPU (CI's GPU-plumbing step installs
cupy-cuda12x and nvidia-nccl-cu12): everything up to the first CUDA call is checked against the
library itself, not a stand-in. Skipped where CuPy is not installed.

- libnccl from the nvidia-nccl-cu12 wheel is found (`available`), so NCCL is not silently off;
- the unique id has the type NcclCommunicator takes back, and the backend's communicator
  creation fails only at CUDA (NcclError), never on an argument's type;
- every NCCL call the backend makes passes the arguments CuPy's signature lists, in its order;
- the stream and event constructors the backend uses accept its keywords;
- --device gpu without a driver is one sentence."""
import os
import re
import subprocess
import sys

import numpy
import pytest

cupy = pytest.importorskip("cupy")
if "strict_cupy" in (getattr(cupy, "__file__", "") or ""):
    pytest.skip("the strict stand-in, not CuPy, is on the path", allow_module_level=True)

from cupy.cuda import nccl  # noqa: E402

from helpers import ROOT  # noqa: E402
from npmegatron.autograd import InputError  # noqa: E402
from npmegatron.autograd.backend import array_module_for  # noqa: E402
from npmegatron.comm import backends  # noqa: E402
from npmegatron.comm.group import Group  # noqa: E402


def gpu_present():
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def test_libnccl_is_found_so_nccl_is_usable():
    assert backends.nccl_loaded(nccl), "cupy.cuda.nccl imported without libnccl: install nvidia-nccl-cu12"


def test_communicator_creation_reaches_cuda_with_the_right_argument_types():
    uid = nccl.get_unique_id()
    assert isinstance(uid, (bytes, tuple)) and len(uid) == 128
    with pytest.raises(TypeError):          # what the pre-fix code passed (an int8 array's tuple)
        nccl.NcclCommunicator(1, tuple(uid) if isinstance(uid, bytes) else bytes(8), 0)
    if gpu_present():
        pytest.skip("a GPU is present: tests/comm/test_comm_gpu.py covers the whole call")
    group = Group.single("tp")
    with pytest.raises(Exception) as error:
        backends.NCCLBackend()._comm(group)
    assert not isinstance(error.value, (TypeError, ValueError)), error.value
    assert type(error.value).__name__ in ("NcclError", "CUDARuntimeError"), repr(error.value)


def documented_arguments(method):
    """The argument names in a CuPy NCCL method's docstring signature, without self."""
    head = method.__doc__.splitlines()[0]
    inside = re.search(r"\((.*)\)", head).group(1)
    return [part.split()[-1] for part in inside.split(",")[1:]]


class Recorder:
    """A communicator that records the arguments of each call."""

    def __init__(self):
        self.calls = {}

    def __getattr__(self, name):
        return lambda *args: self.calls.setdefault(name, args)


class HostStream:
    ptr = 1234

    def wait_event(self, event):
        pass


class HostEvent:
    done = True

    def record(self, stream=None):
        pass


class HostCuda:
    """Streams and events without CUDA: only the NCCL arguments are under test here."""
    Stream = staticmethod(lambda non_blocking=False: HostStream())
    Event = staticmethod(lambda disable_timing=False: HostEvent())
    get_current_stream = staticmethod(HostStream)


class DeviceLike:
    def __init__(self, shape):
        self.shape, self.size, self.dtype = shape, int(numpy.prod(shape)), numpy.dtype("float32")
        self.data = type("Pointer", (), {"ptr": 4096})()

    def copy(self):
        return DeviceLike(self.shape)


def test_every_nccl_call_matches_cupys_signature(monkeypatch):
    backend = backends.NCCLBackend(nccl=nccl, cuda=HostCuda())
    recorder = Recorder()
    group = Group.single("dp")
    group.nccl, group.nccl_stream = recorder, HostStream()
    group.nccl_pairs = {(0, 1): (recorder, HostStream()), (1, 0): (recorder, HostStream())}
    module = type("xp", (), {"empty_like": staticmethod(lambda x: DeviceLike(x.shape)),
                             "empty": staticmethod(lambda shape, dtype: DeviceLike(shape))})
    monkeypatch.setattr(backends, "get_array_module", lambda x: module)
    x = DeviceLike((1, 6))
    backend.all_reduce(group, x, "sum")
    backend.all_gather(group, x)
    backend.reduce_scatter(group, x, "sum")
    backend.broadcast(group, x, 0)
    backend.isend(group, x, 1, 0)           # to a pipeline neighbour, on its pair communicator
    backend.irecv(group, (6,), numpy.float32, module, 1, 0)
    methods = {"allReduce": nccl.NcclCommunicator.allReduce, "allGather": nccl.NcclCommunicator.allGather,
               "reduceScatter": nccl.NcclCommunicator.reduceScatter, "bcast": nccl.NcclCommunicator.bcast,
               "send": nccl.NcclCommunicator.send, "recv": nccl.NcclCommunicator.recv}
    assert set(recorder.calls) == set(methods)
    for name, method in methods.items():
        names, args = documented_arguments(method), recorder.calls[name]
        assert len(args) == len(names), (name, names, args)
        assert all(type(a) is int for a in args), (name, args)     # pointers, counts, enums: ints
        assert args[-1] == HostStream.ptr, name                     # on the group's stream


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")   # CuPy's Stream.__del__
def test_stream_and_event_take_the_backends_keywords():
    for make in (lambda: cupy.cuda.Stream(non_blocking=True), lambda: cupy.cuda.Event(disable_timing=True)):
        try:
            make()
        except TypeError:
            raise
        except Exception as error:      # no driver: the keywords were accepted, CUDA was not
            assert type(error).__name__ == "CUDARuntimeError", repr(error)
    for name in ("wait_event", "synchronize", "use"):
        assert hasattr(cupy.cuda.Stream, name)
    for name in ("record", "done", "synchronize"):
        assert hasattr(cupy.cuda.Event, name)


@pytest.mark.skipif(gpu_present(), reason="a GPU is present")
def test_device_gpu_without_a_driver_is_one_sentence():
    with pytest.raises(InputError, match="device 'gpu' needs a CUDA driver and a visible GPU"):
        array_module_for("gpu")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--device", "gpu",
                          "--train-iters", "1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 1, run
    assert "Traceback" not in run.stderr and "device 'gpu' needs a CUDA driver" in run.stdout + run.stderr
