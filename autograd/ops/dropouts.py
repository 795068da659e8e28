"""Dropout (paper Appendix B.2 draws its masks; npmegatron/tensor_parallel/random.py makes
them): plain, fused with the residual add, and fused with the row-parallel output's bias and the
residual add (Megatron's bias_dropout_add), the end of each transformer branch. The masks come
from the generator passed in, so callers decide which RNG stream."""
import numpy

from .. import precision, sixteen_bit_kernels
from ..backend import get_array_module, scatter_add
from ..errors import InputError
from ..function import Function, remember_16_bit_copy, sixteen_bit_form
from ..fusion import fused
from .arithmetic import bias_grad_by_gemv


@fused
def dropout_add_forward(xp, y, keep, residual, scale):
    """residual + dropout(y): y where kept, scaled by 1 / (1 - p), as Dropout does with the same
    keep mask."""
    out = y * keep
    out *= scale
    out += residual
    return out


@fused
def bias_dropout_add_forward(xp, y, bias, keep, residual, scale):
    """residual + dropout(y + bias), the mask given."""
    out = y + bias
    out *= keep
    out *= scale
    out += residual
    return out


@fused
def bias_add_residual(xp, y, bias, residual):
    """residual + y + bias: the block's branch end without dropout."""
    out = y + bias
    out += residual
    return out


@fused
def dropout_backward(xp, g, keep, scale):
    """The gradient through inverted dropout: g where kept, times 1 / (1 - p)."""
    gx = g * keep
    gx *= scale
    return gx


def keep_mask(generator, shape, dtype, p, **where):
    """Dropout's keep mask generator.random(shape, dtype, **where) >= p, made by the generator's
    own `keep` where it has one (npmegatron's draws hash and compare in one pass on the CPU)."""
    keep = getattr(generator, "keep", None)
    if keep is not None:
        return keep(shape, dtype, p, **where)
    return generator.random(shape, dtype, **where) >= p


#: residual + dropout(y) and residual + y + bias of float32 arrays this large run the compiled CPU
#: kernels (_dropout_cpu.py).
COMPILED_DROPOUT_SIZE = 1 << 16


def _compiled(y, residual):
    """Whether y and residual take the compiled CPU kernels: large C-ordered float32 host arrays
    of one shape."""
    return (get_array_module(y) is numpy and y.dtype == numpy.float32 and y.size >= COMPILED_DROPOUT_SIZE
            and y.shape == residual.shape and residual.dtype == numpy.float32 and y.flags.c_contiguous
            and residual.flags.c_contiguous)


def _compiled_bias(bias, y):
    """Whether a bias goes into the compiled kernels with y (_compiled): float32, C-ordered, one
    number per column of y (the kernels index it unchecked)."""
    return (isinstance(bias, numpy.ndarray) and bias.dtype == numpy.float32 and bias.shape == y.shape[-1:]
            and bias.flags.c_contiguous)


class Dropout(Function):
    """Zero each element with probability p and scale the rest by 1/(1-p); the mask is drawn
    from the generator passed in, so callers decide which RNG stream (paper Appendix B.2)."""

    @staticmethod
    def forward(ctx, x, p, generator):
        keep = keep_mask(generator, x.shape, x.dtype, p)
        if get_array_module(x) is not get_array_module(keep):
            keep = get_array_module(x).asarray(keep)
        ctx.scale = x.dtype.type(1.0 / (1.0 - p))
        ctx.save_for_backward(keep)
        out = x * keep
        out *= ctx.scale
        return out

    @staticmethod
    def backward(ctx, g):
        gx = g * ctx.saved[0]
        gx *= ctx.scale
        return gx


