"""cupy.cuda.nccl stand-in with CuPy 14's API, carried out by MPI (mpi4py, imported only when a
communicator of two ranks or more is made).

CuPy 14 facts kept (cupy_backends/cuda/libs/nccl.pyx and nccl.pxd at v14.0.0):
* `get_unique_id()` returns 128 `bytes` (a tuple of ints before 14.0);
* `NcclCommunicator(int ndev, bytes commId, int rank)`: Cython argument types, so a tuple, a
  NumPy array or a float is a TypeError; a length other than 128 is a ValueError;
* collectives and point-to-point calls take raw pointers (intptr_t), element counts (size_t)
  and datatype / op codes: allReduce(sendbuf, recvbuf, count, datatype, op, stream),
  reduceScatter(sendbuf, recvbuf, recvcount, ...), allGather(sendbuf, recvbuf, count, ...)
  (counts per rank), bcast(buff, count, datatype, root, stream), send/recv(buf, count,
  datatype, peer, stream), groupStart()/groupEnd() (nestable);
* the constants' values (NCCL_SUM = 0 ... NCCL_FLOAT64 = 8, NCCL_BFLOAT16 = 9).

What NCCL does and the stand-in enforces:
* a communicator is made by the processes that pass the same id, at any time, in groups that
  are subsets of the world; two ranks on one GPU (same PCI bus id) are refused;
* buffers are read and written by pointer: each pointer must lie in a live cupy array on the
  communicator's device with room for `count` elements; when the pointer is the `.data.ptr` of
  an array, that array must be C-contiguous, of the datatype given, and hold >= count elements;
  out-of-place buffers must not overlap;
* sends and receives have no tags and match per pair in issue order (one MPI tag for all);
  outside a group call a send blocks until its receive is posted (MPI Ssend: no eager buffering
  hides a deadlock); inside groupStart()...groupEnd() nothing moves until the outermost
  groupEnd, which posts everything in issue order (collectives too) and waits for all;
* the stream given must be the null stream or a live cupy.cuda.Stream of the communicator's
  device.

Everything runs eagerly on the host, so stream order holds trivially; each call is logged
(cupy._strict.events("nccl.")) with its op, count, dtype, root/peer, stream ptr and whether it
was inside a group call.

The id's private format: a magic, then the creating process's MPI world rank, its pid and a
per-process counter. The creator acts as the rendezvous root, so it must be a member."""
import ctypes
import itertools
import operator
import os
import struct
import sys

import numpy

from .. import _core, _strict
from . import runtime
from .stream import finish, live_streams, pending

available = True
NCCL_UNIQUE_ID_BYTES = 128

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9

DTYPES = {0: numpy.dtype(numpy.int8), 1: numpy.dtype(numpy.uint8), 2: numpy.dtype(numpy.int32),
          3: numpy.dtype(numpy.uint32), 4: numpy.dtype(numpy.int64), 5: numpy.dtype(numpy.uint64),
          6: numpy.dtype(numpy.float16), 7: numpy.dtype(numpy.float32),
          8: numpy.dtype(numpy.float64), 9: None}
OPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
ERRORS = {1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR", 2: "NCCL_ERROR_SYSTEM_ERROR",
          3: "NCCL_ERROR_INTERNAL_ERROR", 4: "NCCL_ERROR_INVALID_ARGUMENT",
          5: "NCCL_ERROR_INVALID_USAGE", 6: "NCCL_ERROR_REMOTE_ERROR"}
INVALID_ARGUMENT, INVALID_USAGE = 4, 5

_MAGIC = b"STRICT-CUPY-NCCL"
_ID = struct.Struct("<16siiq")
_ids = itertools.count(1)
_P2P_TAG = 0x4E43
_RENDEZVOUS_TAGS = 1 << 20


class NcclError(RuntimeError):
    """cupy.cuda.nccl.NcclError(status): "NCCL_ERROR_...: detail"."""

    def __init__(self, status, detail=""):
        self.status = status
        super().__init__(f"{ERRORS.get(status, 'NCCL_ERROR')}: {detail}")

    def __reduce__(self):
        return (type(self), (self.status, str(self).split(": ", 1)[-1]))


def get_version():
    return 22105


def get_build_version():
    return 22105


# --- ids and rendezvous --------------------------------------------------------------------

def _mpi():
    from mpi4py import MPI
    return MPI


