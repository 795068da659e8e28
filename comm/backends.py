"""Two backends behind one interface: MPI (mpi4py, host buffers) and NCCL (CuPy, GPU buffers).

Both take contiguous arrays in the canonical layout chosen by collectives.py (gather and scatter
blocks stacked on axis 0) and return new arrays. The backend follows where the array lives:
NumPy goes through MPI; CuPy goes through NCCL when every local rank has a GPU of its own, else
through MPI staged in host memory (NCCL refuses two ranks on one GPU).
"""
import functools

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
        return MPIRequest(group.mpi.Isend(host, dest=peer, tag=tag), keep=host)

    def irecv(self, group, shape, dtype, xp, peer, tag):
        host = numpy.empty(shape, dtype)
        return MPIRequest(group.mpi.Irecv(host, source=peer, tag=tag), result=host, xp=xp)

    def start_batch(self):
        pass

    def end_batch(self):
        pass


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

    def __init__(self):
        from cupy.cuda import nccl
        self.nccl = nccl
        self.types = {numpy.dtype(k): v for k, v in (
            ("float16", nccl.NCCL_FLOAT16), ("float32", nccl.NCCL_FLOAT32),
            ("float64", nccl.NCCL_FLOAT64), ("int32", nccl.NCCL_INT32), ("int64", nccl.NCCL_INT64))}
        self.ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}

    def _comm(self, group):
        if group.nccl is None:
            uid = numpy.zeros(128, numpy.int8)      # NCCL_UNIQUE_ID_BYTES
            if group.rank == 0:
                uid[:] = numpy.array(self.nccl.get_unique_id(), numpy.int8)
            group.mpi.Bcast(uid, root=0)
            group.nccl = self.nccl.NcclCommunicator(group.size, tuple(int(v) for v in uid), group.rank)
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
        return StreamRequest(result=x)

    def broadcast(self, group, x, root):
        out = x.copy()
        self._comm(group).bcast(out.data.ptr, out.size, self.types[out.dtype], root, self._stream())
        return out

    def isend(self, group, x, peer, tag):
        self._comm(group).send(x.data.ptr, x.size, self.types[x.dtype], peer, self._stream())
        return StreamRequest(keep=x)

    def irecv(self, group, shape, dtype, xp, peer, tag):
        out = xp.empty(shape, dtype)
        self._comm(group).recv(out.data.ptr, out.size, self.types[out.dtype], peer, self._stream())
        return StreamRequest(result=out)

    def start_batch(self):
        self.nccl.groupStart()

    def end_batch(self):
        self.nccl.groupEnd()


class StreamRequest:
    """NCCL work is ordered on the current stream; waiting synchronizes it."""

    def __init__(self, result=None, keep=None):
        self.result, self.keep = result, keep

    def test(self):
        return False

    def wait(self):
        import cupy
        cupy.cuda.get_current_stream().synchronize()
        self.keep = None
        return self.result


@functools.lru_cache(maxsize=None)
def nccl_usable():
    """NCCL needs one GPU per rank: true when cupy's NCCL imports and the local ranks fit."""
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401
        from .runtime import local_size
        return local_size() <= cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def _backend(name):
    return NCCLBackend() if name == "nccl" else MPIBackend()


def backend_for(x):
    """MPI for host arrays; NCCL for GPU arrays where each rank has its own GPU."""
    on_host = get_array_module(x) is numpy
    return _backend("mpi" if on_host or not nccl_usable() else "nccl")
