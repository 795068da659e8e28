"""Rotary position embeddings (Su et al., 2021, RoFormer) in the convention of Hugging Face's
Llama and Megatron-LM: the first `rotary` channels of each head are two halves, and channel i
and channel i + rotary/2 turn together by the angle position * base^(-2i/rotary). A rotation,
so backward is the same rotation by minus the angle: exact, with no saved activations."""
import numpy

from .. import llama_kernels, precision
from ..backend import get_array_module
from ..errors import InputError
from ..function import Function
from ..fusion import fused


def rotary_angles(positions, rotary, base):
    """(len(positions), rotary / 2) angles in float64 on the host: position * base^(-2i/rotary).
    Computed in double precision whatever the model's dtype, so the table is exact to rounding
    (Hugging Face computes it in float32; its float64 test swaps in this formula)."""
    inverse_frequency = 1.0 / base ** (numpy.arange(0, rotary, 2, dtype=numpy.float64) / rotary)
    return numpy.outer(numpy.asarray(positions, numpy.float64), inverse_frequency)


@fused
def rotate_pairs_(xp, first, second, cos, sin, turned_first, turned_second):
    """turned_first, turned_second = (first cos - second sin, second cos + first sin): each pair
    turned by its angle, written into the output's two halves (views) in one kernel."""
    xp.multiply(first, cos, out=turned_first)
    turned_first -= second * sin
    xp.multiply(second, cos, out=turned_second)
    turned_second += first * sin


class Rotary(Function):
    """x (b, t, heads, d) with its first 2 * cos.shape[1] channels of each head rotated; cos and
    sin (t, rotary / 2) are the angles' of the tokens x holds, in order, and minus_sin is -sin
    (backward's rotation by minus the angle, kept with the table rather than negated each step).
    On a GPU's 16-bit arrays one kernel of llama_kernels.py each way reads x (a strided view of
    the QKV projection's output, or attention's gradient) and writes 16 bits."""
    reads_16_bit = True     # the kernel reads 16-bit x; the chain gets it widened
    reads_16_bit_grads = True

    @staticmethod
    def forward(ctx, x, cos, sin, minus_sin):
        ctx.cos, ctx.minus_sin = cos, minus_sin
        ctx.fmt = precision.kept_in_16_bit() if get_array_module(x) is not numpy else None
        return _rotate(x, cos, sin, ctx.fmt)

    @staticmethod
    def backward(ctx, g):
        return _rotate(g, ctx.cos, ctx.minus_sin, ctx.fmt)      # the transpose of a rotation is its inverse


def _rotate(x, cos, sin, fmt=None):
    if fmt and llama_kernels.takes_rotary(x, cos, sin, fmt):
        return llama_kernels.rotary(x, cos, sin, fmt)
    if precision.format_of(x.dtype):
        x = precision.to_float32(x)
    half = cos.shape[1]
    out = get_array_module(x).empty_like(x)
    cos, sin = cos[:, None, :], sin[:, None, :]      # broadcast over heads
    rotate_pairs_(x[..., :half], x[..., half:2 * half], cos, sin, out[..., :half], out[..., half:2 * half])
    if 2 * half < x.shape[-1]:                       # --rotary-percent below 1: the rest passes
        out[..., 2 * half:] = x[..., 2 * half:]
    return out


def rotary_twin(flat, cos, sin, out, n, t, heads, d, half, sb, st, sh, sd):
    """rotary_{fmt}_*: the chain on x's float32 widening (x read from `flat` through the element
    strides), rounded as stored."""
    size = flat.itemsize
    x = numpy.lib.stride_tricks.as_strided(flat, out.shape, tuple(int(s) * size for s in (sb, st, sh, sd)))
    out[...] = _rotate(x.astype(numpy.float32), cos, sin).astype(out.dtype)


def rotary(x, cos, sin, minus_sin=None):
    """Rotary position embedding of x (b, t, heads, d) at the angles cos, sin (t, rotary / 2),
    e.g. numpy.cos(rotary_angles(positions, rotary, base)) in x's dtype; minus_sin: -sin, if the
    caller keeps it."""
    if x.ndim != 4 or cos.shape != sin.shape or cos.shape[0] != x.shape[1] or 2 * cos.shape[1] > x.shape[3]:
        raise InputError(f"rotary embedding needs x (b, t, heads, d) and angles (t, r/2) with r <= d, got "
                         f"{tuple(x.shape)} and {tuple(cos.shape)}")
    return Rotary.apply(x, cos, sin, -sin if minus_sin is None else minus_sin)
