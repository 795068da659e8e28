"""RMSNorm (Zhang & Sennrich, 2019), the Llama family's normalisation: x / sqrt(mean(x^2) + eps)
* weight over the last axis, no centring and no bias. One Function with a hand-written backward,
its elementwise work in chains written once for NumPy and cupy.fuse (autograd/fusion.py), as
LayerNorm's in nn.py."""
import numpy

from .. import llama_kernels, precision
from ..backend import get_array_module
from ..function import Function, sixteen_bit_form
from ..fusion import fused, fused_reduction


@fused_reduction
def row_square_sums(xp, x):
    """sum(x^2) over the last axis, in one kernel: RMSNorm's mean square times n."""
    return xp.sum(x * x, axis=-1)


@fused
def rms_norm_forward_(xp, x, squares, n, eps, weight, xhat, out):
    """xhat = x * rstd (kept for backward) and out = xhat * weight, rstd = 1 / sqrt(squares / n +
    eps) per element from the row's sum (as layer_norm_forward_, to save a launch)."""
    xp.multiply(x, 1.0 / xp.sqrt(squares / n + eps), out=xhat)
    xp.multiply(xhat, weight, out=out)


@fused_reduction
def rms_norm_row_sums(xp, g, weight, xhat):
    """sum(g * weight * xhat) per row: the one row statistic backward needs."""
    return xp.sum(g * weight * xhat, axis=-1)


@fused_reduction
def rms_norm_weight_grad(xp, g, xhat):
    """sum(g * xhat) over rows: the gain's gradient in one kernel."""
    return xp.sum(g * xhat, axis=0)


@fused
def rms_norm_backward_(xp, g, weight, xhat, row_sum, squares, n, eps, gx):
    """gx = rstd (gh - xhat mean(gh xhat)), gh = g * weight: xhat's rows are x scaled by rstd,
    and the scale itself depends on x through the mean square, which gives the second term."""
    xp.multiply(g, weight, out=gx)
    gx -= xhat * (row_sum / n)
    gx *= 1.0 / xp.sqrt(squares / n + eps)


class RMSNorm(Function):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, fused both ways (module doc). On a
    GPU's 16-bit arrays the kernels of llama_kernels.py run instead: one launch forward, which
    keeps the 16-bit input itself and each row's sum of squares; backward one for the gain's
    gradient (into its main_grad when the engine offers it) and one for the input's, which also
    adds the residual path's 16-bit gradient when the engine offers that (Node.run)."""
    reads_16_bit = True     # the 16-bit residual stream into the kernels; the chains get it widened
    reads_16_bit_grads = True
    adds_pending_grads = True
    writes_grad_destinations = True

    @staticmethod
    def forward(ctx, x, weight, eps):
        xp = get_array_module(x)
        x2 = x.reshape(-1, x.shape[-1])
        ctx.eps, ctx.fmt = eps, precision.kept_in_16_bit() if xp is not numpy else None
        stream = sixteen_bit_form(x2, ctx.fmt) if ctx.fmt else None
        if stream is not None and llama_kernels.takes_rms_norm(stream, weight, ctx.fmt):
            out, squares = llama_kernels.rms_norm_forward(stream, weight, eps, ctx.fmt)
            ctx.save_for_backward(stream, squares, weight)
            return out.reshape(x.shape)
        ctx.fmt = None
        if precision.format_of(x2.dtype):
            x2 = precision.to_float32(x2)
        squares = row_square_sums(x2).reshape(-1, 1)
        xhat, out = xp.empty_like(x2), xp.empty_like(x2)
        rms_norm_forward_(x2, squares, float(x2.shape[-1]), eps, weight, xhat, out)
        ctx.save_for_backward(xhat, squares, weight)
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, g):
        if ctx.fmt:
            return RMSNorm._sixteen_bit_backward(ctx, g)
        if precision.format_of(g.dtype):
            g = precision.to_float32(g)
        xhat, squares, weight = ctx.saved
        need_x, need_w = ctx.needs_input_grad
        g2 = g.reshape(xhat.shape)
        gx = gw = None
        if need_w:
            gw = rms_norm_weight_grad(g2, xhat)
            ctx.mark_fresh(1)
        if need_x:
            row_sum = rms_norm_row_sums(g2, weight, xhat).reshape(-1, 1)
            gx = get_array_module(g2).empty_like(g2)
            rms_norm_backward_(g2, weight, xhat, row_sum, squares, float(xhat.shape[-1]), ctx.eps, gx)
            gx = gx.reshape(g.shape)
        return gx, gw

    @staticmethod
    def _sixteen_bit_backward(ctx, g):
        x, squares, weight = ctx.saved
        need_x, need_w = ctx.needs_input_grad
        g2 = g.reshape(x.shape)
        if not g2.flags.c_contiguous:
            g2 = get_array_module(g2).ascontiguousarray(g2)
        gw = gx = None
        if need_w:
            gw = llama_kernels.rms_norm_weight_grad(g2, x, squares, ctx.eps, ctx.fmt, ctx.destination(1))
            ctx.mark_fresh(1)
        if need_x:
            # the input's whole 16-bit gradient so far, where the engine offers it (_rounded_before_use)
            pending = ctx.pending_grads[0] if ctx.pending_grads else None
            if pending is not None and not pending.flags.c_contiguous:
                pending = None
            gx = llama_kernels.rms_norm_backward(g2, weight, x, squares, ctx.eps, ctx.fmt,
                                                 None if pending is None else pending.reshape(x.shape))
            gx = gx.reshape(g.shape)
            if pending is not None:
                ctx.sum_pending(0)
        return gx, gw


