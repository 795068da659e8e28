"""The NCCL backend's host-side logic, with stand-ins for cupy.cuda.nccl and CUDA events (no CuPy,
GPU or MPI needed): communicator creation across CuPy's unique-id types, the events behind
StreamRequest, and when NCCL is usable at all."""
import sys
import types

import numpy
import pytest

from fakes.fake_cupy import FakeCupy

from npmegatron.comm import backends, runtime
from npmegatron.comm.group import Group


def fake_nccl(uid, log=None):
    """cupy.cuda.nccl whose get_unique_id returns `uid` and whose NcclCommunicator takes only
    that type back (CuPy 14: 128 bytes; before: a tuple of 128 ints)."""
    log = [] if log is None else log

    class NcclCommunicator:
        def __init__(self, ndev, commId, rank):
            assert type(ndev) is int and type(rank) is int
            assert type(commId) is type(uid) and len(commId) == 128
            self.args = (ndev, commId, rank)

        def send(self, *args):
            log.append("send")

        def recv(self, *args):
            log.append("recv")

    constants = {name: i for i, name in enumerate(
        ["NCCL_FLOAT16", "NCCL_FLOAT32", "NCCL_FLOAT64", "NCCL_INT32", "NCCL_INT64",
         "NCCL_SUM", "NCCL_MAX", "NCCL_MIN"])}
    return types.SimpleNamespace(get_unique_id=lambda: uid, NcclCommunicator=NcclCommunicator,
                                 groupStart=lambda: log.append("groupStart"),
                                 groupEnd=lambda: log.append("groupEnd"), **constants)


CUPY14_ID, CUPY13_ID = bytes(range(128)), tuple(range(-64, 64))


class PickleBcast:
    """A two-rank group's MPI communicator seen from rank 1: lowercase bcast hands over rank 0's
    object (pickled in MPI); the buffer-based Bcast is absent."""

    def __init__(self, root_object):
        self.root_object, self.calls = root_object, []

    def bcast(self, obj, root=0):
        self.calls.append((obj, root))
        return self.root_object


def two_rank_group(rank, mpi):
    group = Group.single("tp")
    group.rank, group.size, group.mpi = rank, 2, mpi
    return group


@pytest.mark.parametrize("uid", [CUPY14_ID, CUPY13_ID], ids=["cupy14-bytes", "cupy13-tuple"])
def test_one_rank_group_gets_a_communicator_without_mpi(uid):
    backend = backends.NCCLBackend(nccl=fake_nccl(uid))
    group = Group.single("tp")
    communicator = backend._comm(group)
    assert communicator.args == (1, uid, 0)
    assert backend._comm(group) is communicator         # created once per group


@pytest.mark.parametrize("uid", [CUPY14_ID, CUPY13_ID], ids=["cupy14-bytes", "cupy13-tuple"])
def test_rank_zero_id_reaches_the_others_unchanged(uid):
    mpi = PickleBcast(uid)
    communicator = backends.NCCLBackend(nccl=fake_nccl(uid))._comm(two_rank_group(1, mpi))
    assert communicator.args == (2, uid, 1)
    assert mpi.calls == [(None, 0)]


class FakeEvent:
    def __init__(self, log=None):
        self.done, self.synchronized, self.log = False, 0, log

    def synchronize(self):
        self.synchronized += 1
        self.done = True


def test_stream_request_reports_completion_from_its_event():
    event, x = FakeEvent(), numpy.ones(3)
    request = backends.StreamRequest(keep=x, event=event)
    assert request.test() is False and request.keep is x
    event.done = True
    assert request.test() is True and request.keep is None     # the send buffer can be freed


def test_stream_request_wait_synchronizes_its_event_only():
    event, out = FakeEvent(), numpy.zeros(2)
    assert backends.StreamRequest(result=out, event=event).wait() is out
    assert event.synchronized == 1


