"""Fused neural-network ops: softmax, LayerNorm, embedding and cross-entropy (dropout: dropouts.py).

Fused means one Function with a hand-written backward, as Megatron's fused kernels
(FusedScaleMaskSoftmax, fused LayerNorm), instead of a chain of primitives each saving arrays.
"""
import contextlib

import numpy

from .. import precision, row_kernels
from ..backend import get_array_module, scatter_add, to_numpy
from ..errors import InputError
from ..function import Function, sixteen_bit_form
from ..fusion import fused, fused_reduction
from ..tensor import Tensor
from .arithmetic import bias_grad


def _causal_bias(xp, t_q, t_k, dtype):
    """0 where a query may attend, -inf after it; queries are the last t_q of t_k positions."""
    q = xp.arange(t_k - t_q, t_k)[:, None]
    k = xp.arange(t_k)[None, :]
    return xp.where(k > q, -xp.inf, 0.0).astype(dtype)


# The elementwise chains of softmax, LayerNorm and dropout + residual (autograd/fusion.py): one
# definition for NumPy and cupy.fuse. LayerNorm's sums end their chains (@fused_reduction);
# softmax's max and sum stay outside.

@fused
def exp_shifted_(xp, z, zmax):
    """z = exp(z - max) in place: softmax's numerator, never above 1."""
    z -= zmax
    xp.exp(z, out=z)


@fused
def softmax_backward(xp, g, y, dot, scale):
    """scale * y * (g - <g, y>): the softmax Jacobian applied to g (dot: <g, y> per row)."""
    gx = g - dot
    gx *= y
    gx *= scale
    return gx


@fused_reduction
def centered_square_sum(xp, x, mean):
    """sum((x - mean)^2) over the last axis, in one kernel: LayerNorm's variance times n."""
    d = x - mean
    return xp.sum(d * d, axis=-1)


@fused
def layer_norm_forward_(xp, x, mean, square_sum, n, eps, weight, bias, xhat, out):
    """xhat = (x - mean) * rstd (kept for backward) and out = xhat * weight + bias, with
    rstd = 1 / sqrt(square_sum / n + eps) computed per element from the row's sum (a kernel of
    its own for the (rows, 1) rstd would cost a launch)."""
    xp.subtract(x, mean, out=xhat)
    xhat *= 1.0 / xp.sqrt(square_sum / n + eps)
    xp.multiply(xhat, weight, out=out)
    out += bias


@fused_reduction
def layer_norm_row_sums(xp, g, weight, xhat):
    """sum(gh) + 1j sum(gh xhat) per row, gh = g * weight: two sums in one reduction kernel, as
    the real and imaginary parts of one complex sum, which are added independently (each is the
    sum a float reduction would give, in the same precision)."""
    gh = g * weight
    return xp.sum(gh + gh * xhat * 1j, axis=-1)


@fused_reduction
def layer_norm_column_sums(xp, g, xhat):
    """sum(g xhat) + 1j sum(g) over rows: the weight's and the bias's gradients in one kernel."""
    return xp.sum(g * xhat + g * 1j, axis=0)


@fused
def layer_norm_backward_(xp, g, weight, xhat, sum_gh, sum_ghx, square_sum, n, eps, gx):
    """gx = rstd (gh - mean(gh) - xhat mean(gh xhat)), gh = g * weight, from the row sums."""
    xp.multiply(g, weight, out=gx)
    gx -= sum_gh / n
    gx -= xhat * (sum_ghx / n)
    gx *= 1.0 / xp.sqrt(square_sum / n + eps)


class Softmax(Function):
    """softmax(scale * x) over the last axis, optionally causally masked; numerically stable."""

    @staticmethod
    def forward(ctx, x, scale, causal):
        xp = get_array_module(x)
        z = x * x.dtype.type(scale)
        if causal:
            z += _causal_bias(xp, x.shape[-2], x.shape[-1], x.dtype)
        exp_shifted_(z, z.max(axis=-1, keepdims=True))
        z /= z.sum(axis=-1, keepdims=True)
        ctx.scale = scale
        ctx.save_for_backward(z)
        return z

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved
        dot = (g * y).sum(axis=-1, keepdims=True)
        return softmax_backward(g, y, dot, ctx.scale)


#: LayerNorm inputs at least this large run the numba kernels on the CPU (below that, importing
#: numba costs more than it saves: a test's tiny model never does).
COMPILED_LAYER_NORM_SIZE = 1 << 16