def rms_norm_forward_twin(x, weight, out, squares, cols, n, eps):
    """rms_norm_forward_{fmt}_*: the chains' numbers on x's float32 widening, rounded as stored."""
    wide = x.astype(numpy.float32)
    squares[...] = row_square_sums(wide)
    xhat, result = numpy.empty_like(wide), numpy.empty_like(wide)
    rms_norm_forward_(wide, squares.reshape(-1, 1), float(n), float(eps), weight.astype(numpy.float32), xhat,
                      result)
    out[...] = result.astype(out.dtype)


def _xhat(x, squares, n, eps):
    """forward's xhat, recomputed with its expression from the kept input and sums of squares."""
    return x.astype(numpy.float32) * (1.0 / numpy.sqrt(squares.reshape(-1, 1) / float(n) + float(eps)))


def rms_norm_weight_grad_twin(g, x, squares, gw, rows, cols, n, eps, accumulate):
    """rms_norm_weight_grad_{fmt}_*: the chain's column sums, written into or added to gw."""
    total = rms_norm_weight_grad(g.astype(numpy.float32), _xhat(x, squares, n, eps))
    if accumulate:
        gw += total
    else:
        gw[...] = total


def rms_norm_backward_twin(g, weight, x, squares, pending, gx, cols, n, eps, add_pending):
    """rms_norm_backward_{fmt}_*: the chains' input gradient, rounded as the tape rounds it; with
    add_pending, plus the pending 16-bit gradient in float32, rounded again (the engine's sum)."""
    wide, w = g.astype(numpy.float32), weight.astype(numpy.float32)
    xhat = _xhat(x, squares, n, eps)
    row_sum = rms_norm_row_sums(wide, w, xhat).reshape(-1, 1)
    result = numpy.empty_like(wide)
    rms_norm_backward_(wide, w, xhat, row_sum, squares.reshape(-1, 1), float(n), float(eps), result)
    rounded = result.astype(gx.dtype)
    if add_pending:
        rounded = (pending.astype(numpy.float32) + rounded.astype(numpy.float32)).astype(gx.dtype)
    gx[...] = rounded


def rms_norm(x, weight, eps=1e-5):
    """RMSNorm of x (..., n) with gain weight (n,): HF's LlamaRMSNorm, Megatron's RMSNorm."""
    return RMSNorm.apply(x, weight, eps=eps)