def _world_rank():
    """This process's MPI world rank, without initialising MPI when it is not yet."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank()
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def get_unique_id():
    """128 bytes naming a communicator-to-be; its creator will be the rendezvous root."""
    packed = _ID.pack(_MAGIC, _world_rank(), os.getpid(), next(_ids))
    return packed + bytes(NCCL_UNIQUE_ID_BYTES - len(packed))


def _parse_id(comm_id):
    magic, root, pid, serial = _ID.unpack_from(comm_id)
    if magic != _MAGIC:
        raise NcclError(INVALID_ARGUMENT, "commId was not made by this stand-in's get_unique_id")
    return root, pid, serial


def _integer(value, name):
    """Cython's `int`/`size_t` argument conversion: integers (and __index__ types) only."""
    if isinstance(value, (float, str, bytes)) or not hasattr(type(value), "__index__"):
        raise TypeError(f"an integer is required for {name!r}, got {type(value).__name__}")
    return operator.index(value)


def _rendezvous(comm_id, ndev, rank, bus_id):
    """The MPI communicator of the processes that passed this id, ordered by NCCL rank.

    Members tell the root (the id's creator) their NCCL rank, world rank and GPU over
    COMM_WORLD with a tag from the id; the root checks and answers with the member list; then
    the members (and only they) call COMM_WORLD.Create_group."""
    MPI = _mpi()
    world = MPI.COMM_WORLD
    root, pid, serial = _parse_id(comm_id)
    tag_ub = world.Get_attr(MPI.TAG_UB)
    tag = tag_ub - _RENDEZVOUS_TAGS + serial % (_RENDEZVOUS_TAGS - 1)
    me = world.Get_rank()
    if me != root:
        world.send((comm_id, ndev, rank, me, bus_id), dest=root, tag=tag)
        answer = world.recv(source=root, tag=tag)
        if isinstance(answer, str):
            raise NcclError(INVALID_ARGUMENT, answer)
        members = answer
    else:
        members = _gather_members(world, tag, comm_id, ndev, rank, me, bus_id)
    group = world.Get_group().Incl(members)
    try:
        return world.Create_group(group, tag=tag)
    finally:
        group.Free()


def _gather_members(world, tag, comm_id, ndev, rank, me, bus_id):
    """The root's side: collect ndev - 1 joins, check them, send everyone the member list."""
    joined = {rank: (me, bus_id)}
    problems, senders = [], []
    for _ in range(ndev - 1):
        their_id, their_ndev, their_rank, world_rank, their_bus = world.recv(source=_mpi().ANY_SOURCE, tag=tag)
        senders.append(world_rank)
        if their_id != comm_id:
            problems.append(f"world rank {world_rank} joined with another id on the same tag")
        elif their_ndev != ndev:
            problems.append(f"world rank {world_rank} says ndev={their_ndev}, the root says {ndev}")
        elif their_rank in joined or not 0 <= their_rank < ndev:
            problems.append(f"world rank {world_rank} took NCCL rank {their_rank} (taken or out of range)")
        else:
            joined[their_rank] = (world_rank, their_bus)
    buses = [bus for _, bus in joined.values()]
    if len(set(buses)) != len(buses):
        problems.append(f"Duplicate GPU detected: two ranks on one device (bus ids {sorted(buses)})")
    answer = "; ".join(problems) or [joined[r][0] for r in range(ndev)]
    for world_rank in senders:
        world.send(answer, dest=world_rank, tag=tag)
    if problems:
        raise NcclError(INVALID_ARGUMENT if "Duplicate" not in answer else INVALID_USAGE, answer)
    return answer


# --- buffers -------------------------------------------------------------------------------

class _Buffer:
    """A validated (ptr, count, dtype) range: `host()` is a uint8 NumPy view of its bytes."""

    def __init__(self, ptr, count, dtype, itemsize):
        self.ptr, self.count, self.dtype, self.nbytes = ptr, count, dtype, count * itemsize

    def host(self):
        if not self.nbytes:
            return numpy.empty(0, numpy.uint8)
        if _core.find_buffer(self.ptr, self.nbytes) is None:
            raise NcclError(INVALID_ARGUMENT, f"buffer {self.ptr:#x} was freed before NCCL used it")
        return numpy.frombuffer((ctypes.c_ubyte * self.nbytes).from_address(self.ptr), numpy.uint8)

    def typed(self):
        return self.host().view(self.dtype or numpy.uint16)

    def overlaps(self, other):
        return self.ptr < other.ptr + other.nbytes and other.ptr < self.ptr + self.nbytes


