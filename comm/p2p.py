"""Point to point: send, recv, isend, irecv, sendrecv and batched exchanges.

Peers are ranks of the group passed (the world by default, so global ranks). A batch posts every
receive and send non-blocking (inside one NCCL group call on GPUs) before waiting, so it cannot
deadlock whatever order neighbouring ranks list their operations in.
"""
from dataclasses import dataclass
from typing import Any, Optional

import numpy

from npmegatron.autograd.backend import get_array_module
from npmegatron.autograd.errors import InputError

from .backends import backend_for
from .collectives import contiguous, timed
from .request import Request
from .runtime import init


def _world(group):
    if group is not None:
        return group
    return init()


def isend(x, dst, group=None, tag=0):
    group = _world(group)
    x = contiguous(x)
    backend = backend_for(x)
    clock, timing = timed(backend)
    return Request(backend.isend(group, x, dst, tag, **timing), "send", group, x.nbytes, clock=clock)


def irecv(src, shape, dtype, group=None, tag=0, xp=numpy):
    group = _world(group)
    dtype = numpy.dtype(dtype)
    probe = xp.empty(0, dtype)
    nbytes = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
    backend = backend_for(probe)
    clock, timing = timed(backend)
    return Request(backend.irecv(group, tuple(shape), dtype, xp, src, tag, **timing), "recv", group, nbytes,
                   clock=clock)


def send(x, dst, group=None, tag=0):
    isend(x, dst, group, tag).wait()


def recv(src, shape, dtype, group=None, tag=0, xp=numpy):
    return irecv(src, shape, dtype, group, tag, xp).wait()


@dataclass
class P2POp:
    """One operation of a batch: P2POp('send', peer, array=x) or
    P2POp('recv', peer, shape=..., dtype=...)."""
    kind: str
    peer: int
    array: Any = None
    shape: Optional[tuple] = None
    dtype: Any = None
    xp: Any = numpy
    tag: int = 0


def batch_isend_irecv(ops, group=None):
    """Post all operations, receives first, as one batch; returns their requests in input order."""
    group = _world(group)
    if not ops:
        return []
    sample = next((op.array for op in ops if op.array is not None), None)
    backend = backend_for(sample if sample is not None else ops[0].xp.empty(0))
    order = sorted(range(len(ops)), key=lambda i: ops[i].kind != "recv")
    requests = [None] * len(ops)
    backend.start_batch()
    try:
        for i in order:
            op = ops[i]
            if op.kind == "recv":
                requests[i] = irecv(op.peer, op.shape, op.dtype, group, op.tag, op.xp)
            elif op.kind == "send":
                requests[i] = isend(op.array, op.peer, group, op.tag)
            else:
                raise InputError(f"P2P operation kind {op.kind!r} is neither 'send' nor 'recv'")
    finally:
        backend.end_batch()
    return requests


def sendrecv(x, dst, src, recv_shape=None, recv_dtype=None, group=None, tag=0):
    """Send x to dst and receive from src in one exchange (shape and dtype default to x's)."""
    ops = [P2POp("send", dst, array=x, tag=tag),
           P2POp("recv", src, shape=x.shape if recv_shape is None else recv_shape,
                 dtype=x.dtype if recv_dtype is None else recv_dtype, xp=get_array_module(x), tag=tag)]
    requests = batch_isend_irecv(ops, group)
    requests[0].wait()
    return requests[1].wait()


def wait_all(requests):
    return [r.wait() for r in requests]
