"""Array-module helpers: one place decides NumPy or CuPy, so every op is written once.

Chainer's `get_array_module` idea; CuPy is optional and imported only when an array lives on a GPU.
"""
import numpy

from .errors import InputError


def get_array_module(*arrays):
    """numpy, or cupy when any of the arrays is a CuPy array."""
    for a in arrays:
        if type(a).__module__.startswith("cupy"):
            import cupy
            return cupy
    return numpy


def array_module_for(device):
    """The array module for a device name: 'cpu' is NumPy, 'gpu' is CuPy."""
    if device == "cpu":
        return numpy
    if device == "gpu":
        try:
            import cupy
        except ImportError:
            raise InputError("device 'gpu' needs CuPy, which is not installed; install it with "
                             "pip install 'npmegatron[gpu]', or use the CPU") from None
        # CuPy imports without a driver; its first CUDA call would be a raw CUDARuntimeError.
        try:
            visible = cupy.cuda.runtime.getDeviceCount()
        except Exception as error:
            visible, reason = 0, f" ({type(error).__name__}: {error})"
        else:
            reason = ""
        if visible < 1:
            raise InputError(f"device 'gpu' needs a CUDA driver and a visible GPU, and CuPy found "
                             f"none{reason}; check nvidia-smi and CUDA_VISIBLE_DEVICES, or use the CPU")
        return cupy
    raise InputError(f"unknown device {device!r}; use 'cpu' or 'gpu'")


def to_numpy(a):
    """A NumPy copy of an array that may live on the GPU."""
    return a.get() if hasattr(a, "get") else numpy.asarray(a)


def scatter_add(target, index, values):
    """target[index] += values, with repeated indices summed (embedding backward).

    On NumPy, a row index (1-D integers, as the embeddings give) into large float arrays takes a
    numba loop over the rows (_scatter_cpu.py: the numbers of `add.at`, 20-40x faster); into small
    ones (a test's, which never import numba) it is sorted and each run of one index summed by
    `add.reduceat` before it is added (so the sums round in another order). Other indices
    (negative ones included), and CuPy arrays, go through `add.at`."""
    xp = get_array_module(target)
    if xp is numpy:
        rows = isinstance(index, numpy.ndarray) and index.ndim == 1 and index.dtype.kind in "iu" \
            and values.ndim == 2 and values.shape[0] == index.size > 0
        # (negative: -1 and the last row would be two runs of one row, and the loop reads unchecked)
        if rows and index.min() >= 0 and _compiled_rows(target, index, values):
            from . import _scatter_cpu
            _scatter_cpu.add_rows_(target, index, values)
        elif rows and index.min() >= 0:
            order = numpy.argsort(index, kind="stable")
            sorted_index = index[order]
            starts = numpy.flatnonzero(numpy.concatenate(([True], sorted_index[1:] != sorted_index[:-1])))
            target[sorted_index[starts]] += numpy.add.reduceat(values[order], starts, axis=0)
        else:
            numpy.add.at(target, index, values)
    else:
        xp.add.at(target, index, values)    # CuPy >= 12; cupyx.scatter_add is deprecated in 14


#: Row scatters of at least this many numbers run the compiled loop (_scatter_cpu.py).
COMPILED_SCATTER_SIZE = 1 << 16


def _compiled_rows(target, index, values):
    """Whether scatter_add's rows go through the compiled loop: large float arrays of one dtype,
    C-ordered, with every index within [0, rows of target) (the loop indexes unchecked; negative
    indices, which NumPy counts from the end, and out-of-range ones, its IndexError, take NumPy's
    paths)."""
    return (values.size >= COMPILED_SCATTER_SIZE and target.dtype == values.dtype
            and target.dtype in (numpy.float32, numpy.float64) and target.ndim == 2
            and target.shape[1] == values.shape[1] and target.flags.c_contiguous
            and values.flags.c_contiguous and 0 <= index.min() and index.max() < target.shape[0])


def erf(x):
    """The error function on either array module (exact GeLU)."""
    if get_array_module(x) is numpy:
        from scipy.special import erf as _erf
    else:
        from cupyx.scipy.special import erf as _erf
    return _erf(x)