def _datatype(datatype):
    datatype = _integer(datatype, "datatype")
    if datatype not in DTYPES:
        raise NcclError(INVALID_ARGUMENT, f"unknown datatype {datatype}")
    return datatype, DTYPES[datatype], 2 if DTYPES[datatype] is None else DTYPES[datatype].itemsize


# --- the communicator ----------------------------------------------------------------------

class NcclCommunicator:
    """One rank of an NCCL communicator, bound to the device current when it was made."""

    def __init__(self, ndev, commId, rank, config=None):
        ndev, rank = _integer(ndev, "ndev"), _integer(rank, "rank")
        if type(commId) is not bytes:
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                            f"{type(commId).__name__})")
        if len(commId) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"commId length {len(commId)} != {NCCL_UNIQUE_ID_BYTES}.")
        if not 0 <= rank < ndev:
            raise NcclError(INVALID_ARGUMENT, f"rank {rank} out of range for {ndev} ranks")
        root, pid, serial = _parse_id(commId)
        self._device = runtime.getDevice()
        self._rank, self._size = rank, ndev
        self._label = f"{root}:{pid}:{serial}"
        bus = runtime.deviceGetPCIBusId(self._device)
        self._mpi = _rendezvous(commId, ndev, rank, bus) if ndev > 1 else None
        self._alive = True
        _strict.log_event("nccl.init", comm=self._label, rank=rank, size=ndev, device=self._device)

    # -- plain queries --
    def rank_id(self):
        self._check_alive()
        return self._rank

    def size(self):
        self._check_alive()
        return self._size

    def device_id(self):
        self._check_alive()
        return self._device

    def destroy(self):
        self._alive = False

    abort = destroy

    def check_async_error(self):
        self._check_alive()

    @staticmethod
    def initAll(devices):
        raise NotImplementedError("the strict stand-in makes one communicator per process only")

    def _check_alive(self):
        if not self._alive:
            raise NcclError(INVALID_ARGUMENT, "communicator destroyed")

    # -- argument checks --
    def _buffer(self, ptr, count, dtype_info, what):
        """Validate a device pointer for `count` elements of the given datatype."""
        datatype, dtype, itemsize = dtype_info
        ptr, count = _integer(ptr, what), _integer(count, "count")
        if count < 0:
            raise OverflowError("can't convert negative value to size_t")
        buf = _Buffer(ptr, count, dtype, itemsize)
        if count == 0:
            return buf
        entry = _core.find_buffer(ptr, buf.nbytes)
        if entry is None:
            raise NcclError(INVALID_ARGUMENT, f"{what} {ptr:#x}: not inside a live cupy array with "
                                              f"room for {count} elements of {dtype}")
        if entry.device != self._device:
            raise NcclError(INVALID_ARGUMENT, f"{what} is on device {entry.device}, the "
                                              f"communicator on device {self._device}")
        record = _core.view_records.get(ptr)
        if record is not None and record[0]() is not None:
            _, array_dtype, size, contiguous = record
            if not contiguous:
                raise NcclError(INVALID_ARGUMENT, f"{what} is the .data.ptr of a non-contiguous "
                                                  f"array: NCCL would read the wrong elements")
            if (dtype is not None and array_dtype != dtype) or array_dtype.itemsize != itemsize:
                raise NcclError(INVALID_ARGUMENT, f"{what} is a {array_dtype} array, the datatype "
                                                  f"given is {dtype or 'bfloat16'}")
            if count > size:
                raise NcclError(INVALID_ARGUMENT, f"{what}: count {count} > the {size} elements "
                                                  f"of the array behind the pointer")
        return buf

    def _stream(self, stream):
        stream = _integer(stream, "stream")
        known = live_streams.get(stream)
        if stream != 0 and known is None:
            raise runtime.CUDARuntimeError(400)
        if known is not None and known.device_id not in (-1, self._device):
            raise runtime.CUDARuntimeError(400)
        return stream

    def _peer(self, peer, what):
        peer = _integer(peer, what)
        if not 0 <= peer < self._size:
            raise NcclError(INVALID_ARGUMENT, f"{what} {peer} out of range for {self._size} ranks")
        return peer

    def _op(self, op):
        op = _integer(op, "op")
        if op not in OPS:
            raise NcclError(INVALID_ARGUMENT, f"unknown reduction op {op}")
        return OPS[op]

    def _submit(self, name, run, buf=None, moved=(0, 0), **fields):
        """Log the call and run it now, or at the outermost groupEnd inside a group call
        (`buf`: the buffer a send/recv moves, which the group posts itself; `moved`: the bytes
        it reads from its send buffer and writes to its receive buffer on this rank)."""
        self._check_alive()
        queue = _group_queue()
        if _strict.capturing() and (queue is not None or name in ("send", "recv")):
            raise _strict.StreamCaptureError(f"nccl {name} {'inside a group call ' if queue is not None else ''}while "
                                             "a stream captures: the stand-in captures collectives only")
        _strict.log_event(f"nccl.{name}", comm=self._label, rank=self._rank,
                          grouped=queue is not None, **fields)
        _strict.launch("nccl", name, read=moved[:1], written=moved[1:], stream=fields.get("stream"))
        if queue is not None:
            queue.append((self, name, run, buf, fields))
        elif name in ("send", "recv") and fields["stream"] != 0 and self._mpi is not None:
            _start(self, name, buf, fields)     # runs on its stream, as on a GPU
        else:
            finish(list(pending.get(fields.get("stream"), ())))    # stream order
            run()

    # -- collectives --
    @_strict.device_work
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        dt = _datatype(datatype)
        send = self._buffer(sendbuf, count, dt, "sendbuf")
        recv = self._buffer(recvbuf, count, dt, "recvbuf")
        _refuse_overlap(send, recv, in_place=send.ptr == recv.ptr)
        how = self._op(op)
        self._submit("allReduce", lambda: self._reduce_to(recv, self._gather(send), how),
                     moved=(send.nbytes, recv.nbytes), count=count, dtype=_name(dt), op=how, stream=self._stream(stream),
                     sendbuf=send.ptr, recvbuf=recv.ptr)

    @_strict.device_work
    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        dt = _datatype(datatype)
        send = self._buffer(sendbuf, _integer(recvcount, "recvcount") * self._size, dt, "sendbuf")
        recv = self._buffer(recvbuf, recvcount, dt, "recvbuf")
        _refuse_overlap(send, recv, in_place=recv.ptr == send.ptr + self._rank * recv.nbytes)
        how = self._op(op)
        self._submit("reduceScatter", lambda: self._reduce_to(recv, self._alltoall(send), how),
                     moved=(send.nbytes, recv.nbytes), count=recvcount, dtype=_name(dt), op=how, stream=self._stream(stream),
                     sendbuf=send.ptr, recvbuf=recv.ptr)

    @_strict.device_work
    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        dt = _datatype(datatype)
        send = self._buffer(sendbuf, count, dt, "sendbuf")
        recv = self._buffer(recvbuf, _integer(count, "count") * self._size, dt, "recvbuf")
        _refuse_overlap(send, recv, in_place=send.ptr == recv.ptr + self._rank * send.nbytes)
        self._submit("allGather", lambda: _copy(recv.host(), self._gather(send)),
                     moved=(send.nbytes, recv.nbytes), count=count, dtype=_name(dt), stream=self._stream(stream),
                     sendbuf=send.ptr, recvbuf=recv.ptr)

    @_strict.device_work
    def bcast(self, buff, count, datatype, root, stream):
        dt = _datatype(datatype)
        buf = self._buffer(buff, count, dt, "buff")
        root = self._peer(root, "root")
        self._submit("bcast", lambda: self._bcast(buf, root), count=count, dtype=_name(dt),
                     moved=(buf.nbytes, 0) if self._rank == root else (0, buf.nbytes),
                     root=root, stream=self._stream(stream), buff=buf.ptr)

    @_strict.device_work
    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        dt = _datatype(datatype)
        root = self._peer(root, "root")
        send = self._buffer(sendbuff, count, dt, "sendbuff") if self._rank == root else None
        recv = self._buffer(recvbuff, count, dt, "recvbuff")

        def run():
            if send is not None and send.ptr != recv.ptr:
                recv.host()[...] = send.host()
            self._bcast(recv, root)
        self._submit("broadcast", run, count=count, dtype=_name(dt), root=root,
                     moved=(send.nbytes, 0 if send.ptr == recv.ptr else recv.nbytes) if send is not None
                     else (0, recv.nbytes),
                     stream=self._stream(stream), recvbuff=recv.ptr)

    @_strict.device_work
    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        dt = _datatype(datatype)
        root = self._peer(root, "root")
        send = self._buffer(sendbuf, count, dt, "sendbuf")
        recv = self._buffer(recvbuf, count, dt, "recvbuf") if self._rank == root else None
        how = self._op(op)

        def run():
            gathered = self._gather(send)
            if recv is not None:
                self._reduce_to(recv, gathered, how)
        self._submit("reduce", run, count=count, dtype=_name(dt), op=how, root=root,
                     moved=(send.nbytes, 0 if recv is None else recv.nbytes),
                     stream=self._stream(stream))

    # -- point to point --
    def send(self, sendbuf, count, datatype, peer, stream):
        dt = _datatype(datatype)
        buf = self._buffer(sendbuf, count, dt, "sendbuf")
        peer = self._peer(peer, "peer")
        self._submit("send", lambda: self._send_now(buf, peer), buf, moved=(buf.nbytes, 0), count=count,
                     dtype=_name(dt), peer=peer, stream=self._stream(stream), sendbuf=buf.ptr)

    def recv(self, recvbuf, count, datatype, peer, stream):
        dt = _datatype(datatype)
        buf = self._buffer(recvbuf, count, dt, "recvbuf")
        peer = self._peer(peer, "peer")
        self._submit("recv", lambda: self._recv_now(buf, peer), buf, moved=(0, buf.nbytes), count=count,
                     dtype=_name(dt), peer=peer, stream=self._stream(stream), recvbuf=buf.ptr)

    def _send_now(self, buf, peer):
        """Outside a group call: synchronous, so an unmatched send blocks as NCCL's does."""
        if self._mpi is None:
            raise NcclError(INVALID_USAGE, "send to itself outside a group call would hang")
        self._mpi.Ssend(buf.host(), dest=peer, tag=_P2P_TAG)

    def _recv_now(self, buf, peer):
        if self._mpi is None:
            raise NcclError(INVALID_USAGE, "recv from itself outside a group call would hang")
        status = _mpi().Status()
        self._mpi.Recv(buf.host(), source=peer, tag=_P2P_TAG, status=status)
        _check_count(status, buf, peer)

    # -- the data movement, on uint8 views --
    def _gather(self, send):
        """(size, count) typed array of every rank's send buffer (copied first: in place ok)."""
        mine = send.host().copy()
        out = numpy.empty(self._size * send.nbytes, numpy.uint8)
        if self._mpi is None:
            out[...] = mine
        else:
            self._mpi.Allgather(mine, out)
        return out.view(send.dtype or numpy.uint16).reshape(self._size, send.count)

    def _alltoall(self, send):
        """(size, count/size): block r of every rank's send buffer, at rank r."""
        mine = send.host().copy()
        out = numpy.empty_like(mine)
        if self._mpi is None:
            out[...] = mine
        else:
            self._mpi.Alltoall(mine, out)
        return out.view(send.dtype or numpy.uint16).reshape(self._size, -1)

    def _reduce_to(self, recv, gathered, how):
        if recv.dtype is None:
            raise NotImplementedError("bfloat16 reductions are not emulated")
        with numpy.errstate(all="ignore"):
            if how == "sum":
                result = gathered.sum(axis=0, dtype=recv.dtype)
            elif how == "prod":
                result = gathered.prod(axis=0, dtype=recv.dtype)
            elif how == "max":
                result = gathered.max(axis=0)
            elif how == "min":
                result = gathered.min(axis=0)
            else:
                result = gathered.sum(axis=0, dtype=recv.dtype) / self._size
        recv.typed()[...] = result.astype(recv.dtype, copy=False)

    def _bcast(self, buf, root):
        if self._mpi is not None:
            data = buf.host()
            self._mpi.Bcast(data, root=root)


