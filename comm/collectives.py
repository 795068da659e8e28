"""Collectives on a group: all_reduce, all_gather, reduce_scatter, broadcast, barrier, the
all-to-alls of mixture-of-experts token dispatch (all_to_all, all_to_all_v), and the
asynchronous all_reduce_async and reduce_scatter_async, which return a Request (request.py).

Each returns at once when its group has one rank, checks agreement in debug mode and records op,
group, bytes and seconds for comm.stats(). The blocking ones accept non-contiguous input; the
asynchronous ones work in place and need contiguous arrays. The backend (backends.py) is MPI
for host arrays, with node shared memory for mid-sized all-reduces (shared_memory.py), and NCCL
for GPU arrays when each rank has its own GPU.
"""
import time

import numpy

from npmegatron.autograd.backend import get_array_module
from npmegatron.autograd.errors import InputError

from . import debug
from .backends import backend_for
from .request import Request
from .stats import record

REDUCE_OPS = ("sum", "max", "min")


def contiguous(x):
    """x itself when C-contiguous, else a C-ordered copy (0-d arrays stay 0-d, unlike
    ascontiguousarray)."""
    return x if x.flags.c_contiguous else x.copy(order="C")


def timed(backend):
    """(clock, keyword arguments for the backend's call): NCCL times its calls with events on
    their streams (streams.EventClock); MPI's calls are timed by the host's clock here."""
    clock = backend.clock()
    return clock, ({} if clock is None else {"clock": clock})


def _run(name, group, x, call, detail=""):
    """Debug check, then the call, timed and recorded. `call(backend, **timing)`."""
    if debug.enabled():
        debug.check_agreement(group, f"{name}(shape={tuple(x.shape)}, dtype={x.dtype}{detail})")
    return _timed(name, group, x, call)


def _timed(name, group, x, call):
    """The call, timed and recorded with x's bytes (what this rank hands to it)."""
    backend = backend_for(x)
    clock, timing = timed(backend)
    start = time.perf_counter()
    result = call(backend, **timing)
    record(name, group.name, x.nbytes, time.perf_counter() - start if clock is None else clock)
    return result


def _check_op(op):
    if op not in REDUCE_OPS:
        raise InputError(f"unknown reduction {op!r}; use one of {', '.join(REDUCE_OPS)}")


def all_reduce(x, group, op="sum"):
    """Every rank gets the elementwise reduction (sum, max or min) of all ranks' x."""
    _check_op(op)
    if group.size == 1:
        return x
    x = contiguous(x)
    return _run("all_reduce", group, x, lambda b, **t: b.all_reduce(group, x, op, **t), f", op={op}")


def all_reduce_async(x, group, op="sum"):
    """Start an all-reduce of the contiguous array x in place and return a Request; wait() gives
    the reduced array (x itself on host). Lets gradient buckets reduce while backward runs, and
    tensor parallelism's backward compute weight gradients meanwhile. Recorded as "all_reduce"."""
    _check_op(op)
    if group.size == 1:
        return _Done(x)
    if not x.flags.c_contiguous:
        raise InputError("all_reduce_async reduces in place and needs a contiguous array")
    if debug.enabled():
        debug.check_agreement(group, f"all_reduce_async(shape={tuple(x.shape)}, dtype={x.dtype}, op={op})")
    backend = backend_for(x)
    clock, timing = timed(backend)
    start = time.perf_counter()     # posting copies x on the shared-memory path: count it too
    inner = backend.iall_reduce(group, x, op, **timing)
    return Request(inner, "all_reduce", group, x.nbytes, started_s=time.perf_counter() - start, clock=clock)


def reduce_scatter_async(x, group, op="sum"):
    """Start the reduction of all ranks' contiguous 1-D x, split evenly: rank i gets block i.
    Returns a Request whose wait() gives this rank's block (the distributed optimizer's
    gradient buckets, reduced while backward runs)."""
    _check_op(op)
    if group.size == 1:
        return _Done(x)
    if x.ndim != 1 or x.size % group.size or not x.flags.c_contiguous:
        raise InputError(f"reduce_scatter_async needs a contiguous 1-D array whose length is a multiple "
                         f"of the group size {group.size}, got shape {tuple(x.shape)}; pad it")
    if debug.enabled():
        debug.check_agreement(group, f"reduce_scatter_async(shape={tuple(x.shape)}, dtype={x.dtype}, op={op})")
    backend = backend_for(x)
    clock, timing = timed(backend)
    return Request(backend.ireduce_scatter(group, x, op, **timing), "reduce_scatter_async", group, x.nbytes,
                   clock=clock)


class _Done:
    def __init__(self, value):
        self.value = value

    def test(self):
        return True

    def wait(self):
        return self.value


