"""cupyx.scipy.special stand-in: scipy.special's ufuncs as cupy ufuncs (cupy arrays in and out,
usable inside cupy.fuse, as CuPy's are)."""
import scipy.special

from cupy._functions import ufunc as _ufunc

_cache = {}


def __getattr__(name):
    fn = getattr(scipy.special, name, None)
    if fn is None or not hasattr(fn, "nin"):
        raise AttributeError(f"module 'cupyx.scipy.special' has no attribute {name!r} "
                             f"(the strict stand-in serves scipy.special's ufuncs)")
    if name not in _cache:
        _cache[name] = _ufunc(fn, name)
    return _cache[name]


erf = __getattr__("erf")