def _name(dt):
    return "bfloat16" if dt[1] is None else dt[1].name


def _copy(dst, src):
    dst[...] = src.reshape(-1).view(numpy.uint8)


def _refuse_overlap(send, recv, in_place):
    """NCCL defines out-of-place (disjoint) and in-place (send at its slot of recv) only."""
    if send.nbytes and recv.nbytes and send.overlaps(recv) and not in_place:
        raise NcclError(INVALID_ARGUMENT, "send and receive buffers overlap without being in place")


def _check_count(status, buf, peer):
    got = status.Get_count(_mpi().BYTE)
    if got != buf.nbytes:
        raise NcclError(INVALID_USAGE, f"recv of {buf.nbytes} bytes matched a send of {got} bytes "
                                       f"from peer {peer}: NCCL needs equal counts")


# --- group calls ---------------------------------------------------------------------------

def _group_queue():
    """The calls queued by the current group call of this thread, or None outside one."""
    state = _strict.thread_state()
    return state.nccl_queue if getattr(state, "nccl_depth", 0) else None


def groupStart():
    state = _strict.thread_state()
    state.nccl_depth = getattr(state, "nccl_depth", 0) + 1
    if state.nccl_depth == 1:
        state.nccl_queue = []
    _strict.log_event("nccl.groupStart", depth=state.nccl_depth)


