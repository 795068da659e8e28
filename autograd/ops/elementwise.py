"""Pointwise functions: exp, log, tanh and GeLU (tanh approximation as GPT-2, and exact erf)."""
import math

import numpy

from .. import precision, sixteen_bit_kernels
from ..backend import get_array_module
from ..errors import InputError
from ..function import Function
from ..fusion import fused
from .arithmetic import bias_grad_by_gemv, bias_grad_to


class Exp(Function):
    @staticmethod
    def forward(ctx, x):
        out = get_array_module(x).exp(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved[0]


class Log(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return get_array_module(x).log(x)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.saved[0]


class Tanh(Function):
    @staticmethod
    def forward(ctx, x):
        out = get_array_module(x).tanh(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        t = ctx.saved[0]
        return g * (1 - t * t)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715
_GELU_CUBIC_GRAD = 3 * _GELU_CUBIC * _SQRT_2_OVER_PI
_RSQRT_2 = 1 / math.sqrt(2)
_RSQRT_2PI = 1 / math.sqrt(2 * math.pi)


# The GeLU chains (autograd/fusion.py): each formula is written once, in a plain helper, and used
# with and without the bias that precedes GeLU in the MLP. The helpers update their own
# temporaries in place, which costs nothing on the GPU and saves NumPy an array per step.

def _gelu_tanh(xp, x):
    """(0.5 x (1 + t), t) with t = tanh(sqrt(2/pi) (x + 0.044715 x^3)); t is kept for backward."""
    t = x * x
    t *= _GELU_CUBIC
    t += 1
    t *= x
    t *= _SQRT_2_OVER_PI
    xp.tanh(t, out=t)
    out = t + 1
    out *= x
    out *= 0.5
    return out, t


def _gelu_tanh_grad(xp, g, x, t):
    """g * d/dx = g (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2))."""
    grad = x * x
    grad *= _GELU_CUBIC_GRAD
    grad += _SQRT_2_OVER_PI
    grad *= x
    one_minus_t2 = t * t
    one_minus_t2 *= -1
    one_minus_t2 += 1
    grad *= one_minus_t2
    grad += xp.add(t, 1, out=one_minus_t2)      # 1 + t, in the buffer no longer needed
    grad *= 0.5
    grad *= g
    return grad


def _gelu_erf(xp, x):
    """(x Phi(x), Phi(x)): the exact GeLU and the normal CDF kept for backward."""
    cdf = x * _RSQRT_2
    xp.erf(cdf, out=cdf)
    cdf += 1
    cdf *= 0.5
    return x * cdf, cdf


def _gelu_erf_grad(xp, g, x, cdf):
    """g (Phi(x) + x phi(x))."""
    grad = x * x
    grad *= -0.5
    xp.exp(grad, out=grad)
    grad *= _RSQRT_2PI
    grad *= x
    grad += cdf
    grad *= g
    return grad


@fused
def gelu_tanh(xp, x):
    return _gelu_tanh(xp, x)


@fused
def gelu_tanh_backward(xp, g, x, t):
    return _gelu_tanh_grad(xp, g, x, t)


@fused
def bias_gelu_tanh(xp, y, b):
    return _gelu_tanh(xp, y + b)


@fused
def bias_gelu_tanh_backward(xp, g, y, b, t):
    return _gelu_tanh_grad(xp, g, y + b, t)


@fused
def bias_gelu_tanh_output(xp, y, b):
    """bias_gelu_tanh's output alone (t is not written)."""
    return _gelu_tanh(xp, y + b)[0]


def bias_gelu_tanh_twin(y, b, out, unused, cubic, sqrt_2_over_pi, n, cols):
    """sixteen_bit_kernels.py's bias + GeLU kernel in NumPy: bias_gelu_tanh_output's chain on y + b
    widened to float32, rounded into 16-bit `out` (the constants are this module's)."""
    out[...] = _gelu_tanh(numpy, y.astype(numpy.float32) + b.astype(numpy.float32))[0]


def bias_gelu_tanh_keeping_input_twin(y, b, out, kept, cubic, sqrt_2_over_pi, n, cols):
    """The variant that keeps GeLU's input: also y + b in float32, rounded into 16-bit `kept`."""
    x = y.astype(numpy.float32) + b.astype(numpy.float32)
    kept[...] = x
    out[...] = _gelu_tanh(numpy, x)[0]


def bias_gelu_tanh_backward_twin(g, y, b, out, cubic, sqrt_2_over_pi, cubic_grad, n, cols):
    """sixteen_bit_kernels.py's bias + GeLU backward kernel in NumPy: the recomputing chain on the
    float32 widenings, rounded into 16-bit `out`."""
    x = y.astype(numpy.float32) + b.astype(numpy.float32)
    out[...] = _gelu_tanh_grad(numpy, g.astype(numpy.float32), x, _gelu_tanh(numpy, x)[1])


@fused
def bias_gelu_tanh_backward_recomputed(xp, g, y, b):
    """bias_gelu_tanh_backward with t recomputed from y + b by forward's own expression."""
    x = y + b
    return _gelu_tanh_grad(xp, g, x, _gelu_tanh(xp, x)[1])


@fused
def gelu_erf(xp, x):
    return _gelu_erf(xp, x)


@fused
def gelu_erf_backward(xp, g, x, cdf):
    return _gelu_erf_grad(xp, g, x, cdf)


@fused
def bias_gelu_erf(xp, y, b):
    return _gelu_erf(xp, y + b)


@fused
def bias_gelu_erf_backward(xp, g, y, b, cdf):
    return _gelu_erf_grad(xp, g, y + b, cdf)


@fused
def bias_gelu_erf_output(xp, y, b):
    """bias_gelu_erf's output alone (Phi is not written)."""
    return _gelu_erf(xp, y + b)[0]


@fused
def bias_gelu_erf_backward_recomputed(xp, g, y, b):
    """bias_gelu_erf_backward with Phi recomputed from y + b by forward's own expression."""
    x = y + b
    return _gelu_erf_grad(xp, g, x, _gelu_erf(xp, x)[1])


class GeluTanh(Function):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's `gelu_new`."""

    @staticmethod
    def forward(ctx, x):
        out, t = gelu_tanh(x)
        ctx.save_for_backward(x, t)
        return out

    @staticmethod
    def backward(ctx, g):
        return gelu_tanh_backward(g, *ctx.saved)


class GeluErf(Function):
    """x Phi(x): the exact GeLU."""

    @staticmethod
    def forward(ctx, x):
        out, cdf = gelu_erf(x)
        ctx.save_for_backward(x, cdf)
        return out

    @staticmethod
    def backward(ctx, g):
        return gelu_erf_backward(g, *ctx.saved)


_BIAS_GELU = {"tanh": (bias_gelu_tanh, bias_gelu_tanh_backward),
              "none": (bias_gelu_erf, bias_gelu_erf_backward)}
#: on a GPU backward recomputes tanh (or Phi) inside its chain instead of keeping a second
#: activation of the MLP's width (as Megatron's fused bias_gelu does): the same launch count
_BIAS_GELU_RECOMPUTED = {"tanh": (bias_gelu_tanh_output, bias_gelu_tanh_backward_recomputed),
                         "none": (bias_gelu_erf_output, bias_gelu_erf_backward_recomputed)}


#: float32 tanh-GeLU inputs at least this large run the numba kernels on the CPU (_gelu_cpu.py);
#: below that, importing numba costs more than it saves (a test's tiny model never does).
COMPILED_GELU_SIZE = 1 << 16


def compiled_gelu(approximate, dtype, size, on_cpu):
    """Whether bias-GeLU runs the float32 CPU kernel (which keeps no tanh for backward); also what
    the memory plan (perf/memory.py) counts."""
    return approximate == "tanh" and numpy.dtype(dtype) == numpy.float32 and size >= COMPILED_GELU_SIZE and on_cpu


class BiasGelu(Function):
    """gelu(y + b) in one pass each way (Megatron's fused bias_gelu): y + b is never stored;
    backward recomputes it from the saved y and b inside the chain, and on a GPU tanh (or Phi)
    too; for large float32 arrays on the CPU, inside a compiled kernel that also recomputes tanh
    (_gelu_cpu.py). Small CPU arrays keep tanh (or Phi). A GPU's 16-bit activations: forward is
    sixteen_bit_kernels.py's kernel, the GEMM's 16-bit y in, the 16-bit output out."""

    reads_16_bit = True
    reads_16_bit_grads = True
    writes_grad_destinations = True

    @staticmethod
    def forward(ctx, y, b, approximate):
        # under 16-bit storage the bias's gradient is summed from y's rounded gradient (backward)
        ctx.storage = precision.active()
        ctx.compiled = compiled_gelu(approximate, y.dtype, y.size, get_array_module(y) is numpy)
        if ctx.compiled:
            from . import _gelu_cpu                 # numba is imported for large arrays only
            ctx.save_for_backward(y, b)
            return _gelu_cpu.forward(y, b)
        if get_array_module(y) is numpy:
            chain, ctx.backward_chain = _BIAS_GELU[approximate]
            out, kept = chain(y, b)
            ctx.save_for_backward(y, b, kept)
            return out
        chain, ctx.backward_chain = _BIAS_GELU_RECOMPUTED[approximate]
        ctx.save_for_backward(y, b)
        ctx.on_grid(0)
        fmt = precision.kept_in_16_bit()
        if fmt and approximate == "tanh" and sixteen_bit_kernels.takes_bias_add(y, b, fmt, y_16_bit=True):
            # a GPU's 16-bit activations: y (16-bit, the GEMM's) in, the 16-bit output written
            return sixteen_bit_kernels.bias_gelu_tanh(y, b, fmt, _GELU_CUBIC, _SQRT_2_OVER_PI)
        return chain(precision.to_float32(y) if precision.format_of(y.dtype) else y, b)

    @staticmethod
    def backward(ctx, g):
        ctx.mark_fresh(0, 1)            # both made here: the chain's output and a reduction
        need_bias = ctx.needs_input_grad[1]
        if ctx.compiled:
            from . import _gelu_cpu
            gy, gb = _gelu_cpu.backward(g, *ctx.saved)
            if ctx.storage is not None and need_bias:      # the rounded gradient's GEMV, as below
                gb = bias_grad_by_gemv(precision.round_(gy, ctx.storage))
            return gy, (gb if need_bias else None)
        saved = ctx.saved
        fmt = precision.format_of(saved[0].dtype)
        if fmt and ctx.backward_chain is bias_gelu_tanh_backward_recomputed and \
                sixteen_bit_kernels.takes_bias_add(g, saved[1], fmt, y_16_bit=True) and g.shape == saved[0].shape:
            # a GPU's 16-bit gradients: one kernel writes y's, rounded; the bias's is one GEMV of it
            gy = sixteen_bit_kernels.bias_gelu_tanh_backward(g, *saved, fmt, _GELU_CUBIC, _SQRT_2_OVER_PI,
                                                             _GELU_CUBIC_GRAD)
            return gy, bias_grad_by_gemv(gy, ctx.destination(1)) if need_bias else None
        if fmt:     # y: the 16-bit GEMM output, kept as it came
            saved = (precision.to_float32(saved[0]),) + saved[1:]
        g = precision.to_float32(g) if precision.format_of(g.dtype) else g
        gy = ctx.backward_chain(g, *saved)
        if ctx.storage is not None and need_bias:
            # under 16-bit storage the bias's gradient sums y's gradient as the tape rounds it (in
            # place: the tape's rounding is then exact), in the GEMV a GPU runs on its 16-bit
            # array; Megatron also sums its 16-bit gradient
            precision.round_(gy, ctx.storage)
            return gy, bias_grad_by_gemv(gy, ctx.destination(1))
        gb = bias_grad_to(gy, ctx.destination(1)) if need_bias else None
        return gy, gb


def exp(x):
    return Exp.apply(x)


def log(x):
    return Log.apply(x)


def tanh(x):
    return Tanh.apply(x)


def _check_approximation(approximate):
    if approximate not in _BIAS_GELU:
        raise InputError(f"unknown GeLU approximation {approximate!r}; use 'tanh' or 'none'")


def gelu(x, approximate="tanh"):
    """GeLU; approximate='tanh' as GPT-2 and Megatron use, 'none' for the exact erf form."""
    _check_approximation(approximate)
    return (GeluTanh if approximate == "tanh" else GeluErf).apply(x)


def bias_gelu(y, bias, approximate="tanh"):
    """gelu(y + bias) with the bias over the last axis, fused: the MLP's first bias and its GeLU."""
    _check_approximation(approximate)
    if bias.shape != y.shape[-1:]:
        raise InputError(f"bias of shape {tuple(bias.shape)} must match the last axis of the input "
                         f"{tuple(y.shape)}")
    return BiasGelu.apply(y, bias, approximate=approximate)
