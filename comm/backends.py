"""Two backends behind one interface: MPI (mpi4py, host buffers) and NCCL (CuPy, GPU buffers).

Both take contiguous arrays in the canonical layout chosen by collectives.py (gather and scatter
blocks stacked on axis 0) and return new arrays. The backend follows where the array lives:
NumPy goes through MPI; CuPy goes through NCCL when every local rank has a GPU of its own, else
through MPI staged in host memory (NCCL refuses two ranks on one GPU).
"""
import functools
import os

import numpy

from npmegatron.autograd.backend import get_array_module, to_numpy


def _mpi():
    from mpi4py import MPI
    return MPI


class MPIBackend:
    name = "mpi"

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
        request = group.mpi.Iallreduce(_mpi().IN_PLACE, host, op=self._ops()[op])
        return MPIRequest(request, result=host, xp=get_array_module(x))

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
    communicator; point-to-point pairs go inside NCCL group calls so they cannot deadlock."""

    name = "nccl"

    def __init__(self, nccl=None):
        """nccl: cupy.cuda.nccl by default; tests pass a stand-in (no CuPy needed)."""
        if nccl is None:
            from cupy.cuda import nccl
        self.nccl = nccl
        self.types = {numpy.dtype(k): v for k, v in (
            ("float16", nccl.NCCL_FLOAT16), ("float32", nccl.NCCL_FLOAT32),
            ("float64", nccl.NCCL_FLOAT64), ("int32", nccl.NCCL_INT32), ("int64", nccl.NCCL_INT64))}
        self.ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}
        self.batched = None     # requests posted inside an NCCL group call, until it ends

    def _comm(self, group):
        """The group's communicator, created on first use. Rank 0's unique id travels as the very
        object get_unique_id returned (pickled): a tuple of ints before CuPy 14, 128 bytes since,
        and NcclCommunicator takes the same type back, so no conversion can go stale."""
        if group.nccl is None:
            uid = self.nccl.get_unique_id() if group.rank == 0 else None
            if group.size > 1:          # a one-rank group (Group.single) has no MPI communicator
                uid = group.mpi.bcast(uid, root=0)
            group.nccl = self.nccl.NcclCommunicator(group.size, uid, group.rank)
        return group.nccl

    @staticmethod
    def _stream():
        import cupy
        return cupy.cuda.get_current_stream().ptr

    def all_reduce(self, group, x, op):
        out = get_array_module(x).empty_like(x)
        self._comm(group).allReduce(x.data.ptr, out.data.ptr, x.size, self.types[x.dtype],
                                    self.ops[op], self._stream())
        return out

    def all_gather(self, group, x):
        out = get_array_module(x).empty((group.size,) + x.shape, x.dtype)
        self._comm(group).allGather(x.data.ptr, out.data.ptr, x.size, self.types[x.dtype], self._stream())
        return out

    def reduce_scatter(self, group, x, op):
        out = get_array_module(x).empty(x.shape[1:], x.dtype)
        self._comm(group).reduceScatter(x.data.ptr, out.data.ptr, out.size, self.types[x.dtype],
                                        self.ops[op], self._stream())
        return out

    def iall_reduce(self, group, x, op):
        """In place, queued on the current stream: already asynchronous to the host."""
        self._comm(group).allReduce(x.data.ptr, x.data.ptr, x.size, self.types[x.dtype],
                                    self.ops[op], self._stream())
        return self._posted(StreamRequest(result=x))

    def broadcast(self, group, x, root):
        out = x.copy()
        self._comm(group).bcast(out.data.ptr, out.size, self.types[out.dtype], root, self._stream())
        return out

    def isend(self, group, x, peer, tag):
        self._comm(group).send(x.data.ptr, x.size, self.types[x.dtype], peer, self._stream())
        return self._posted(StreamRequest(keep=x))

    def irecv(self, group, shape, dtype, xp, peer, tag):
        out = xp.empty(shape, dtype)
        self._comm(group).recv(out.data.ptr, out.size, self.types[out.dtype], peer, self._stream())
        return self._posted(StreamRequest(result=out))

    def start_batch(self):
        self.nccl.groupStart()
        self.batched = []

    def end_batch(self):
        self.nccl.groupEnd()
        # Inside a group call NCCL enqueues nothing until groupEnd: an event recorded earlier
        # would complete before the transfers start.
        event = self._event()
        for request in self.batched:
            request.event = event
        self.batched = None

    def _posted(self, request):
        """Mark where the NCCL call ends on the stream (deferred to end_batch inside a batch)."""
        if self.batched is not None:
            self.batched.append(request)
        else:
            request.event = self._event()
        return request

    @staticmethod
    def _event():
        import cupy
        event = cupy.cuda.Event(disable_timing=True)    # timing off: cheaper to record and query
        event.record(cupy.cuda.get_current_stream())
        return event


class StreamRequest:
    """NCCL work queued on the current stream; `event`, recorded right after it, tells when it is
    done without synchronising the whole stream (later work on it need not finish)."""

    def __init__(self, result=None, keep=None, event=None):
        self.result, self.keep, self.event = result, keep, event

    def test(self):
        """True once the transfer finished: a send's buffer can then be freed (pipeline sends)."""
        if not self.event.done:
            return False
        self.keep = None
        return True

    def wait(self):
        self.event.synchronize()
        self.keep = None
        return self.result


def nccl_loaded(nccl):
    """`from cupy.cuda import nccl` succeeds without libnccl, leaving a stub whose `available` is
    False and which has no NcclCommunicator."""
    return bool(getattr(nccl, "available", True)) and hasattr(nccl, "NcclCommunicator")


def one_gpu_per_rank(bus_ids):
    """True when every local rank has a GPU and no two share one: NCCL refuses two ranks on one
    GPU. PCI bus ids name physical GPUs whatever each rank's CUDA_VISIBLE_DEVICES shows."""
    return bool(bus_ids) and None not in bus_ids and len(set(bus_ids)) == len(bus_ids)


@functools.lru_cache(maxsize=None)
def nccl_usable():
    """True when CuPy's NCCL binding has libnccl behind it and each local rank has a GPU of its own
    (bus ids gathered by runtime.init, where every rank is present)."""
    try:
        from cupy.cuda import nccl
    except Exception:
        return False
    from .runtime import local_bus_ids
    return nccl_loaded(nccl) and one_gpu_per_rank(local_bus_ids())


@functools.lru_cache(maxsize=None)
def _backend(name):
    return NCCLBackend() if name == "nccl" else MPIBackend()


def backend_for(x):
    """MPI for host arrays; NCCL for GPU arrays where each rank has its own GPU."""
    on_host = get_array_module(x) is numpy
    return _backend("mpi" if on_host or not nccl_usable() else "nccl")