def groupEnd():
    state = _strict.thread_state()
    if not getattr(state, "nccl_depth", 0):
        raise NcclError(INVALID_USAGE, "groupEnd without groupStart")
    _strict.log_event("nccl.groupEnd", depth=state.nccl_depth)
    state.nccl_depth -= 1
    if state.nccl_depth == 0:
        queue, state.nccl_queue = state.nccl_queue, None
        _run_group(queue)


class Transfer:
    """A send or receive started on a stream: finished when something waits for it (stream.py)."""

    def __init__(self, request, buf, peer, receive):
        self.request, self.buf, self.peer, self.receive = request, buf, peer, receive
        self.status, self.finished = _mpi().Status(), False

    def test(self):
        if not self.finished and self.request.Test(self.status):
            self._done()
        return self.finished

    def wait(self):
        if not self.finished:
            self.request.Wait(self.status)
            self._done()

    def _done(self):
        self.finished = True
        if self.receive:
            _check_count(self.status, self.buf, self.peer)


def _start(comm, name, buf, fields):
    """Start a send/recv on its (non-null) stream: non-blocking, in issue order (one tag)."""
    if name == "send":
        request = comm._mpi.Issend(buf.host(), dest=fields["peer"], tag=_P2P_TAG)
    else:
        request = comm._mpi.Irecv(buf.host(), source=fields["peer"], tag=_P2P_TAG)
    pending.setdefault(fields["stream"], []).append(Transfer(request, buf, fields["peer"], name == "recv"))