class LayerNorm(Function):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis, fused both ways: on a GPU
    the row kernels of row_kernels.py (one launch forward; backward one for the input's gradient,
    which also adds the residual path's gradient, and one for the weight's and bias's, written
    into their main_grad when the engine offers it); numba
    kernels of the same formulas for large arrays on the CPU (_layer_norm_cpu.py); the chains
    above for small CPU arrays and what the row kernels do not take."""
    reads_16_bit = True     # the row kernels read the 16-bit residual stream
    reads_16_bit_grads = True       # and a 16-bit output gradient, writing a 16-bit input gradient

    adds_pending_grads = True
    writes_grad_destinations = True

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        xp = get_array_module(x)
        x2 = x.reshape(-1, x.shape[-1])
        fmt = precision.kept_in_16_bit() if xp is not numpy else None
        stream = sixteen_bit_form(x2, fmt) if fmt else None
        x2 = x2 if stream is None else stream       # the residual stream's 16-bit array, or its copy
        ctx.path = ("numba" if xp is numpy and x.size >= COMPILED_LAYER_NORM_SIZE
                    else "rows" if row_kernels.gpu_supports(x2) and weight.flags.c_contiguous
                    and bias.flags.c_contiguous else "chains")
        if ctx.path == "chains" and precision.format_of(x2.dtype):
            x2 = precision.to_float32(x2)      # the 16-bit residual stream where the row kernels are not run
        if ctx.path == "numba":
            from . import _layer_norm_cpu          # numba is imported for large arrays only
            out, xhat, rstd = _layer_norm_cpu.forward(x2, weight, bias, eps)
        elif ctx.path == "rows":
            # under --fp16/--bf16 the kernel keeps x itself in 16 bits (precision.py), not xhat: the
            # 16-bit residual stream's x as it is
            out, xhat, rstd = row_kernels.layer_norm_forward(x2, weight, bias, eps, keep=fmt)
        if ctx.path != "chains":
            ctx.save_for_backward(xhat, rstd, weight)
            return out.reshape(x.shape)
        # three kernels: the mean, the centred squares' sum, then xhat and the output
        mean = x2.mean(axis=-1, keepdims=True)
        square_sum = centered_square_sum(x2, mean).reshape(-1, 1)
        xhat, out = xp.empty_like(x2), xp.empty_like(x2)
        layer_norm_forward_(x2, mean, square_sum, float(x2.shape[-1]), eps, weight, bias, xhat, out)
        ctx.eps = eps
        ctx.save_for_backward(xhat, square_sum, weight)
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, g):
        # xhat and rstd, the square sum for chains, or for rows under --fp16/--bf16 x in 16 bits
        # and each row's (mean, 1/std), from which the kernels recompute xhat
        xhat, statistic, weight = ctx.saved
        ctx.mark_fresh(1, 2)            # made here (two parts of one complex sum on a GPU)
        need_x, need_w, need_b = ctx.needs_input_grad
        if ctx.path != "rows" and precision.format_of(g.dtype):
            g = precision.to_float32(g)     # a 16-bit gradient where the row kernels are not run
        g2 = g.reshape(xhat.shape)
        if ctx.path == "numba":
            from . import _layer_norm_cpu
            gx, gw, gb = _layer_norm_cpu.backward(g2, weight, xhat, statistic)
            return gx.reshape(g.shape), gw, gb
        gw = gb = gx = None
        if need_w and need_b and ctx.path == "rows":      # one kernel, into main_grad if offered
            g2 = _c_ordered(g2)
            gw, gb = row_kernels.layer_norm_column_sums(g2, xhat, statistic, ctx.destination(1),
                                                        ctx.destination(2))
        elif need_w and need_b:
            sums = layer_norm_column_sums(g2, xhat)
            gw, gb = sums.real, sums.imag       # strided views: the leaves' gradients copy them
        elif need_w or need_b:
            if precision.format_of(g2.dtype):       # one of the two (a frozen weight): float32 sums
                g2 = precision.to_float32(g2)
            if ctx.path == "rows" and precision.format_of(xhat.dtype):      # the kept input
                xhat = row_kernels.xhat_from_input(xhat, statistic, g2.dtype)
            gw, gb = ((g2 * xhat).sum(axis=0), None) if need_w else (None, bias_grad(g2))
        if need_x and ctx.path == "rows":
            gx = row_kernels.layer_norm_backward(_c_ordered(g2), weight, xhat, statistic,
                                                 _pending_rows(ctx, g, xhat.shape)).reshape(g.shape)
        elif need_x:
            # dx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat)), gh = g * weight
            sums = layer_norm_row_sums(g2, weight, xhat).reshape(-1, 1)
            gx = get_array_module(g2).empty_like(g2)
            layer_norm_backward_(g2, weight, xhat, sums.real, sums.imag, statistic, float(xhat.shape[-1]),
                                 ctx.eps, gx)
            gx = gx.reshape(g.shape)
        return gx, gw, gb


def _c_ordered(a):
    """a, or a C-ordered copy of it (an incoming gradient may be a strided view)."""
    return a if a.flags.c_contiguous else get_array_module(a).ascontiguousarray(a)


def _pending_rows(ctx, g, shape):
    """The input's gradient so far (the residual path's), as rows, when the row kernel can add it
    (same shape and dtype, C-ordered); the engine then takes the kernel's result as the sum."""
    pending = ctx.pending_grads[0] if ctx.pending_grads else None
    if pending is None or pending.shape != g.shape or pending.dtype != g.dtype or not pending.flags.c_contiguous:
        return None
    ctx.sum_pending(0)
    return pending.reshape(shape)


#: Whether device id arrays were checked on the host before their upload (ids_checked_on_host).
_device_ids_checked = False


