"""Rotary position embeddings (Su et al., 2021, RoFormer) in the convention of Hugging Face's
Llama and Megatron-LM: the first `rotary` channels of each head are two halves, and channel i
and channel i + rotary/2 turn together by the angle position * base^(-2i/rotary). A rotation,
so backward is the same rotation by minus the angle: exact, with no saved activations."""
import numpy

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
def rotate_pairs(xp, first, second, cos, sin):
    """(first cos - second sin, second cos + first sin): each pair turned by its angle."""
    turned_first = first * cos
    turned_first -= second * sin
    turned_second = second * cos
    turned_second += first * sin
    return turned_first, turned_second


class Rotary(Function):
    """x (b, t, heads, d) with its first 2 * cos.shape[1] channels of each head rotated; cos and
    sin (t, rotary / 2) are the angles' of the tokens x holds, in order."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.cos, ctx.sin = cos, sin
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        return _rotate(g, ctx.cos, -ctx.sin)      # the transpose of a rotation is its inverse


def _rotate(x, cos, sin):
    half = cos.shape[1]
    out = get_array_module(x).empty_like(x)
    cos, sin = cos[:, None, :], sin[:, None, :]      # broadcast over heads
    out[..., :half], out[..., half:2 * half] = rotate_pairs(x[..., :half], x[..., half:2 * half], cos, sin)
    out[..., 2 * half:] = x[..., 2 * half:]          # --rotary-percent below 1: the rest passes
    return out


def rotary(x, cos, sin):
    """Rotary position embedding of x (b, t, heads, d) at the angles cos, sin (t, rotary / 2),
    e.g. numpy.cos(rotary_angles(positions, rotary, base)) in x's dtype."""
    if x.ndim != 4 or cos.shape != sin.shape or cos.shape[0] != x.shape[1] or 2 * cos.shape[1] > x.shape[3]:
        raise InputError(f"rotary embedding needs x (b, t, heads, d) and angles (t, r/2) with r <= d, got "
                         f"{tuple(x.shape)} and {tuple(cos.shape)}")
    return Rotary.apply(x, cos, sin)
