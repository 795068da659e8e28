"""Pointwise functions: exp, log, tanh and GeLU (tanh approximation as GPT-2, and exact erf)."""
import math

from ..backend import erf, get_array_module
from ..function import Function


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


class GeluTanh(Function):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's `gelu_new`."""

    @staticmethod
    def forward(ctx, x):
        xp = get_array_module(x)
        x2 = x * x
        t = xp.tanh(_SQRT_2_OVER_PI * x * (1 + _GELU_CUBIC * x2))
        ctx.save_for_backward(x, t)
        out = t + 1
        out *= x
        out *= 0.5
        return out

    @staticmethod
    def backward(ctx, g):
        x, t = ctx.saved
        # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2)
        inner = (3 * _GELU_CUBIC * _SQRT_2_OVER_PI) * (x * x)
        inner += _SQRT_2_OVER_PI
        inner *= x
        inner *= 1 - t * t
        inner += 1 + t
        inner *= 0.5
        inner *= g
        return inner


class GeluErf(Function):
    """x Phi(x): the exact GeLU."""

    @staticmethod
    def forward(ctx, x):
        cdf = 0.5 * (1 + erf(x * (1 / math.sqrt(2))))
        ctx.save_for_backward(x, cdf)
        return x * cdf

    @staticmethod
    def backward(ctx, g):
        x, cdf = ctx.saved
        pdf = get_array_module(x).exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
        return g * (cdf + x * pdf)


def exp(x):
    return Exp.apply(x)


def log(x):
    return Log.apply(x)


def tanh(x):
    return Tanh.apply(x)


def gelu(x, approximate="tanh"):
    """GeLU; approximate='tanh' as GPT-2 and Megatron use, 'none' for the exact erf form."""
    if approximate == "tanh":
        return GeluTanh.apply(x)
    if approximate == "none":
        return GeluErf.apply(x)
    from ..errors import InputError
    raise InputError(f"unknown GeLU approximation {approximate!r}; use 'tanh' or 'none'")
