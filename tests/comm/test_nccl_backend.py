"""The NCCL backend's host-side logic, with stand-ins for cupy.cuda.nccl and CUDA events (no CuPy,
GPU or MPI needed): communicator creation across CuPy's unique-id types, the events behind
StreamRequest, when NCCL is usable at all, and the all-to-all's group call of sends and receives."""
import sys
import types

import ml_dtypes
import numpy
import pytest

from fakes.fake_cupy import FakeCupy

from npmegatron.autograd.errors import InputError
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


class PointerArray(numpy.ndarray):
    """A host array with CuPy's `.data.ptr` (its address): what the all-to-all hands NCCL."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


class PeerRecorder:
    """A group's NCCL communicator recording (op, peer, element offset into `base`, count, datatype,
    stream) for each send and receive."""

    def __init__(self, log, buffers):
        self.log, self.buffers = log, buffers     # buffers: {"x": array, "out": array} once known

    def _where(self, ptr):
        for name, array in self.buffers.items():
            start = array.__array_interface__["data"][0]
            if start <= ptr < start + max(array.nbytes, 1):
                return name, (ptr - start) // array.itemsize
        raise AssertionError(f"pointer {ptr:#x} is in no known buffer")

    def send(self, ptr, count, datatype, peer, stream):
        self.log.append(("send", peer, *self._where(ptr), count, datatype, stream))

    def recv(self, ptr, count, datatype, peer, stream):
        self.log.append(("recv", peer, *self._where(ptr), count, datatype, stream))


def all_to_all_setup(monkeypatch, log, size=3, rank=1):
    """A recording NCCL backend and a `size`-rank group seen from `rank`, whose communicator is a
    PeerRecorder; received arrays are registered with it as "out"."""
    backend = recording_backend(log)
    group = group_of(size, rank)
    buffers = {}
    group.nccl, group.nccl_stream = PeerRecorder(log, buffers), backend.cuda.Stream()

    def empty(shape, dtype):
        buffers["out"] = numpy.empty(shape, dtype).view(PointerArray)
        return buffers["out"]
    monkeypatch.setattr(backends, "get_array_module", lambda x: types.SimpleNamespace(empty=empty))
    return backend, group, buffers


def group_of(size, rank):
    group = Group.single("ep")
    group.size, group.rank, group.ranks = size, rank, tuple(range(size))
    return group


def test_all_to_all_v_is_one_group_call_of_sends_and_receives_on_the_group_stream(monkeypatch):
    """Rank 1 of 3 sends 2 rows to rank 0, none to itself and 1 to rank 2, and receives none from
    rank 0, 3 from itself and 1 from rank 2, in rows of 4 elements: counts and offsets go to NCCL
    in elements, and a count of zero posts nothing."""
    log = []
    backend, group, buffers = all_to_all_setup(monkeypatch, log)
    x = buffers["x"] = numpy.arange(12, dtype=numpy.float32).reshape(3, 4).view(PointerArray)
    out = backend.all_to_all_v(group, x, numpy.array([2, 0, 1]), numpy.array([0, 3, 1]))
    assert out.shape == (4, 4) and out.dtype == numpy.float32
    stream, float32 = group.nccl_stream.ptr, backend.types[numpy.dtype(numpy.float32)]
    assert log == ["e0 on 0", f"{stream} waits e0", "groupStart",
                   ("send", 0, "x", 0, 8, float32, stream),
                   ("recv", 1, "out", 0, 12, float32, stream),
                   ("send", 2, "x", 8, 4, float32, stream), ("recv", 2, "out", 12, 4, float32, stream),
                   "groupEnd", f"e1 on {stream}", "0 waits e1"]


def test_all_to_all_sends_even_blocks_and_bfloat16_travels_as_float16(monkeypatch):
    log = []
    backend, group, buffers = all_to_all_setup(monkeypatch, log, size=2, rank=0)
    x = buffers["x"] = numpy.zeros((4, 3), ml_dtypes.bfloat16).view(PointerArray)
    out = backend.all_to_all(group, x)
    assert out.shape == (4, 3) and out.dtype == ml_dtypes.bfloat16
    float16, stream = backend.types[numpy.dtype(numpy.float16)], group.nccl_stream.ptr
    assert [entry for entry in log if isinstance(entry, tuple)] == [
        ("send", 0, "x", 0, 6, float16, stream), ("recv", 0, "out", 0, 6, float16, stream),
        ("send", 1, "x", 6, 6, float16, stream), ("recv", 1, "out", 6, 6, float16, stream)]


def test_all_to_all_of_nothing_posts_nothing_and_one_byte_types_are_refused(monkeypatch):
    log = []
    backend, group, buffers = all_to_all_setup(monkeypatch, log, size=2, rank=0)
    x = buffers["x"] = numpy.zeros((0, 3), numpy.float64).view(PointerArray)
    assert backend.all_to_all_v(group, x, numpy.zeros(2, int), numpy.zeros(2, int)).shape == (0, 3)
    assert not any(isinstance(entry, tuple) for entry in log)
    with pytest.raises(InputError, match="moves elements of 2, 4 or 8 bytes, and float8_e4m3fn has 1"):
        backend.all_to_all(group, numpy.zeros((2, 3), ml_dtypes.float8_e4m3fn).view(PointerArray))
