"""The NCCL backend's host-side logic, with stand-ins for cupy.cuda.nccl and CUDA events (no CuPy,
GPU or MPI needed): communicator creation across CuPy's unique-id types, the events behind
StreamRequest, and when NCCL is usable at all."""
import sys
import types

import numpy
import pytest

from fakes.fake_cupy import FakeCupy

from npmegatron.comm import backends
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
            log.append(f"send on {args[-1]}")

        def recv(self, *args):
            log.append(f"recv on {args[-1]}")

        def allReduce(self, *args):
            log.append(f"allReduce on {args[-1]}")

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
    backend = backends.NCCLBackend(nccl=fake_nccl(uid), cuda=fake_cuda([]))
    group = Group.single("tp")
    communicator = backend._comm(group)
    assert communicator.args == (1, uid, 0)
    assert backend._comm(group) is communicator         # created once per group


@pytest.mark.parametrize("uid", [CUPY14_ID, CUPY13_ID], ids=["cupy14-bytes", "cupy13-tuple"])
def test_rank_zero_id_reaches_the_others_unchanged(uid):
    mpi = PickleBcast(uid)
    communicator = backends.NCCLBackend(nccl=fake_nccl(uid), cuda=fake_cuda([]))._comm(two_rank_group(1, mpi))
    assert communicator.args == (2, uid, 1)
    assert mpi.calls == [(None, 0)]


class FakeEvent:
    def __init__(self, name="e", log=None):
        self.name, self.done, self.synchronized, self.log = name, False, 0, log

    def record(self, stream):
        self.log.append(f"{self.name} on {stream.ptr}")

    def synchronize(self):
        self.synchronized += 1
        self.done = True


def fake_cuda(log):
    """cupy.cuda's streams and events, recording: 'eN on S' (event N recorded on stream S),
    'S waits eN'. The compute (current) stream is 0; each new stream gets the next number."""
    streams, events = [], []

    class Stream:
        def __init__(self, non_blocking=False):
            streams.append(self)
            self.ptr = len(streams) - 1

        def wait_event(self, event):
            log.append(f"{self.ptr} waits {event.name}")

    compute = Stream()

    def event(disable_timing=False):
        events.append(FakeEvent(f"e{len(events)}", log))
        return events[-1]

    return types.SimpleNamespace(Stream=Stream, Event=event, get_current_stream=lambda: compute,
                                 events=events)


def test_stream_request_reports_completion_from_its_event():
    event, x = FakeEvent(), numpy.ones(3)
    request = backends.StreamRequest(keep=x, event=event)
    assert request.test() is False and request.keep is x
    event.done = True
    assert request.test() is True and request.keep is None     # the send buffer can be freed


class DeviceArray:
    """What the NCCL backend reads of a CuPy array: a pointer, a size and a dtype."""

    def __init__(self, n):
        self.size, self.dtype, self.data = n, numpy.dtype(numpy.float32), types.SimpleNamespace(ptr=0)


def recording_backend(log):
    return backends.NCCLBackend(nccl=fake_nccl(CUPY14_ID, log), cuda=fake_cuda(log))


class PairMPI:
    """A two-rank group's MPI communicator seen from rank 0: pair ids go out by send and come
    in by recv (rank 1's id for the 1 -> 0 direction)."""

    def __init__(self, log):
        self.log = log

    def send(self, obj, dest, tag):
        self.log.append(f"mpi send id to {dest}")

    def recv(self, source, tag):
        self.log.append(f"mpi recv id from {source}")
        return CUPY14_ID


def pipeline_pair(log):
    return two_rank_group(0, PairMPI(log))


def test_each_direction_has_its_own_communicator_and_stream():
    """Defect 4 under NCCL: a receive waiting on the stream that also carries this rank's sends
    held them back (PP = 2, interleaved: both neighbours waited for each other)."""
    log = []
    backend = recording_backend(log)
    group = pipeline_pair(log)
    sent = backend.isend(group, DeviceArray(4), 1, 0)
    # Pairs made in one order on both ranks: 0 -> 1 (this rank sends the id), then 1 -> 0.
    assert log[:2] == ["mpi send id to 1", "mpi recv id from 1"]
    (to_next, send_stream), (from_next, recv_stream) = group.nccl_pairs[0, 1], group.nccl_pairs[1, 0]
    assert to_next.args == (2, CUPY14_ID, 0) and from_next.args == (2, CUPY14_ID, 1)
    assert send_stream.ptr != recv_stream.ptr
    assert log[2:] == ["e0 on 0", f"{send_stream.ptr} waits e0", f"send on {send_stream.ptr}",
                       f"e1 on {send_stream.ptr}"]
    device_xp = types.SimpleNamespace(empty=lambda shape, dtype: DeviceArray(int(numpy.prod(shape))))
    log.clear()
    received = backend.irecv(group, (4,), numpy.float32, device_xp, 1, 0)
    assert log == ["e2 on 0", f"{recv_stream.ptr} waits e2", f"recv on {recv_stream.ptr}",
                   f"e3 on {recv_stream.ptr}"]
    assert sent.event.name == "e1" and received.event.name == "e3"


def test_wait_orders_the_compute_stream_after_the_transfer_without_a_host_sync():
    """Defect 8: every wait() synchronised the whole stream from the host."""
    log = []
    backend = recording_backend(log)
    request = backend.isend(pipeline_pair(log), DeviceArray(4), 1, 0)
    event = request.event
    log.clear()
    request.wait()
    assert log == [f"0 waits {event.name}"] and event.synchronized == 0
    assert request.keep is None


def test_point_to_point_needs_no_group_call():
    log = []
    backend = recording_backend(log)
    backend.start_batch()
    backend.end_batch()
    assert log == []


def test_groups_get_streams_of_their_own_so_tp_does_not_queue_behind_dp(monkeypatch):
    log = []
    backend = recording_backend(log)
    device_xp = types.SimpleNamespace(empty_like=lambda x: DeviceArray(x.size))
    monkeypatch.setattr(backends, "get_array_module", lambda x: device_xp)
    dp, tp = Group.single("dp"), Group.single("tp")
    bucket = backend.iall_reduce(dp, DeviceArray(8), "sum")
    log.clear()
    backend.all_reduce(tp, DeviceArray(4), "sum")
    # TP's all-reduce goes on stream 2 (DP's is 1); compute waits for TP's end only.
    assert log == ["e2 on 0", "2 waits e2", "allReduce on 2", "e3 on 2", "0 waits e3"]
    assert not any(entry.startswith("0 waits") and bucket.event.name in entry for entry in log)


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
        monkeypatch.setattr(backends, "_local_bus_ids", list(bus_ids))
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