def _run_group(queue):
    """Post every queued send/recv non-blocking in issue order, run the collectives in order,
    then wait for the transfers on the null stream (NCCL starts the whole group at once);
    those on another stream finish when something waits for them, as on a GPU."""
    requests, receives, self_sends = [], [], {}
    for comm, name, run, buf, fields in queue:
        if name not in ("send", "recv"):
            continue
        if comm._mpi is None:
            _pair_with_self(comm, name, buf, self_sends)
        elif fields["stream"] != 0:
            _start(comm, name, buf, fields)
        elif name == "send":
            requests.append(comm._mpi.Issend(buf.host(), dest=fields["peer"], tag=_P2P_TAG))
        else:
            requests.append(comm._mpi.Irecv(buf.host(), source=fields["peer"], tag=_P2P_TAG))
            receives.append((len(requests) - 1, buf, fields["peer"]))
    leftover = [b for bufs in self_sends.values() for b in bufs]
    if leftover:
        raise NcclError(INVALID_USAGE, "a send to itself without its matching recv in the group")
    for comm, name, run, buf, fields in queue:
        if name not in ("send", "recv"):
            finish(list(pending.get(fields.get("stream"), ())))
            run()
    if requests:
        MPI = _mpi()
        statuses = [MPI.Status() for _ in requests]
        MPI.Request.Waitall(requests, statuses)
        for i, buf, peer in receives:
            _check_count(statuses[i], buf, peer)


def _pair_with_self(comm, name, buf, pending):
    """A one-rank communicator's send/recv to itself: matched in order inside the group."""
    sends = pending.setdefault(id(comm), [])
    if name == "send":
        sends.append(buf.host().copy())
        return
    if not sends:
        raise NcclError(INVALID_USAGE, "recv from itself before the matching send in the group")
    data = sends.pop(0)
    if data.size != buf.nbytes:
        raise NcclError(INVALID_USAGE, "send/recv to itself with different counts")
    buf.host()[...] = data