class DropoutAdd(Function):
    """residual + dropout(y) in one pass (the end of each transformer sub-block without a bias).
    It draws the same uniforms from the generator as Dropout, so the masks, and the model, are
    unchanged. p None: no dropout (a GPU's 16-bit residual stream, which the kernel writes)."""
    reads_16_bit = True     # sixteen_bit_kernels.py reads 16-bit y and residual
    reads_16_bit_grads = True       # the gradient is handed on as it is (dropout's widens it)

    @staticmethod
    def forward(ctx, y, residual, p, generator):
        ctx.scale = None if p is None else 1.0 / (1.0 - p)
        storage = ctx.storage = precision.active()
        # backward reads the output's gradient rounded to the 16-bit grid (Function.rounds_gradient_first)
        ctx.rounds_gradient_first = storage is not None
        stream = _stream_16_bit(residual, storage)
        if stream is not None and sixteen_bit_kernels.takes(y, None, stream, storage):
            # a GPU's 16-bit residual stream: the same numbers in one kernel, written in 16 bits
            keep = None if p is None else keep_mask(generator, y.shape, numpy.float32, p)
            ctx.save_for_backward(keep)
            return sixteen_bit_kernels.bias_dropout_add(y, None, keep, stream, ctx.scale, storage)
        y, residual = (precision.to_float32(a) if precision.format_of(a.dtype) else a for a in (y, residual))
        if p is None:
            ctx.save_for_backward(None)
            return residual + y
        out, keep = DropoutAdd.masked_sum(y, residual, p, generator)
        ctx.save_for_backward(keep)
        return out

    @staticmethod
    def masked_sum(y, residual, p, generator, bias=None):
        """(residual + dropout(y + bias), keep mask); no bias: residual + dropout(y). The compiled
        CPU kernel adds the bias in its pass (as the chain would, before the dropout)."""
        dtype = y.dtype if bias is None else numpy.result_type(y.dtype, bias.dtype)   # (y + bias)'s
        keep = keep_mask(generator, y.shape, dtype, p)          # one kernel on a GPU
        scale = 1.0 / (1.0 - p)
        if _compiled(y, residual) and (bias is None or _compiled_bias(bias, y)):
            from . import _dropout_cpu              # numba is imported for large arrays only
            return _dropout_cpu.dropout_add(y, keep, residual, scale, bias), keep
        return dropout_add_forward(y if bias is None else y + bias, keep, residual, scale), keep

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved
        g = _rounded_first(g, ctx.storage)
        if keep is None or not ctx.needs_input_grad[0]:
            return (g if keep is None and ctx.needs_input_grad[0] else None), g
        return _dropout_backward(g, keep, ctx.scale, ctx.storage), g


class BiasDropoutAdd(Function):
    """residual + dropout(y + bias): the end of each transformer sub-block, with the row-parallel
    output's bias (Megatron's bias_dropout_add). One kernel forward on a GPU besides the mask's;
    with p = 0 (or p = None: not training) one kernel and no mask. The masks are Dropout's."""
    reads_16_bit = True     # sixteen_bit_kernels.py reads 16-bit y and residual
    reads_16_bit_grads = True       # without dropout a 16-bit gradient is handed on as it is

    writes_grad_destinations = True

    @staticmethod
    def forward(ctx, y, bias, residual, p, generator):
        xp = get_array_module(y)
        ctx.scale = None if p is None else 1.0 / (1.0 - p)
        storage = ctx.storage = precision.active()
        # backward reads the output's gradient rounded to the 16-bit grid (Function.rounds_gradient_first)
        ctx.rounds_gradient_first = storage is not None
        stream = _stream_16_bit(residual, storage)
        if stream is not None and sixteen_bit_kernels.takes(y, bias, stream, storage):
            residual = stream
            # a GPU's 16-bit residual stream: the same numbers in one kernel, written in 16 bits
            keep = None if p is None else keep_mask(generator, y.shape, numpy.float32, p)
            out = sixteen_bit_kernels.bias_dropout_add(y, bias, keep, residual, ctx.scale, storage)
            ctx.save_for_backward(keep)
            return out
        y, residual = (precision.to_float32(a) if precision.format_of(a.dtype) else a for a in (y, residual))
        if storage is not None:
            # 16-bit storage by rounding keeps the numbers of the two ops this one fuses: y + bias
            # on the 16-bit grid before the residual is added (precision.py)
            y_bias = precision.round_(y + bias, storage)
            if p is None:
                keep, out = None, residual + y_bias
            else:
                out, keep = DropoutAdd.masked_sum(y_bias, residual, p, generator)
        elif p is None and _compiled(y, residual) and _compiled_bias(bias, y):
            from . import _dropout_cpu
            keep, out = None, _dropout_cpu.bias_add_residual(y, bias, residual)
        elif p is None:
            keep, out = None, bias_add_residual(y, bias, residual)
        elif xp is numpy:          # the CPU's DropoutAdd path (compiled for large float32 arrays)
            out, keep = DropoutAdd.masked_sum(y, residual, p, generator, bias)
        else:
            keep = keep_mask(generator, y.shape, y.dtype, p)
            out = bias_dropout_add_forward(y, bias, keep, residual, ctx.scale)
        ctx.save_for_backward(keep)
        return out

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved
        need_y, need_bias = ctx.needs_input_grad[:2]
        ctx.mark_fresh(1)               # the bias's reduction (y's may be g itself)
        if ctx.storage is not None:
            # the residual's gradient is g rounded, y's g rounded through the dropout and rounded
            # again, the bias's one GEMV of y's, summed in float32 (a GPU's 16-bit g: LayerNorm's
            # kernel rounded the fork's sum; the 16-bit arrays go on as they are)
            g = _rounded_first(g, ctx.storage)
            gy = g if keep is None else _dropout_backward(g, keep, ctx.scale, ctx.storage) \
                if need_y or need_bias else None
            gb = bias_grad_by_gemv(gy, ctx.destination(1)) if need_bias else None
            return gy if need_y else None, gb, g
        gy = g if keep is None else dropout_backward(g, keep, ctx.scale) if need_y or need_bias else None
        # the bias's gradient summed over the leading axes as Add's backward summed it, so the
        # numbers are the unfused ops' (one reduction kernel on a GPU either way)
        gb = _bias_sum(gy, ctx.destination(1)) if need_bias else None
        return gy if need_y else None, gb, g


