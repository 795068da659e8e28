"""Two backends behind one interface: MPI (mpi4py, host buffers) and NCCL (CuPy, GPU buffers).

Both take contiguous arrays in the canonical layout chosen by collectives.py (gather and scatter
blocks stacked on axis 0) and return new arrays. The backend follows where the array lives:
NumPy goes through MPI; CuPy goes through NCCL when every local rank has a GPU of its own, else
through MPI staged in host memory (NCCL refuses two ranks on one GPU).
"""
import functools
import math
import os

import numpy

from npmegatron.autograd.backend import get_array_module, to_numpy
from npmegatron.autograd.errors import InputError

from . import shared_memory
from .streams import EventClock, StreamRequest


_PAIR_ID_TAG = 0x7A11    # the MPI tag carrying a pair communicator's NCCL id (NCCLBackend._pair)


def _mpi():
    from mpi4py import MPI
    return MPI


class MPIBackend:
    name = "mpi"

    @staticmethod
    def clock():
        """None: the host's clock times MPI calls (the host waits for them)."""
        return None

    @staticmethod
    def _ops():
        MPI = _mpi()
        return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    @staticmethod
    def _host(x):
        return x if isinstance(x, numpy.ndarray) else to_numpy(x)

    @staticmethod
    def _like(x, host):
        """Back to where x lives (a no-op for NumPy)."""
        xp = get_array_module(x)
        return host if xp is numpy else xp.asarray(host)

    def all_reduce(self, group, x, op):
        host = self._host(x)
        channel = shared_memory.channel_for(group, host)
        if channel is not None:
            return self._like(x, channel.all_reduce(host, op))
        out = numpy.empty_like(host)
        group.mpi.Allreduce(host, out, op=self._ops()[op])
        return self._like(x, out)

    def all_gather(self, group, x):
        host = self._host(x)
        out = numpy.empty((group.size,) + host.shape, host.dtype)
        group.mpi.Allgather(host, out)
        return self._like(x, out)

    def reduce_scatter(self, group, x, op):
        host = self._host(x)
        out = numpy.empty(host.shape[1:], host.dtype)
        group.mpi.Reduce_scatter_block(host, out, op=self._ops()[op])
        return self._like(x, out)

    def iall_reduce(self, group, x, op):
        """Non-blocking, in place on host arrays (GPU arrays are staged through host memory)."""
        host = self._host(x)
        channel = shared_memory.channel_for(group, host)
        if channel is not None:
            request = shared_memory.SharedMemoryRequest(channel, host, op)
        else:
            request = group.mpi.Iallreduce(_mpi().IN_PLACE, host, op=self._ops()[op])
        return MPIRequest(request, result=host, xp=get_array_module(x))

    def ireduce_scatter(self, group, x, op):
        """Non-blocking; x is kept until the request completes (GPU arrays staged through host)."""
        host = self._host(x)
        out = numpy.empty(host.size // group.size, host.dtype)
        request = group.mpi.Ireduce_scatter_block(host, out, op=self._ops()[op])
        return MPIRequest(request, result=out, keep=host, xp=get_array_module(x))

    def all_to_all(self, group, x):
        host = self._host(x)
        out = numpy.empty_like(host)
        group.mpi.Alltoall(_bits(host), _bits(out))
        return self._like(x, out)

    def all_to_all_v(self, group, x, send_counts, recv_counts):
        """Rows are counted in elements of the flat buffers (rows × row size), as MPI counts."""
        host = self._host(x)
        out = numpy.empty((int(recv_counts.sum()),) + host.shape[1:], host.dtype)
        row = math.prod(host.shape[1:])
        group.mpi.Alltoallv(_vector(host, send_counts * row), _vector(out, recv_counts * row))
        return self._like(x, out)

    def broadcast(self, group, x, root):
        host = numpy.array(self._host(x), copy=True)
        group.mpi.Bcast(host, root=root)
        return self._like(x, host)

    def isend(self, group, x, peer, tag):
        host = self._host(x)
        return MPIRequest(group.mpi.Isend(host, dest=peer, tag=_mpi_tag(tag)), keep=host)

    def irecv(self, group, shape, dtype, xp, peer, tag):
        host = numpy.empty(shape, dtype)
        return MPIRequest(group.mpi.Irecv(host, source=peer, tag=_mpi_tag(tag)), result=host, xp=xp)

    def start_batch(self):
        pass

    def end_batch(self):
        pass


def _bits(host):
    """host, or where MPI has no type for its dtype (ml_dtypes' bfloat16, float8) the same bytes
    as unsigned integers: the calls that use this move values and compute none."""
    return host.view(f"u{host.dtype.itemsize}") if host.dtype.kind == "V" else host


def _spans(counts):
    """(offset, count) of each rank's consecutive part of a flat buffer, counts in rank order."""
    return list(zip((numpy.cumsum(counts) - counts).tolist(), counts.tolist()))


def _vector(host, counts):
    """mpi4py's [flat buffer, (counts, displacements)] for Alltoallv (datatype from the array)."""
    return [_bits(host).reshape(-1), (counts, numpy.cumsum(counts) - counts)]


def p2p_ordered():
    """NPMEGATRON_P2P_ORDERED=1: point-to-point messages ignore their tags and match in the order
    they are posted, as NCCL's do (NCCL has no tags). Run on the CPU, this proves that the
    callers (the pipeline) post every pair's receives in the order the sender sends."""
    return os.environ.get("NPMEGATRON_P2P_ORDERED", "0") not in ("", "0")


def _mpi_tag(tag):
    return 0 if p2p_ordered() else tag


class MPIRequest:
    def __init__(self, request, result=None, keep=None, xp=numpy):
        self.request, self.result, self.keep, self.xp = request, result, keep, xp

    def test(self):
        """Drive MPI's progress engine; true once complete."""
        return self.request.Test()

    def wait(self):
        self.request.Wait()
        self.keep = None
        if self.result is None or self.xp is numpy:
            return self.result
        return self.xp.asarray(self.result)


class NCCLBackend:
    """cupy.cuda.nccl: one communicator per group, its unique id broadcast over the group's MPI
    communicator; point-to-point on one-way pair communicators (see _pair).

    Each group's NCCL calls run on a stream of their own, ordered against compute by events and
    never by a host synchronisation: a call starts once the compute stream's work so far is done
    (the input is written), and the compute stream waits for its end only where the result is
    used. So a data-parallel bucket all-reduce runs while backward goes on, and a tensor-parallel
    all-reduce does not queue behind it."""

    name = "nccl"

    def __init__(self, nccl=None, cuda=None):
        """nccl, cuda: cupy.cuda.nccl and cupy.cuda by default; tests pass stand-ins."""
        if nccl is None:
            from cupy.cuda import nccl
        if cuda is None:
            import cupy.cuda as cuda
        self.nccl, self.cuda = nccl, cuda
        self.types = {numpy.dtype(k): v for k, v in (
            ("float16", nccl.NCCL_FLOAT16), ("float32", nccl.NCCL_FLOAT32),
            ("float64", nccl.NCCL_FLOAT64), ("int32", nccl.NCCL_INT32), ("int64", nccl.NCCL_INT64))}
        self.ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}

    def _comm(self, group):
        """The group's communicator and stream, created on first use. Rank 0's unique id travels
        as the very object get_unique_id returned (pickled): a tuple of ints before CuPy 14, 128
        bytes since, and NcclCommunicator takes the same type back, so no conversion can go stale."""
        if group.nccl is None:
            uid = self.nccl.get_unique_id() if group.rank == 0 else None
            if group.size > 1:          # a one-rank group (Group.single) has no MPI communicator
                uid = group.mpi.bcast(uid, root=0)
            group.nccl = self.nccl.NcclCommunicator(group.size, uid, group.rank)
            group.nccl_stream = self.cuda.Stream(non_blocking=True)
        return group.nccl

    def _event(self, stream):
        event = self.cuda.Event(disable_timing=True)    # timing off: cheaper to record and query
        event.record(stream)
        return event

    def _after_compute(self, stream):
        """`stream` made to wait for the compute stream's work so far (the data to send is
        written; memory to receive into is no longer used by earlier work)."""
        stream.wait_event(self._event(self.cuda.get_current_stream()))
        return stream

    def clock(self):
        """An EventClock: the time of a call on its stream (the host only enqueues it). None while
        the compute stream captures a CUDA graph: an event recorded in a capture marks an order,
        not a time, and cannot be queried then; the host's clock times the enqueueing instead."""
        if self.cuda.get_current_stream().is_capturing():
            return None
        return EventClock(self.cuda)

    def _begin(self, group, clock=None):
        """The group's communicator and its stream, after the compute stream's work so far;
        `clock` starts there."""
        communicator = self._comm(group)
        stream = self._after_compute(group.nccl_stream)
        if clock is not None:
            clock.start(stream)
        return communicator, stream

    def _end(self, stream, request, clock=None):
        """Mark where the call ends on `stream`: the request's event (and `clock`'s stop)."""
        if clock is not None:
            clock.stop(stream)
        request.event = self._event(stream)
        return request

    def _blocking(self, stream, result, clock=None):
        """A result used right away: the compute stream (not the host) waits for the call."""
        if clock is not None:
            clock.stop(stream)
        self.cuda.get_current_stream().wait_event(self._event(stream))
        return result

    def all_reduce(self, group, x, op, clock=None):
        out = get_array_module(x).empty_like(x)
        communicator, stream = self._begin(group, clock)
        communicator.allReduce(x.data.ptr, out.data.ptr, x.size, self.types[x.dtype], self.ops[op], stream.ptr)
        return self._blocking(stream, out, clock)

    def all_gather(self, group, x, clock=None):
        out = get_array_module(x).empty((group.size,) + x.shape, x.dtype)
        communicator, stream = self._begin(group, clock)
        communicator.allGather(x.data.ptr, out.data.ptr, x.size, self.types[x.dtype], stream.ptr)
        return self._blocking(stream, out, clock)

    def reduce_scatter(self, group, x, op, clock=None):
        out = get_array_module(x).empty(x.shape[1:], x.dtype)
        communicator, stream = self._begin(group, clock)
        communicator.reduceScatter(x.data.ptr, out.data.ptr, out.size, self.types[x.dtype],
                                   self.ops[op], stream.ptr)
        return self._blocking(stream, out, clock)

    def iall_reduce(self, group, x, op, clock=None):
        """In place on the group's stream: compute goes on until wait() (DP buckets overlap
        backward this way)."""
        communicator, stream = self._begin(group, clock)
        communicator.allReduce(x.data.ptr, x.data.ptr, x.size, self.types[x.dtype], self.ops[op], stream.ptr)
        return self._end(stream, StreamRequest(result=x, cuda=self.cuda), clock)

    def ireduce_scatter(self, group, x, op, clock=None):
        """On the group's stream, as iall_reduce: x (kept alive) reduced into this rank's block."""
        out = get_array_module(x).empty(x.size // group.size, x.dtype)
        communicator, stream = self._begin(group, clock)
        communicator.reduceScatter(x.data.ptr, out.data.ptr, out.size, self.types[x.dtype],
                                   self.ops[op], stream.ptr)
        return self._end(stream, StreamRequest(result=out, keep=x, cuda=self.cuda), clock)

    def all_to_all(self, group, x, clock=None):
        counts = numpy.full(group.size, x.shape[0] // group.size)
        return self.all_to_all_v(group, x, counts, counts, clock)

    def all_to_all_v(self, group, x, send_counts, recv_counts, clock=None):
        """NCCL has no all-to-all: one group call of a send and a receive per peer that has rows
        to move (none for a count of zero; this rank's own block too, so that every byte moves on
        the group's stream), ordered against compute as the collectives are."""
        out = get_array_module(x).empty((int(recv_counts.sum()),) + x.shape[1:], x.dtype)
        send, recv = self._carried(x).reshape(-1), self._carried(out).reshape(-1)
        row, datatype = math.prod(x.shape[1:]), self.types[send.dtype]
        sends, receives = _spans(send_counts * row), _spans(recv_counts * row)
        communicator, stream = self._begin(group, clock)
        self.nccl.groupStart()
        for peer in range(group.size):
            (start, count), (at, expected) = sends[peer], receives[peer]
            if count:
                communicator.send(send[start:start + count].data.ptr, count, datatype, peer, stream.ptr)
            if expected:
                communicator.recv(recv[at:at + expected].data.ptr, expected, datatype, peer, stream.ptr)
        self.nccl.groupEnd()
        return self._blocking(stream, out, clock)

    def _carried(self, x):
        """x, or where NCCL's table lacks its dtype (bfloat16) the same bytes as the table's type
        of that size: an all-to-all moves values and computes none."""
        if x.dtype in self.types:
            return x
        carrier = {2: numpy.float16, 4: numpy.float32, 8: numpy.float64}.get(x.dtype.itemsize)
        if carrier is None:
            raise InputError(f"NCCL's all-to-all moves elements of 2, 4 or 8 bytes, and {x.dtype} has "
                             f"{x.dtype.itemsize}; view the array as one of those types")
        return x.view(carrier)

    def broadcast(self, group, x, root, clock=None):
        out = x.copy()
        communicator, stream = self._begin(group, clock)
        communicator.bcast(out.data.ptr, out.size, self.types[out.dtype], root, stream.ptr)
        return self._blocking(stream, out, clock)

    # Point to point. NCCL matches a pair's messages in issue order, and a call on a stream holds
    # back every later call on it until it completes. On one stream for both directions (or in
    # one group call), a receive waiting for a neighbour's later send holds back this rank's own
    # sends, and two neighbours doing so deadlock: an interleaved schedule at PP = 2 does. So
    # each direction between two ranks has a communicator of its own, used only by the sender
    # to send and by the receiver to receive, each on a stream of its own: the sender's stream
    # holds only its sends, the receiver's only the matching receives in the same order (the
    # pipeline posts receives in its neighbour's send order), and nothing can come between.

    def connect(self, groups, pipelines=()):
        """Create the communicators of `groups`, then the pair communicators of `pipelines`, now
        and in the order given (ProcessGrid.connect_nccl): NCCL's set-up blocks until every member
        joins, so ranks must create them in one order, and not lazily inside a first collective
        that ranks reach at different moments (the DP group's runs inside a backward hook)."""
        for group in groups:
            self._comm(group)
        for group in pipelines:
            self._pairs(group)

    def _pairs(self, group):
        """A group's pair communicators, all created at once (at grid set-up, or else at its
        first message) in one order on every rank: a common order cannot deadlock."""
        if group.nccl_pairs is None:
            group.nccl_pairs = {}
            n = group.size
            ring = sorted({(i, (i + d) % n) for i in range(n) for d in (1, -1)} - {(i, i) for i in range(n)})
            for a, b in ring:
                if group.rank == a:
                    uid = self.nccl.get_unique_id()
                    group.mpi.send(uid, dest=b, tag=_PAIR_ID_TAG)
                    group.nccl_pairs[a, b] = (self.nccl.NcclCommunicator(2, uid, 0), self._new_stream())
                elif group.rank == b:
                    uid = group.mpi.recv(source=a, tag=_PAIR_ID_TAG)
                    group.nccl_pairs[a, b] = (self.nccl.NcclCommunicator(2, uid, 1), self._new_stream())
        return group.nccl_pairs

    def _pair(self, group, sender, receiver):
        """(communicator, this rank's stream) for messages from group rank `sender` to
        `receiver`, ring neighbours (what pipelines use)."""
        self._pairs(group)
        if (sender, receiver) not in group.nccl_pairs:
            raise ValueError(f"NCCL point-to-point connects ring neighbours of a group (pipeline "
                             f"stages); ranks {sender} and {receiver} of {group!r} are not neighbours")
        return group.nccl_pairs[sender, receiver]

    def _new_stream(self):
        return self.cuda.Stream(non_blocking=True)

    def isend(self, group, x, peer, tag, clock=None):
        communicator, stream = self._pair(group, group.rank, peer)
        self._after_compute(stream)
        if clock is not None:
            clock.start(stream)
        communicator.send(x.data.ptr, x.size, self.types[x.dtype], 1, stream.ptr)
        return self._end(stream, StreamRequest(keep=x, cuda=self.cuda), clock)

    def irecv(self, group, shape, dtype, xp, peer, tag, clock=None):
        out = xp.empty(shape, dtype)
        communicator, stream = self._pair(group, peer, group.rank)
        self._after_compute(stream)
        if clock is not None:
            clock.start(stream)
        communicator.recv(out.data.ptr, out.size, self.types[out.dtype], 0, stream.ptr)
        return self._end(stream, StreamRequest(result=out, cuda=self.cuda), clock)

    def start_batch(self):
        """Nothing to group: each direction has its communicator and streams (see _pair), so a
        batch's sends and receives cannot hold each other back."""

    def end_batch(self):
        pass


def nccl_loaded(nccl):
    """`from cupy.cuda import nccl` succeeds without libnccl, leaving a stub whose `available` is
    False and which has no NcclCommunicator."""
    return bool(getattr(nccl, "available", True)) and hasattr(nccl, "NcclCommunicator")


def one_gpu_per_rank(bus_ids):
    """True when every local rank has a GPU and no two share one: NCCL refuses two ranks on one
    GPU. PCI bus ids name physical GPUs whatever each rank's CUDA_VISIBLE_DEVICES shows."""
    return bool(bus_ids) and None not in bus_ids and len(set(bus_ids)) == len(bus_ids)


_local_bus_ids = []     # each local rank's GPU, handed over by runtime.init (where all are present)


def use_local_bus_ids(bus_ids):
    """runtime.init: the PCI bus id of each local rank's GPU (None for a rank without one)."""
    _local_bus_ids[:] = bus_ids
    nccl_usable.cache_clear()


@functools.lru_cache(maxsize=None)
def nccl_usable():
    """True when CuPy's NCCL binding has libnccl behind it and each local rank has a GPU of its own."""
    try:
        from cupy.cuda import nccl
    except Exception:
        return False
    return nccl_loaded(nccl) and one_gpu_per_rank(_local_bus_ids)


@functools.lru_cache(maxsize=None)
def _backend(name):
    return NCCLBackend() if name == "nccl" else MPIBackend()


def connect_nccl(groups, pipelines=()):
    """Create the NCCL communicators of `groups` and the pair communicators of `pipelines` now,
    in that order, where NCCL serves this run's GPU arrays (see NCCLBackend.connect)."""
    if nccl_usable():
        _backend("nccl").connect(groups, pipelines)


def backend_for(x):
    """MPI for host arrays; NCCL for GPU arrays where each rank has its own GPU."""
    on_host = get_array_module(x) is numpy
    return _backend("mpi" if on_host or not nccl_usable() else "nccl")