def all_gather(x, group, axis=0):
    """Concatenation of all ranks' x along `axis`, in group-rank order."""
    if group.size == 1:
        return x
    axis = axis % x.ndim
    x = contiguous(x)

    def call(backend, **timing):
        stacked = backend.all_gather(group, x, **timing)           # (size, *x.shape)
        shape = x.shape[:axis] + (group.size * x.shape[axis],) + x.shape[axis + 1:]
        if axis == 0:
            return stacked.reshape(shape)
        xp = get_array_module(stacked)
        merged = xp.moveaxis(stacked, 0, axis)                     # (..., size, n_axis, ...)
        return xp.ascontiguousarray(merged).reshape(shape)

    return _run("all_gather", group, x, call, f", axis={axis}")


def reduce_scatter(x, group, axis=0, op="sum"):
    """The reduction of all ranks' x, split along `axis`; rank i keeps block i."""
    _check_op(op)
    if group.size == 1:
        return x
    axis = axis % x.ndim
    if x.shape[axis] % group.size:
        raise InputError(f"reduce_scatter along axis {axis} of length {x.shape[axis]} needs a "
                         f"multiple of the group size {group.size}; pad or choose another axis")
    xp = get_array_module(x)
    block = x.shape[axis] // group.size
    blocks = x.reshape(x.shape[:axis] + (group.size, block) + x.shape[axis + 1:])
    stacked = xp.ascontiguousarray(xp.moveaxis(blocks, axis, 0))  # (size, ..., block, ...)
    return _run("reduce_scatter", group, x,
                lambda b, **t: b.reduce_scatter(group, stacked, op, **t), f", axis={axis}, op={op}")


def broadcast(x, group, root=0):
    """Every rank gets root's x (root is a rank of the group); x has the same shape everywhere."""
    if group.size == 1:
        return x
    x = contiguous(x)
    return _run("broadcast", group, x, lambda b, **t: b.broadcast(group, x, root, **t), f", root={root}")


def all_to_all(x, group):
    """Block i of x along axis 0 goes to group rank i; the result is the blocks every rank sent
    this one, concatenated along axis 0 in rank order. Every rank passes x of one shape (expert
    parallelism's token dispatch with even splits, as Megatron-Core's all_to_all)."""
    if x.ndim == 0 or x.shape[0] % group.size:
        raise InputError(f"all_to_all splits axis 0 into one block per rank and needs its length to be a "
                         f"multiple of the group size {group.size}, got shape {tuple(x.shape)}; pad it "
                         "or use all_to_all_v")
    if group.size == 1:
        return x
    x = contiguous(x)
    return _run("all_to_all", group, x, lambda b, **t: b.all_to_all(group, x, **t))


def all_to_all_v(x, group, send_counts, recv_counts):
    """Uneven all-to-all along axis 0: the first send_counts[0] rows of x go to rank 0, the next
    send_counts[1] to rank 1, and so on; recv_counts[j] rows arrive from rank j, concatenated in
    rank order into (sum(recv_counts),) + x.shape[1:]. Counts are host integers, zeros allowed
    (Megatron-Core's all_to_all with input_split_sizes and output_split_sizes)."""
    send = _counts(send_counts, "send_counts", group)
    recv = _counts(recv_counts, "recv_counts", group)
    if x.ndim == 0 or send.sum() != x.shape[0]:
        raise InputError(f"all_to_all_v's send_counts {send.tolist()} add up to {send.sum()}, but x of "
                         f"shape {tuple(x.shape)} has {x.shape[0] if x.ndim else 'no'} rows; the counts "
                         "must split axis 0 of x")
    if group.size == 1:
        if recv[0] != send[0]:
            raise InputError(f"on a group of one rank all_to_all_v receives what it sends, so recv_counts "
                             f"{recv.tolist()} must equal send_counts {send.tolist()}")
        return x
    x = contiguous(x)
    if debug.enabled():     # the number of rows differs between ranks: the rest must agree
        debug.check_agreement(group, f"all_to_all_v(rows={tuple(x.shape[1:])}, dtype={x.dtype}, "
                                     f"ranks={group.size})")
        debug.check_counts(group, send, recv)
    return _timed("all_to_all_v", group, x, lambda b, **t: b.all_to_all_v(group, x, send, recv, **t))


def _counts(counts, name, group):
    """`counts` as a host int64 array: one non-negative integer per rank of the group."""
    try:
        array = numpy.asarray(counts)
    except (TypeError, ValueError):     # CuPy refuses the implicit copy to host; ragged lists
        array = None
    if array is None or array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InputError(f"all_to_all_v's {name} must be a list or NumPy array of host integers, one "
                         f"per rank, got {counts!r}")
    if array.size != group.size:
        raise InputError(f"all_to_all_v's {name} {array.tolist()} has {array.size} entries, but group "
                         f"{group.name} has {group.size} ranks; give one count per rank")
    if (array < 0).any():
        raise InputError(f"all_to_all_v's {name} {array.tolist()} holds a negative count; counts are "
                         "numbers of rows, 0 or more")
    return array.astype(numpy.int64)


def barrier(group):
    if group.size == 1:
        return
    start = time.perf_counter()
    group.mpi.Barrier()
    record("barrier", group.name, 0, time.perf_counter() - start)
