"""SwiGLU (Shazeer, 2020), the Llama family's MLP activation: silu(gate) * up, where gate and up
are the two halves of one projection's output (Megatron's fused fc1 under --swiglu). One Function,
one chain each way, nothing but its input kept for backward (as Megatron's bias_swiglu)."""
import numpy

from .. import llama_kernels, precision
from ..backend import get_array_module
from ..errors import InputError
from ..function import Function
from ..fusion import fused


@fused
def swiglu_forward(xp, gate, up):
    """gate * sigmoid(gate) * up."""
    out = xp.exp(-gate)
    out += 1
    out = gate / out
    out *= up
    return out


@fused
def swiglu_backward_(xp, g, gate, up, d_gate, d_up):
    """d_gate, d_up = (g up s (1 + gate (1 - s)), g gate s), s = sigmoid(gate), written into the
    gradient's two halves (views): silu's derivative is s + gate s (1 - s)."""
    s = xp.exp(-gate)
    s += 1
    s = 1.0 / s
    silu = gate * s
    xp.subtract(silu, silu * s, out=d_gate)
    d_gate += s
    d_gate *= up
    d_gate *= g
    xp.multiply(g, silu, out=d_up)


class SwiGLU(Function):
    """y (..., 2n) = [gate | up] -> silu(gate) * up (..., n). On a GPU's 16-bit arrays one kernel
    of llama_kernels.py each way reads the 16-bit y (kept as it is) and writes 16 bits."""
    reads_16_bit = True     # the kernels read the first GEMM's 16-bit output; the chains get it widened
    reads_16_bit_grads = True

    @staticmethod
    def forward(ctx, y):
        xp = get_array_module(y)
        ctx.fmt = precision.kept_in_16_bit() if xp is not numpy else None
        if ctx.fmt and llama_kernels.takes_swiglu(y, ctx.fmt) and precision.format_of(y.dtype) == ctx.fmt:
            ctx.save_for_backward(y)
            return llama_kernels.swiglu_forward(y, ctx.fmt)
        ctx.fmt = None
        if precision.format_of(y.dtype):
            y = precision.to_float32(y)
        half = y.shape[-1] // 2
        ctx.save_for_backward(y)
        ctx.on_grid(0)
        return swiglu_forward(y[..., :half], y[..., half:])

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved
        ctx.mark_fresh(0)
        if ctx.fmt and llama_kernels.takes_swiglu(y, ctx.fmt, g):
            return llama_kernels.swiglu_backward(g, y, ctx.fmt)
        if precision.format_of(y.dtype):
            y = precision.to_float32(y)
        if precision.format_of(g.dtype):
            g = precision.to_float32(g)
        half = y.shape[-1] // 2
        grad = get_array_module(g).empty_like(y)
        swiglu_backward_(g, y[..., :half], y[..., half:], grad[..., :half], grad[..., half:])
        return grad


def swiglu_forward_twin(y, out, n, half):
    """swiglu_forward_{fmt}_*: the chain on y's float32 widening, rounded as stored."""
    wide = y.astype(numpy.float32).reshape(-1, 2 * int(half))
    out[...] = swiglu_forward(wide[:, :int(half)], wide[:, int(half):]).reshape(out.shape).astype(out.dtype)


def swiglu_backward_twin(g, y, grad, n, half):
    """swiglu_backward_{fmt}_*: the chain on the float32 widenings, each half rounded as stored."""
    half = int(half)
    wide, gw = y.astype(numpy.float32).reshape(-1, 2 * half), g.astype(numpy.float32).reshape(-1, half)
    result = numpy.empty_like(wide)
    swiglu_backward_(gw, wide[:, :half], wide[:, half:], result[:, :half], result[:, half:])
    grad[...] = result.reshape(grad.shape).astype(grad.dtype)


def swiglu(y):
    """silu(gate) * up of y = [gate | up] along the last axis (its size must be even)."""
    if y.shape[-1] % 2:
        raise InputError(f"swiglu splits the last axis into gate and up halves, but it has {y.shape[-1]} "
                         "entries; give it an even size")
    return SwiGLU.apply(y)
