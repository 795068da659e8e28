"""The softmax parts of blockwise attention (attention.py) on the CPU in float32, compiled by
numba: the causal mask, row max, exp and row sum of a block of scores in one pass instead of five
NumPy passes, and the same exp again in backward. NumPy's float32 exp runs at about 2 ns a number
on this project's AVX2 machines; _vector_math's exp vectorises (about 0.5 ns). Below -87.3 it
gives 0: a probability under 1e-38 of the row's largest.

The kernels are serial and release the GIL: attention shares its heads among the CPU threads
itself (attention._by_heads). float64 keeps NumPy's path, which is the reference. The dropout
kernels take a keep mask (random's keep_mask: no uniform numbers written) and do the chains'
arithmetic (attention.dropout_, dropout_softmax_backward_) operation by operation, without fused
multiply-adds, so they equal the chains bitwise (tested).
"""
import numba
import numpy

from .._vector_math import FAST, MAX_LANES, exp32 as _exp, lane_max

# Serial kernels that release the GIL; "reassoc" lets the row sums and maxima run in vector lanes.
_COMPILE = dict(FAST, nogil=True, fastmath={"contract", "reassoc", "nnan"})
# The dropout kernels round as the NumPy chains do: no fast-math at all.
_EXACT = dict(cache=True, error_model="numpy", nogil=True)


@numba.njit(**_COMPILE)
def softmax_numerators_(z, keys_before, shift, total):
    """Scores z (heads, rows, keys) become exp(z - row max) in place, row i seeing keys
    [0, keys_before + i] and the rest set to 0; shift and total (heads, rows) get the row max and
    the row sum of the exponentials."""
    heads, rows, keys = z.shape
    lanes = numpy.empty(MAX_LANES, z.dtype)
    for h in range(heads):
        for i in range(rows):
            seen = min(keys_before + i + 1, keys)
            m = lane_max(z[h, i], seen, lanes)
            s = numpy.float32(0.0)
            for j in range(seen):
                e = _exp(z[h, i, j] - m)
                z[h, i, j] = e
                s += e
            for j in range(seen, keys):
                z[h, i, j] = 0.0
            shift[h, i] = m
            total[h, i] = s


@numba.njit(**_COMPILE)
def probabilities_(z, keys_before, lse):
    """Scores z (heads, rows, keys) become exp(z - lse) in place, masked as above: backward's
    recomputed probabilities from forward's log-sum-exp per row."""
    heads, rows, keys = z.shape
    for h in range(heads):
        for i in range(rows):
            seen = min(keys_before + i + 1, keys)
            shift = lse[h, i]
            for j in range(seen):
                z[h, i, j] = _exp(z[h, i, j] - shift)
            for j in range(seen, keys):
                z[h, i, j] = 0.0


@numba.njit(**_COMPILE)
def softmax_backward_(g, y, dot, scale):
    """g (heads, rows, keys) becomes scale * y * (g - dot) in place: the softmax Jacobian."""
    heads, rows, keys = g.shape
    for h in range(heads):
        for i in range(rows):
            d = dot[h, i]
            for j in range(keys):
                g[h, i, j] = scale * y[h, i, j] * (g[h, i, j] - d)


@numba.njit(**_EXACT)
def dropout_(z, keep, scale):
    """z (heads, rows, keys) becomes z * keep * scale in place: inverted dropout."""
    heads, rows, keys = z.shape
    for h in range(heads):
        for i in range(rows):
            for j in range(keys):
                z[h, i, j] = z[h, i, j] * numpy.float32(keep[h, i, j]) * scale


@numba.njit(**_EXACT)
def dropout_softmax_backward_(g, y, keep, dot, dropout_scale, scale):
    """g (the gradient of the dropped probabilities) becomes the scores' gradient, scale * y *
    (g * keep * dropout_scale - dot), and y (the probabilities) becomes y * keep * dropout_scale,
    both in place: the chains' dropout_softmax_backward_ and then dropout_ in one pass."""
    heads, rows, keys = g.shape
    for h in range(heads):
        for i in range(rows):
            d = dot[h, i]
            for j in range(keys):
                kept = numpy.float32(keep[h, i, j])
                p = y[h, i, j]
                grad = g[h, i, j] * kept * dropout_scale
                grad = (grad - d) * p
                g[h, i, j] = grad * scale
                y[h, i, j] = p * kept * dropout_scale
