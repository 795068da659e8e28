"""GPT-2's MLP under 16-bit storage as one Function: fc2(gelu(x w1 + b1)), fc2's bias left to the
block's bias + dropout + residual. One Function, so that on a GPU GeLU rides in the two GEMMs'
cuBLASLt epilogues (epilogues.py): forward, the first GEMM adds b1, applies GeLU and keeps GeLU's
input (GELU_AUX_BIAS); backward, the second GEMM's data gradient is multiplied by GeLU's
derivative at that input (DGELU). The bias + GeLU pass each way that a Linear, BiasGelu, Linear
chain makes is gone.

It rounds where those GEMMs store, and nowhere else (precision.py's 16-bit storage):
    a = round(x w1 + b1)                    GeLU's input, kept (x w1 + b1 in float32)
    h = round(gelu(x w1 + b1))              kept for w2's gradient
    y = h w2                                rounded as stored (by the tape on the CPU)
    backward, g y's gradient:
    d = round(gelu'(a) * (g w2^T))          g w2^T in float32, not rounded
    x's gradient d w1^T, w1's x^T d, b1's one GEMV of d, w2's h^T g (into main_grad)
The CPU's emulation computes these numbers on float32 arrays on the 16-bit grid; a GPU's 16-bit
arrays compute them with the epilogues, or, where nvmath-python is absent or a shape is not one
they take, with the GEMMs' float32 results and sixteen_bit_kernels.py's GeLU kernels (the same
numbers). Without 16-bit storage the model keeps Linear, BiasGelu, Linear."""
import numpy

from .. import epilogues, gemm, precision, sixteen_bit_kernels
from ..backend import get_array_module
from ..function import Function, kept_16_bit_copy
from ..fusion import fused
from .arithmetic import Linear, _float32, _weight_grad, bias_grad_by_gemv, constant_vector
from .elementwise import (_GELU_CUBIC, _GELU_CUBIC_GRAD, _SQRT_2_OVER_PI, _gelu_tanh, _gelu_tanh_grad,
                          bias_gelu_tanh_output)


@fused
def gelu_tanh_backward_at(xp, g, x):
    """g * gelu'(x), the tanh form, t recomputed from x by forward's own expression."""
    return _gelu_tanh_grad(xp, g, x, _gelu_tanh(xp, x)[1])