def _rounded_first(g, storage):
    """The output's gradient as a Function that rounds it first uses it: a 16-bit array as it is,
    float32 rounded in place to storage's grid (where the tape would round it as a result anyway:
    the residual's gradient is g itself); outside 16-bit storage g as it is."""
    if storage is None or precision.format_of(g.dtype):
        return g
    return precision.round_(g, storage)


def _dropout_backward(g, keep, scale, storage):
    """Dropout's gradient of g (rounded already) under 16-bit storage, rounded as the tape rounds
    it: one 16-bit kernel from a GPU's 16-bit g; else the chain, rounded in place (with its 16-bit
    copy where a GPU holds 16-bit arrays, which the GEMMs reading it take), so a bias's GEMV sums
    the rounded numbers."""
    if precision.format_of(g.dtype) and sixteen_bit_kernels.takes_16_bit_operand(g, storage):
        return sixteen_bit_kernels.dropout_backward(g, keep, scale, storage)
    gy = dropout_backward(precision.to_float32(g) if precision.format_of(g.dtype) else g, keep, scale)
    if not precision.kept_in_16_bit(storage) or get_array_module(gy) is numpy:
        return precision.round_(gy, storage)
    copy = precision.round_keeping_copy(gy, storage)
    if copy is not None:
        remember_16_bit_copy(gy, copy)
    return gy if copy is None else copy


class AddRowsDropout(Function):
    """dropout(x + table[rows]) under 16-bit storage: the embedding's end, the word embedding's
    lookup plus the position table's rows (table None: the lookup's dropout alone). It keeps the
    numbers of the two ops it fuses, the sum rounded to the grid before the dropout; on a GPU that
    holds 16-bit arrays it is one kernel each way, writing 16 bits. The table's gradient (its rows'
    summed over the batch by one GEMV, as every bias's) goes to the parameter unrounded, as every
    parameter's gradient does (precision.py)."""
    reads_16_bit = True     # sixteen_bit_kernels.py reads 16-bit x and rows
    reads_16_bit_grads = True

    @staticmethod
    def forward(ctx, x, table, rows, p, generator):
        storage = ctx.storage = precision.active()
        ctx.rounds_gradient_first = True    # (Function.rounds_gradient_first)
        ctx.scale = None if p is None else 1.0 / (1.0 - p)
        ctx.table = None if table is None else (table.shape, table.dtype, rows)
        picked = None if table is None else table[rows]
        if _adds_rows_in_16_bit(x, picked, storage):
            keep = None if p is None else keep_mask(generator, x.shape, numpy.float32, p)
            ctx.save_for_backward(keep)
            copy = sixteen_bit_form(x, storage)     # a float32 x's 16-bit copy, where its rounding made one
            return sixteen_bit_kernels.add_rows_dropout(x if copy is None else copy, picked, keep, ctx.scale, storage)
        out = precision.to_float32(x) if precision.format_of(x.dtype) else x
        if picked is not None:
            picked = precision.to_float32(picked) if precision.format_of(picked.dtype) else picked
            out = precision.round_(out + picked, storage)
        keep = None
        if p is not None:
            keep = keep_mask(generator, out.shape, out.dtype, p)
            if get_array_module(out) is not get_array_module(keep):
                keep = get_array_module(out).asarray(keep)
            out = dropout_backward(out, keep, ctx.scale)     # Dropout's product (its backward's chain)
        ctx.save_for_backward(keep)
        return out

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved
        g = _rounded_first(g, ctx.storage)
        gx = g if keep is None else _dropout_backward(g, keep, ctx.scale, ctx.storage)
        if ctx.table is None or not ctx.needs_input_grad[1]:
            return gx, None
        shape, dtype, rows = ctx.table
        xp = get_array_module(gx)
        g_table = xp.zeros(shape, precision.master_dtype(dtype))
        ctx.mark_fresh(1)
        per_position = gx.reshape(-1, g_table[rows].size)      # (batch, the rows' values)
        if isinstance(rows, slice):         # a C-ordered block of the table's rows: summed into it
            bias_grad_by_gemv(per_position, (g_table[rows].reshape(-1), False))
        else:
            scatter_add(g_table, rows, bias_grad_by_gemv(per_position).reshape(-1, shape[1]))
        return gx, g_table


