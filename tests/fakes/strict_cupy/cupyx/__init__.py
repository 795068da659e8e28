"""cupyx stand-in: scatter_add/max/min (in place, repeated indices all applied, as
numpy.ufunc.at), pinned host arrays (plain NumPy), and cupyx.scipy.special."""
import numpy

from cupy._core import scatter as _scatter


def scatter_add(a, slices, value):
    _scatter(numpy.add, a, slices, value)


def scatter_max(a, slices, value):
    _scatter(numpy.maximum, a, slices, value)


def scatter_min(a, slices, value):
    _scatter(numpy.minimum, a, slices, value)


def empty_pinned(shape, dtype=float, order="C"):
    return numpy.empty(shape, dtype, order)


def zeros_pinned(shape, dtype=float, order="C"):
    return numpy.zeros(shape, dtype, order)


def empty_like_pinned(a, dtype=None, order="K", subok=None, shape=None):
    return numpy.empty_like(a, dtype, order, shape=shape)


def zeros_like_pinned(a, dtype=None, order="K", subok=None, shape=None):
    return numpy.zeros_like(a, dtype, order, shape=shape)


def __getattr__(name):
    if name == "scipy":
        import cupyx.scipy
        return cupyx.scipy
    raise AttributeError(f"module 'cupyx' has no attribute {name!r} (strict stand-in)")