@contextlib.contextmanager
def ids_checked_on_host():
    """Inside this block check_ids takes device arrays as checked: their caller checked the host
    arrays they were uploaded from (--cuda-graph's static inputs, where the check would be a host
    synchronisation inside a captured step)."""
    global _device_ids_checked
    previous, _device_ids_checked = _device_ids_checked, True
    try:
        yield
    finally:
        _device_ids_checked = previous


def check_ids(ids, size, what, fix, ignore_index=None):
    """Integer ids within [0, size) (ignore_index excepted), or one InputError sentence.

    Callers check ids while they are still host arrays (free); on a GPU array the smallest and
    largest id come back in one transfer: one host synchronisation, never a boolean-mask index
    (whose output size would need another)."""
    if ids.dtype.kind not in "iu":
        raise InputError(f"{what} must be integers, got dtype {ids.dtype}; convert with .astype(int)")
    if ids.size == 0 or (_device_ids_checked and get_array_module(ids) is not numpy):
        return
    xp = get_array_module(ids)
    if ignore_index is not None:
        kept = xp.where(ids == ignore_index, 0, ids)      # 0 is in range: it never fails the check
        lo, hi = kept.min(), kept.max()
    else:
        lo, hi = ids.min(), ids.max()
    lo, hi = (int(v) for v in to_numpy(xp.stack([lo, hi])))
    if lo < 0 or hi >= size:
        bad = hi if hi >= size else lo
        raise InputError(f"{what} {bad} is outside the vocabulary [0, {size}); {fix}")


class Embedding(Function):
    """weight[ids]; backward scatter-adds rows (a token seen twice gets both gradients)."""

    @staticmethod
    def forward(ctx, ids, weight):
        check_ids(ids, weight.shape[0], "token id",
                  "tokenize with the embedding's vocabulary or give the embedding more rows")
        ctx.ids, ctx.shape, ctx.dtype = ids, weight.shape, weight.dtype
        return weight[ids]

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        gw = xp.zeros(ctx.shape, ctx.dtype)
        scatter_add(gw, ctx.ids.reshape(-1), g.reshape(-1, ctx.shape[1]))
        ctx.mark_fresh(1)
        return None, gw


class CrossEntropy(Function):
    """Mean over tokens of -log softmax(logits)[target]; tokens equal to ignore_index count not.

    Backward is (softmax - one_hot) / n, computed in the saved softmax buffer itself.
    """

    float32_output = True       # the loss stays in float32 under 16-bit storage (precision.py)

    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        xp = get_array_module(logits)
        vocab = logits.shape[-1]
        if targets.shape != logits.shape[:-1]:
            raise InputError(f"targets of shape {tuple(targets.shape)} do not match logits of shape "
                             f"{tuple(logits.shape)}; targets need the logits' shape without the last axis")
        check_ids(targets, vocab, "target id", "targets must index the logits' last axis",
                   ignore_index)
        z = logits.reshape(-1, vocab) - logits.reshape(-1, vocab).max(axis=-1, keepdims=True)
        t = targets.reshape(-1)
        valid = xp.ones(t.shape, bool) if ignore_index is None else t != ignore_index
        t = xp.where(valid, t, 0)
        rows = xp.arange(t.size)
        target_z = z[rows, t]
        xp.exp(z, out=z)
        sum_exp = z.sum(axis=-1)
        z /= sum_exp[:, None]
        # The token count stays an array: reading it on the host would synchronise a GPU.
        count = xp.maximum(valid.sum(), 1).astype(logits.dtype)
        losses = (xp.log(sum_exp) - target_z) * valid
        ctx.save_for_backward(z, t, valid)
        ctx.count, ctx.shape = count, logits.shape
        return losses.sum(keepdims=False) / count

    @staticmethod
    def backward(ctx, g):
        probs, t, valid = ctx.saved
        xp = get_array_module(probs)
        # The saved softmax is ours alone and freed right after: reuse it as the gradient.
        probs[xp.arange(t.size), t] -= 1
        probs *= (valid * (g / ctx.count)).astype(probs.dtype)[:, None]
        return probs.reshape(ctx.shape), None


def softmax(x, scale=1.0, causal=False):
    """softmax(scale * x) over the last axis; causal masks keys after each query (last two axes)."""
    return Softmax.apply(x, scale=scale, causal=causal)


def layer_norm(x, weight, bias, eps=1e-5):
    if weight.shape != x.shape[-1:] or bias.shape != x.shape[-1:]:
        raise InputError(f"LayerNorm weight {tuple(weight.shape)} and bias {tuple(bias.shape)} must "
                         f"match the last axis of input {tuple(x.shape)}")
    return LayerNorm.apply(x, weight, bias, eps=eps)


def embedding(ids, weight):
    """Rows of weight (vocab, hidden) for integer ids of any shape."""
    ids = ids.data if isinstance(ids, Tensor) else ids
    return Embedding.apply(ids, weight)


def cross_entropy(logits, targets, ignore_index=None):
    targets = targets.data if isinstance(targets, Tensor) else targets
    return CrossEntropy.apply(logits, targets, ignore_index=ignore_index)