class DeviceArray:
    """What the NCCL backend reads of a CuPy array: a pointer, a size and a dtype."""

    def __init__(self, n):
        self.size, self.dtype, self.data = n, numpy.dtype(numpy.float32), types.SimpleNamespace(ptr=0)


def recording_backend(monkeypatch, log):
    backend = backends.NCCLBackend(nccl=fake_nccl(CUPY14_ID, log))

    def event():
        log.append("event")
        return FakeEvent()

    monkeypatch.setattr(backend, "_event", event)
    monkeypatch.setattr(backend, "_stream", lambda: 0)
    return backend


def test_each_send_outside_a_batch_records_its_event_after_the_call(monkeypatch):
    log = []
    backend = recording_backend(monkeypatch, log)
    request = backend.isend(Group.single("pp"), DeviceArray(4), 0, 0)
    assert log == ["send", "event"] and request.event is not None


def test_batched_requests_record_one_event_after_group_end(monkeypatch):
    """Inside an NCCL group call nothing is enqueued until groupEnd: an earlier event would
    complete before the transfers start."""
    log = []
    backend = recording_backend(monkeypatch, log)
    group = Group.single("pp")
    backend.start_batch()
    sent = backend.isend(group, DeviceArray(4), 0, 0)
    device_xp = types.SimpleNamespace(empty=lambda shape, dtype: DeviceArray(int(numpy.prod(shape))))
    received = backend.irecv(group, (4,), numpy.float32, device_xp, 0, 0)
    assert sent.event is None and received.event is None
    backend.end_batch()
    assert log == ["groupStart", "send", "recv", "groupEnd", "event"]
    assert sent.event is received.event is not None


def test_nccl_import_without_libnccl_is_not_usable():
    assert not backends.nccl_loaded(types.SimpleNamespace(available=False))
    assert backends.nccl_loaded(fake_nccl(CUPY14_ID))
    assert backends.nccl_loaded(types.SimpleNamespace(available=True, NcclCommunicator=object))


def test_one_gpu_per_rank_compares_physical_gpus():
    assert backends.one_gpu_per_rank([f"0000:{i:02X}:00.0" for i in range(8)])
    assert not backends.one_gpu_per_rank(["0000:1B:00.0", "0000:1B:00.0"])   # two ranks, one GPU
    assert not backends.one_gpu_per_rank(["0000:1B:00.0", None])              # a rank without one
    assert not backends.one_gpu_per_rank([])


@pytest.fixture
def cupy_with(monkeypatch):
    """Install a fake cupy whose cuda.nccl is the given module and whose local ranks report the
    given bus ids; nccl_usable's cache is cleared around the test."""
    def install(nccl, bus_ids):
        fake = FakeCupy(devices=1)
        fake.cuda.nccl = nccl
        monkeypatch.setitem(sys.modules, "cupy", fake)
        monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cuda)
        monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
        monkeypatch.setattr(runtime, "local_bus_ids", lambda: bus_ids)
        backends.nccl_usable.cache_clear()
    yield install
    backends.nccl_usable.cache_clear()


EIGHT_GPUS = [f"0000:{i + 0x10:02X}:00.0" for i in range(8)]


def test_eight_ranks_each_seeing_one_gpu_use_nccl(cupy_with):
    """getDeviceCount() is 1 on every rank, yet the eight GPUs are distinct."""
    cupy_with(fake_nccl(CUPY14_ID), EIGHT_GPUS)
    assert backends.nccl_usable()


def test_ranks_sharing_a_gpu_do_not_use_nccl(cupy_with):
    cupy_with(fake_nccl(CUPY14_ID), ["0000:10:00.0"] * 2)
    assert not backends.nccl_usable()


def test_cupy_without_libnccl_does_not_use_nccl(cupy_with):
    cupy_with(types.SimpleNamespace(available=False), EIGHT_GPUS)
    assert not backends.nccl_usable()
