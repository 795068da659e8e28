"""Differentiable communication between tensor-parallel ranks, as conjugate pairs (paper §3,
Megatron-LM's tensor_parallel/mappings.py). Each forward is the adjoint of the other's backward:

    copy_to_tp_region        f: identity        / all-reduce        (enter a TP region)
    reduce_from_tp_region    g: all-reduce      / identity          (leave a TP region)
    scatter_to_tp_region        split last axis / all-gather last axis
    gather_from_tp_region       all-gather last / split last axis
    scatter_to_sp_region        split sequence  / all-gather sequence
    gather_from_sp_region       all-gather seq  / reduce-scatter seq (before column-parallel)
    reduce_scatter_to_sp_region reduce-scatter  / all-gather seq     (after row-parallel)

Activations are (batch, sequence, hidden): the sequence axis is 1.
"""
import numpy

from npmegatron import comm
from npmegatron.autograd import Function, precision

SEQUENCE_AXIS = 1


def _gathered(x, group, axis):
    """comm.all_gather of x along axis; a bfloat16 array (a GPU's 16-bit activation) travels as
    float16 of the same bits, as the distributed optimizer's parameters do: the gather moves bytes
    and adds none, and mpi4py refuses bfloat16 buffers where NCCL's type table has none."""
    if precision.format_of(x.dtype) != "bf16":
        return comm.all_gather(x, group, axis=axis)
    return comm.all_gather(x.view(numpy.float16), group, axis=axis).view(x.dtype)


def _split(x, group, axis):
    """This rank's block of x along axis (a copy: the block must outlive x's other blocks)."""
    if group.size == 1:
        return x
    block = x.shape[axis] // group.size
    index = [slice(None)] * x.ndim
    index[axis] = slice(group.rank * block, (group.rank + 1) * block)
    return x[tuple(index)].copy()


class _CopyToTPRegion(Function):
    reads_16_bit = True     # moves values: 16-bit ones in half the bytes (no sum)
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g, ctx.group)


class _ReduceFromTPRegion(Function):
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g


class _ScatterToTPRegion(Function):
    reads_16_bit = True     # moves values: 16-bit ones in half the bytes (no sum)
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g, ctx.group, axis=-1)


class _GatherFromTPRegion(Function):
    reads_16_bit = True     # moves values: 16-bit ones in half the bytes (no sum)
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gathered(x, group, -1)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, -1)


class _ScatterToSPRegion(Function):
    reads_16_bit = True     # moves values: 16-bit ones in half the bytes (no sum)
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, SEQUENCE_AXIS)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g, ctx.group, axis=SEQUENCE_AXIS)


class _GatherFromSPRegion(Function):
    reads_16_bit = True     # moves values: 16-bit ones in half the bytes (no sum)
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gathered(x, group, SEQUENCE_AXIS)

    @staticmethod
    def backward(ctx, g):
        return comm.reduce_scatter(g, ctx.group, axis=SEQUENCE_AXIS)


class _GatherWholeSequence(_GatherFromSPRegion):
    """_GatherFromSPRegion's forward with _ScatterToSPRegion's conjugate backward: work after it
    is repeated whole on every rank (an MoE layer's routing), so each rank's gradient is already
    the whole one and needs no sum, only this rank's block kept."""
    reads_16_bit_grads = True

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, SEQUENCE_AXIS)


class _ReduceScatterToSPRegion(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter(x, group, axis=SEQUENCE_AXIS)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g, ctx.group, axis=SEQUENCE_AXIS)


# Each mapping is the identity on a group of one rank: no Function is recorded for it then.

def copy_to_tp_region(x, group):
    """f — forward: identity; backward: all-reduce over the TP group."""
    return x if group.size == 1 else _CopyToTPRegion.apply(x, group=group)


def reduce_from_tp_region(x, group):
    """g — forward: all-reduce over the TP group; backward: identity."""
    return x if group.size == 1 else _ReduceFromTPRegion.apply(x, group=group)


def scatter_to_tp_region(x, group):
    """forward: keep this rank's block of the last axis; backward: all-gather the last axis."""
    return x if group.size == 1 else _ScatterToTPRegion.apply(x, group=group)


def gather_from_tp_region(x, group):
    """forward: all-gather the last axis; backward: keep this rank's block of the last axis."""
    return x if group.size == 1 else _GatherFromTPRegion.apply(x, group=group)


def scatter_to_sp_region(x, group):
    """forward: keep this rank's block of the sequence; backward: all-gather the sequence."""
    return x if group.size == 1 else _ScatterToSPRegion.apply(x, group=group)


def gather_whole_sequence(x, group):
    """forward: all-gather the sequence; backward: keep this rank's block of the sequence."""
    return x if group.size == 1 else _GatherWholeSequence.apply(x, group=group)


def gather_from_sp_region(x, group):
    """forward: all-gather the sequence; backward: reduce-scatter the sequence."""
    return x if group.size == 1 else _GatherFromSPRegion.apply(x, group=group)


def reduce_scatter_to_sp_region(x, group):
    """forward: reduce-scatter the sequence; backward: all-gather the sequence."""
    return x if group.size == 1 else _ReduceScatterToSPRegion.apply(x, group=group)
