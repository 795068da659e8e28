"""SwiGLU (Shazeer, 2020), the Llama family's MLP activation: silu(gate) * up, where gate and up
are the two halves of one projection's output (Megatron's fused fc1 under --swiglu). One Function,
one chain each way, nothing but its input kept for backward (as Megatron's bias_swiglu)."""
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
    """y (..., 2n) = [gate | up] -> silu(gate) * up (..., n)."""

    @staticmethod
    def forward(ctx, y):
        half = y.shape[-1] // 2
        ctx.save_for_backward(y)
        ctx.on_grid(0)
        return swiglu_forward(y[..., :half], y[..., half:])

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved
        half = y.shape[-1] // 2
        grad = get_array_module(g).empty_like(y)
        swiglu_backward_(g, y[..., :half], y[..., half:], grad[..., :half], grad[..., half:])
        ctx.mark_fresh(0)
        return grad


def swiglu(y):
    """silu(gate) * up of y = [gate | up] along the last axis (its size must be even)."""
    if y.shape[-1] % 2:
        raise InputError(f"swiglu splits the last axis into gate and up halves, but it has {y.shape[-1]} "
                         "entries; give it an even size")
    return SwiGLU.apply(y)