class GeluMLP(Function):
    """fc2(gelu(x @ w1 + b1)), GeLU's tanh form, fc2 without its bias (module docstring)."""
    reads_16_bit = True
    reads_16_bit_grads = True
    writes_grad_destinations = True

    @staticmethod
    def forward(ctx, x, w1, b1, w2):
        ctx.storage = precision.active()
        fmt = precision.format_of(w1.dtype)         # a GPU's 16-bit weights (--fp16/--bf16)
        if fmt is None:
            return GeluMLP._emulated_forward(ctx, x, w1, b1, w2)
        x = x if precision.format_of(x.dtype) == fmt else kept_16_bit_copy(x, fmt)
        xp = get_array_module(x)
        shape = x.shape[:-1] + w1.shape[-1:]
        fused = epilogues.linear_bias_gelu(x, w1, b1) if epilogues.takes(x, w1, b1, fmt, gelu=True) else None
        if fused is not None:
            h, a = fused
        else:       # the GEMM's float32 sums, then the bias and GeLU kernels (the same numbers)
            sums = gemm.matmul(x, w1, out=_float32(x, shape))
            h, a = sixteen_bit_kernels.bias_gelu_tanh(sums, b1, fmt, _GELU_CUBIC, _SQRT_2_OVER_PI, keep_input=True)
        ctx.save_for_backward(x, a, h, w1, w2)
        return gemm.matmul(h, w2, out=xp.empty(shape[:-1] + w2.shape[-1:], w2.dtype))

    @staticmethod
    def _emulated_forward(ctx, x, w1, b1, w2):
        if precision.format_of(x.dtype):
            x = precision.to_float32(x)
        sums = gemm.matmul(x, w1, grid=ctx.storage)
        a = precision.round_(sums + b1, ctx.storage)
        h = precision.round_(bias_gelu_tanh_output(sums, b1), ctx.storage)
        ctx.save_for_backward(x, a, h, w1, w2)
        if ctx.storage is not None:
            ctx.on_grid(0, 1, 2)        # kept in 16 bits on a GPU
        return gemm.matmul(h, w2, grid=ctx.storage)

    @staticmethod
    def backward(ctx, g):
        d = GeluMLP.gelu_input_grad(ctx, g)
        return (GeluMLP.input_grad(ctx, d),) + GeluMLP.parameter_grads(ctx, g, d)

    # backward in three steps, so tensor parallelism can all-reduce x's gradient during the last
    @staticmethod
    def gelu_input_grad(ctx, g):
        """d, the gradient at GeLU's input: 16-bit where the weights are, else float32 rounded."""
        _, a, _, _, w2 = ctx.saved
        fmt = precision.format_of(w2.dtype)
        if fmt is None:
            g = precision.to_float32(g) if precision.format_of(g.dtype) else g
            d = gelu_tanh_backward_at(gemm.matmul(g, w2.T, grid=ctx.storage), a)
            return precision.round_(d, ctx.storage)
        g16 = Linear.sixteen_bit_grad(ctx, g, w2)
        if epilogues.takes(g16, w2.T, None, fmt, gelu=True) and a.flags.c_contiguous:
            d = epilogues.gelu_input_grad(g16, w2, a)
            if d is not None:
                return d
        sums = gemm.matmul(g16, w2.T, out=_float32(g16, a.shape))
        # the kernel's x = a + 0 is a itself
        zeros = constant_vector(a, a.shape[-1], a.dtype, 0)
        return sixteen_bit_kernels.bias_gelu_tanh_backward(sums, a, zeros, fmt, _GELU_CUBIC, _SQRT_2_OVER_PI,
                                                           _GELU_CUBIC_GRAD)

    @staticmethod
    def input_grad(ctx, d, sixteen_bit=True):
        """x's gradient d w1^T; sixteen_bit=False: float32 even where 16-bit gradients flow (one
        all-reduced next, summed in float32 as the CPU's emulation sums it)."""
        if not ctx.needs_input_grad[0]:
            return None
        x, _, _, w1, _ = ctx.saved
        if precision.format_of(w1.dtype) is None:
            return gemm.matmul(d, w1.T, grid=ctx.storage)
        shape = d.shape[:-1] + w1.shape[:1]
        out = get_array_module(d).empty(shape, w1.dtype) if sixteen_bit else _float32(d, shape)
        return gemm.matmul(d, w1.T, out=out)

    @staticmethod
    def parameter_grads(ctx, g, d):
        """(w1's, b1's, w2's gradients), summed in float32 into main_grad where offered."""
        ctx.mark_fresh(1, 2, 3)         # GEMMs' results
        x, _, h, w1, w2 = ctx.saved
        need = ctx.needs_input_grad
        sixteen = precision.format_of(w1.dtype)
        if sixteen:
            g = Linear.sixteen_bit_grad(ctx, g, w1)
        elif precision.format_of(g.dtype):
            g = precision.to_float32(g)
        grid = None if sixteen else ctx.storage
        result = (lambda shape: _float32(g, shape)) if sixteen else None
        gw1 = _weight_grad(x, d, grid, ctx.destination(1), w1, result) if need[1] else None
        gb1 = bias_grad_by_gemv(d, ctx.destination(2)) if need[2] else None
        gw2 = _weight_grad(h, g, grid, ctx.destination(3), w2, result) if need[3] else None
        return gw1, gb1, gw2


def gelu_mlp(x, w1, b1, w2):
    """fc2(gelu(x @ w1 + b1)) without fc2's bias, GeLU's tanh form, as one Function (GeluMLP)."""
    return GeluMLP.apply(x, w1, b1, w2)
