"""cupy.lib.stride_tricks.as_strided: a view of x's allocation with the shape and byte strides
given, from x's first element, as CuPy makes it (no copy, no launch; nothing checks that the view
stays inside the allocation in CuPy, and here NumPy refuses one that does not)."""
import numpy

from .. import _core


def as_strided(x, shape=None, strides=None):
    _core.check_device(x)
    root = _core._root(x._a)
    offset = _core.address(x._a) - _core.address(root)
    view = numpy.ndarray(x.shape if shape is None else tuple(shape), x.dtype, buffer=root, offset=offset,
                         strides=x.strides if strides is None else tuple(strides))
    return _core.wrap(view)