def _adds_rows_in_16_bit(x, picked, storage):
    """Whether AddRowsDropout's 16-bit kernel takes x and the picked rows: a GPU that holds 16-bit
    arrays, x float32 or 16-bit, the rows C-ordered 16-bit."""
    return (precision.kept_in_16_bit(storage) is not None and sixteen_bit_kernels.takes_16_bit_operand(x, storage)
            and (picked is None or (precision.format_of(picked.dtype) == storage and picked.flags.c_contiguous
                                    and picked.size and x.size % picked.size == 0)))


def _stream_16_bit(residual, storage):
    """The residual as the 16-bit stream's kernel reads it, where a GPU holds 16-bit arrays under
    `storage`: 16-bit (itself, or the copy its rounding made), else float32 as it is; or None."""
    if storage is None or not precision.kept_in_16_bit(storage) or get_array_module(residual) is numpy:
        return None
    stream = sixteen_bit_form(residual, storage)
    return residual if stream is None else stream


def _bias_sum(gy, destination):
    """gy summed over the leading axes (Add's backward's reduction), into or added to
    `destination` (Context.destination) when given."""
    axes = tuple(range(gy.ndim - 1))
    if destination is None:
        return gy.sum(axis=axes)
    out, accumulate = destination
    if accumulate:
        out += gy.sum(axis=axes)
    else:
        gy.sum(axis=axes, out=out)
    return out


def dropout(x, p, generator, training=True):
    """Inverted dropout; identity when p == 0 or not training."""
    if not 0.0 <= p < 1.0:
        raise InputError(f"dropout probability {p} is outside [0, 1); use e.g. 0.1")
    if p == 0.0 or not training:
        return x
    return Dropout.apply(x, p=p, generator=generator)


def dropout_add(y, residual, p, generator, training=True):
    """residual + dropout(y, p), fused; plain residual + y when p == 0 or not training."""
    if not 0.0 <= p < 1.0:
        raise InputError(f"dropout probability {p} is outside [0, 1); use e.g. 0.1")
    if y.shape != residual.shape:
        raise InputError(f"dropout_add needs y and residual of one shape, got {tuple(y.shape)} and "
                         f"{tuple(residual.shape)}")
    active = p if p > 0.0 and training else None
    if active is None and not _on_16_bit_device(y.data):
        return residual + y
    return DropoutAdd.apply(y, residual, p=active, generator=generator)


def _on_16_bit_device(a):
    """Whether `a` is on a GPU whose 16-bit arrays are on (precision.kept_in_16_bit), where a
    residual add without dropout is DropoutAdd's one 16-bit kernel rather than an Add."""
    return precision.kept_in_16_bit() is not None and get_array_module(a) is not numpy


def add_rows_dropout(x, table, rows, p, generator, training=True):
    """dropout(x + table[rows], p) (table None: dropout(x, p)): the embedding's end. Under 16-bit
    storage one Function (AddRowsDropout); else the two ops."""
    if not 0.0 <= p < 1.0:
        raise InputError(f"dropout probability {p} is outside [0, 1); use e.g. 0.1")
    active = p if p > 0.0 and training else None
    if precision.active() is None:
        return dropout(x if table is None else x + table[rows], p, generator, training)
    if table is None and active is None:
        return x
    return AddRowsDropout.apply(x, table, rows=rows, p=active, generator=generator)


def bias_dropout_add(y, bias, residual, p, generator, training=True):
    """residual + dropout(y + bias, p), fused (BiasDropoutAdd); no mask when p == 0 or not
    training."""
    if not 0.0 <= p < 1.0:
        raise InputError(f"dropout probability {p} is outside [0, 1); use e.g. 0.1")
    if y.shape != residual.shape or bias.shape != y.shape[-1:]:
        raise InputError(f"bias_dropout_add needs y and residual of one shape and a bias of y's last "
                         f"dimension, got {tuple(y.shape)}, {tuple(residual.shape)} and {tuple(bias.shape)}")
    active = p if p > 0.0 and training else None
    return BiasDropoutAdd.apply(y, bias, residual, p=active, generator=generator)
