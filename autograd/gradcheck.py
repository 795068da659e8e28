"""gradcheck: compare backward with central finite differences in float64.

eps = 1e-5 balances truncation (eps^2) against roundoff (1e-16 / eps) for float64 models.
The error for each input is max|analytic - numeric| / max(max|numeric|, 1e-8): relative to the
gradient's scale, so entries that are nearly zero do not blow the ratio up.
"""
import numpy

from .backend import get_array_module, to_numpy
from .errors import InputError
from .engine import backward
from .tensor import Tensor, no_grad


def _projected(fn, inputs, weights):
    """<weights, fn(*inputs)> as a float: a random projection makes any output a scalar."""
    out = fn(*inputs)
    return float((out.data * weights).sum())


def numerical_grad(fn, inputs, weights, index, eps=1e-5, entries=None):
    """Central differences of <weights, fn> with respect to inputs[index], entry by entry."""
    x = inputs[index].data
    grad = numpy.zeros(x.shape)
    flat = x.reshape(-1)
    chosen = range(flat.size) if entries is None else entries
    with no_grad():
        for i in chosen:
            original = flat[i].item()
            flat[i] = original + eps
            plus = _projected(fn, inputs, weights)
            flat[i] = original - eps
            minus = _projected(fn, inputs, weights)
            flat[i] = original
            grad.reshape(-1)[i] = (plus - minus) / (2 * eps)
    return grad


def gradcheck(fn, inputs, eps=1e-5, tol=1e-6, max_entries=None, seed=0):
    """Check every differentiable input of fn; returns the max relative error, raises above tol.

    inputs: Tensors (float64, requires_grad where a gradient is checked) and other arguments.
    max_entries: check at most this many randomly chosen entries per input (large models).
    """
    tensors = [i for i, x in enumerate(inputs) if isinstance(x, Tensor) and x.requires_grad]
    for i in tensors:
        if inputs[i].dtype != numpy.float64:
            raise InputError(f"gradcheck needs float64 inputs, input {i} is {inputs[i].dtype}; "
                             "finite differences in lower precision are too noisy")
    rng = numpy.random.default_rng(seed)
    out = fn(*inputs)
    xp = get_array_module(out.data)
    weights = xp.asarray(rng.standard_normal(out.shape))
    for i in tensors:
        inputs[i].grad = None
    backward([out], [weights])
    worst = 0.0
    for i in tensors:
        x = inputs[i]
        entries = None
        if max_entries is not None and x.size > max_entries:
            entries = rng.choice(x.size, max_entries, replace=False)
        numeric = numerical_grad(fn, inputs, weights, i, eps, entries)
        # to_numpy, not numpy.asarray: CuPy arrays refuse implicit conversion to host memory.
        analytic = numpy.zeros(x.shape) if x.grad is None else to_numpy(x.grad).astype(float)
        if entries is not None:
            numeric, analytic = numeric.reshape(-1)[entries], analytic.reshape(-1)[entries]
        err = float(numpy.abs(analytic - numeric).max(initial=0.0)) / max(
            float(numpy.abs(numeric).max(initial=0.0)), 1e-8)
        if err > tol:
            raise AssertionError(f"gradcheck failed for input {i} of shape {tuple(x.shape)}: relative "
                                 f"error {err:.3e} > {tol:.0e}")
        worst = max(worst, err)
    return worst
