"""residual + dropout(y), and residual + y + bias, on the CPU in float32, compiled by numba: one
pass over the rows, shared among the CPU budget's threads, where the chain
(dropouts.dropout_add_forward) makes four NumPy passes with temporaries after the draw wrote its
numbers, and bias_add_residual's chain two passes and a copy of each block into the output.
Measured in `bench step --profile` on 2 cores, the branch ends without dropout took 26 ms a step
forward at GPT-2 124M's shape (24 of 1,024 x 768) by the chain and 13 ms here; 18 and 5 ms at the
reference model's (8 of 2,048 x 512). The keep mask comes made (random's
keep_mask hashes and compares in one pass). The arithmetic is the chain's, operation by
operation and without fused multiply-adds, so the two agree bitwise (tested)."""
import numba
import numpy

from ..threads import use_numba_threads


@numba.njit(parallel=True, cache=True, error_model="numpy")
def _dropout_add(y, keep, residual, scale, out):
    rows, n = y.shape
    for r in numba.prange(rows):
        for c in range(n):
            dropped = y[r, c] * numpy.float32(keep[r, c])
            out[r, c] = dropped * scale + residual[r, c]


@numba.njit(parallel=True, cache=True, error_model="numpy")
def _bias_dropout_add(y, bias, keep, residual, scale, out):
    rows, n = y.shape
    for r in numba.prange(rows):
        for c in range(n):
            dropped = (y[r, c] + bias[c]) * numpy.float32(keep[r, c])
            out[r, c] = dropped * scale + residual[r, c]


def dropout_add(y, keep, residual, scale, bias=None):
    """residual + (y + bias) * keep * scale of C-contiguous float32 y and residual of one shape
    (and a float32 bias of their last dimension, or None)."""
    out = numpy.empty_like(y)
    y2, keep2, residual2, out2 = _rows(y, keep, residual, out)
    use_numba_threads()
    if bias is None:
        _dropout_add(y2, keep2, residual2, numpy.float32(scale), out2)
    else:
        _bias_dropout_add(y2, bias, keep2, residual2, numpy.float32(scale), out2)
    return out


@numba.njit(parallel=True, cache=True, error_model="numpy")
def _bias_add_residual(y, bias, residual, out):
    rows, n = y.shape
    for r in numba.prange(rows):
        for c in range(n):
            out[r, c] = (y[r, c] + bias[c]) + residual[r, c]


def bias_add_residual(y, bias, residual):
    """residual + (y + bias) of C-contiguous float32 y and residual of one shape and a bias of
    their last dimension: the chain's two additions in its order."""
    out = numpy.empty_like(y)
    y2, residual2, out2 = _rows(y, residual, out)
    use_numba_threads()
    _bias_add_residual(y2, bias, residual2, out2)
    return out


def _rows(*arrays):
    """Each array as the (rows, width) view the kernels walk (width: the last dimension)."""
    return [a.reshape(-1, a.shape[-1]) for a in arrays]
