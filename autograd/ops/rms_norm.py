"""RMSNorm (Zhang & Sennrich, 2019), the Llama family's normalisation: x / sqrt(mean(x^2) + eps)
* weight over the last axis, no centring and no bias. One Function with a hand-written backward,
its elementwise work in chains written once for NumPy and cupy.fuse (autograd/fusion.py), as
LayerNorm's in nn.py."""
from ..backend import get_array_module
from ..function import Function
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
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, fused both ways (module doc)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xp = get_array_module(x)
        x2 = x.reshape(-1, x.shape[-1])
        squares = row_square_sums(x2).reshape(-1, 1)
        xhat, out = xp.empty_like(x2), xp.empty_like(x2)
        rms_norm_forward_(x2, squares, float(x2.shape[-1]), eps, weight, xhat, out)
        ctx.eps = eps
        ctx.save_for_backward(xhat, squares, weight)
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, g):
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


def rms_norm(x, weight, eps=1e-5):
    """RMSNorm of x (..., n) with gain weight (n,): HF's LlamaRMSNorm, Megatron's RMSNorm."""
    return RMSNorm.apply(x, weight, eps=eps)
