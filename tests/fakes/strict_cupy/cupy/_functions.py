"""cupy.* functions: explicit host<->device copies, ufuncs, and NumPy's functions under CuPy's
rules (cupy arrays in, cupy arrays out, NumPy arrays refused, syncs counted)."""
import numpy

from . import _fusion, _gemm, _strict
from ._core import (arrays, call, check_device, elementwise_operand, garbage, index,
                    ndarray, quiet, unwrap, wrap, wrap_result)
from ._core import indices as index_arrays
from ._cupy_names import CUPY_NAMES, FROM_NUMPY

#: CuPy sizes these outputs on the host (cupy/_indexing, _sorting, _manipulation): a sync.
SYNCING = frozenset({"nonzero", "argwhere", "flatnonzero", "unique", "unique_all",
                     "unique_counts", "unique_inverse", "unique_values", "extract", "compress",
                     "bincount", "setdiff1d", "intersect1d", "union1d", "setxor1d",
                     "trim_zeros", "histogram"})
#: NumPy gives Python bools here; CuPy gives 0-d arrays (reading them is a sync).
ARRAY_RESULTS = frozenset({"array_equal", "array_equiv", "allclose"})
#: Functions about dtypes and shapes: host arrays allowed, nothing is computed on the device.
METADATA = frozenset({"result_type", "can_cast", "min_scalar_type", "ndim", "shape", "size",
                      "isscalar", "common_type", "iscomplexobj", "isrealobj",
                      "may_share_memory", "shares_memory"})
UNINITIALISED = frozenset({"empty", "empty_like"})
#: Functions that reach cuBLAS (cupy/_core/_routines_linalg.pyx, as _gemm.py records them).
GEMMS = {"matmul": _gemm.matmul, "dot": _gemm.dot}
#: CuPy's own aliases of NumPy constants that NumPy 2 dropped (cupy/__init__.py).
CONSTANTS = {"PINF": numpy.inf, "Inf": numpy.inf, "Infinity": numpy.inf, "infty": numpy.inf,
             "NINF": -numpy.inf, "NAN": numpy.nan, "NaN": numpy.nan, "PZERO": 0.0,
             "NZERO": -0.0}


def _has_proxy(args, kwargs):
    return any(isinstance(a, _fusion.Proxy) for a in (*args, *kwargs.values()))


# --- explicit transfers --------------------------------------------------------------------

def _only_device_arrays(obj):
    """True when `obj` is a cupy array or a (nested) sequence of cupy arrays only: making an
    array of it is a device-side copy, not an upload."""
    if type(obj) is ndarray:
        return True
    if isinstance(obj, (list, tuple)) and obj:
        return all(_only_device_arrays(x) for x in obj)
    return False


@_strict.device_work
def _to_device(obj, dtype, copy, order, ndmin=0):
    if isinstance(obj, _fusion.Proxy):
        raise TypeError("cupy.asarray/array of a value inside cupy.fuse")
    if type(obj) is ndarray:
        if copy or (dtype is not None and numpy.dtype(dtype) != obj.dtype) or obj.ndim < ndmin:
            result = wrap(numpy.array(obj._a, dtype=dtype, order=order or "K", ndmin=ndmin))
            _strict.launch("copy", "array", read=(obj,), written=(result,))
            return result
        return obj
    upload = not _only_device_arrays(obj)
    if upload:
        _strict.note("upload", "asarray")
    host = unwrap(obj, allow_host=True)
    result = wrap(numpy.array(host, dtype=dtype, order=order or "K", ndmin=ndmin))
    if upload:
        _strict.launch("memcpy", "host to device", written=(result,))
    else:
        _strict.launch("copy", "array", read=arrays(host), written=(result,))
    return result


def asarray(a, dtype=None, order=None, *, blocking=False):
    """A cupy array: `a` itself when it is one; host data is uploaded (counted)."""
    return _to_device(a, dtype, False, order)


asanyarray = asarray


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    return _to_device(obj, dtype, copy, order, ndmin)


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    """A NumPy array: a cupy array is copied to the host (a sync); anything else as NumPy has it."""
    if isinstance(a, _fusion.Proxy):
        raise TypeError("cupy.asnumpy of a value inside cupy.fuse")
    if type(a) is ndarray:
        _strict.note("sync" if blocking else "download", "asnumpy")
        result = a._a
    else:
        result = numpy.asarray(a)
    if out is not None:
        out[...] = result
        return out
    return numpy.array(result, order=order) if type(a) is ndarray else numpy.asarray(result, order=order)


def get_array_module(*args):
    """cupy when any argument is a cupy array (or a cupy.fuse value), else numpy."""
    import cupy
    for a in args:
        if isinstance(a, (ndarray, _fusion.Proxy)):
            return cupy
    return numpy


# --- ufuncs --------------------------------------------------------------------------------

class ufunc:
    """cupy.ufunc over a NumPy (or scipy.special) ufunc: cupy arrays and scalars only, out=,
    dtype= and casting= (CuPy's _kernel.pyx ufunc.__call__ accepts nothing else)."""

    def __init__(self, np_ufunc, name=None):
        self._np = np_ufunc
        self.name = self.__name__ = name or np_ufunc.__name__
        self.nin, self.nout, self.nargs = np_ufunc.nin, np_ufunc.nout, np_ufunc.nargs

    def __repr__(self):
        return f"<ufunc '{self.name}'>"

    @_strict.device_work
    def __call__(self, *args, **kwargs):
        if _fusion.fusing() or _has_proxy(args, kwargs):
            return _fusion.call_ufunc(self._np, self.name, args, kwargs)
        out = kwargs.pop("out", None)
        dtype = kwargs.pop("dtype", None)
        casting = kwargs.pop("casting", "same_kind")
        if kwargs:
            raise TypeError(f"Wrong arguments {kwargs}")
        if not self.nin <= len(args) <= self.nargs:
            raise TypeError(f"Wrong number of arguments for {self.name!r}. It must be either "
                            f"{self.nin} or {self.nargs} (with outputs), but given {len(args)}.")
        outs = args[self.nin:]
        if out is not None:
            if outs:
                raise ValueError("Cannot specify 'out' as both a positional and keyword argument")
            outs = out if isinstance(out, tuple) else (out,)
        for o in outs:
            if type(o) is not ndarray:
                raise TypeError(f"Output arguments must be cupy.ndarray, got {type(o)}")
            check_device(o)
        values = [elementwise_operand(a) for a in args[:self.nin]]
        with quiet():
            result = self._np(*values, out=tuple(o._a for o in outs) or None, dtype=dtype,
                              casting=casting)
        if outs:
            _strict.launch("elementwise", self.name, read=values, written=outs)
            return outs[0] if len(outs) == 1 else tuple(outs)
        result = wrap_result(result)
        _strict.launch("elementwise", self.name, read=values, written=arrays(result))
        return result

    def _method(self, name, *args, **kwargs):
        return call(getattr(self._np, name), args, kwargs)

    def reduce(self, *args, **kwargs):
        return self._method("reduce", *args, **kwargs)

    def accumulate(self, *args, **kwargs):
        return self._method("accumulate", *args, **kwargs)

    def reduceat(self, *args, **kwargs):
        return self._method("reduceat", *args, **kwargs)

    def outer(self, a, b, **kwargs):
        return self._method("outer", a, b, **kwargs)

    @_strict.device_work
    def at(self, a, indices, b=None):
        """In place; repeated indices all count (numpy.ufunc.at)."""
        if type(a) is not ndarray:
            raise TypeError(f"{self.name}.at needs a cupy array, got {type(a)}")
        check_device(a)
        extra = () if b is None else (elementwise_operand(b),)
        k = index(indices)
        target = a._a[k]
        region = target.size * target.itemsize      # each element it updates is read and written
        _strict.launch("elementwise", f"scatter_{self.name}", read=(*extra, *index_arrays(k), region),
                       written=(region,))
        with quiet():
            self._np.at(a._a, k, *extra)


# --- NumPy's functions under CuPy's rules --------------------------------------------------

def function(name, np_fn):
    """cupy.<name> done by NumPy's function of that name."""
    def fn(*args, **kwargs):
        if _has_proxy(args, kwargs):
            return _fusion.call_function(name, args, kwargs)
        if name in SYNCING or (name == "where" and len(args) + len(kwargs) == 1):
            _strict.note("sync", name)
        if name in GEMMS:
            return GEMMS[name](*args, **kwargs)
        result = call(np_fn, args, kwargs, allow_host=name in METADATA,
                      launches=name not in METADATA and name not in UNINITIALISED)
        if name in ARRAY_RESULTS:
            result = wrap(numpy.asarray(result))
        if name in UNINITIALISED:
            garbage(result._a)
        return result
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"cupy.{name} (strict stand-in over numpy.{name})"
    return fn


def lookup(name):
    """The value of `cupy.<name>` for names CuPy has, or AttributeError."""
    if name in CONSTANTS:
        return CONSTANTS[name]
    if name not in CUPY_NAMES or not hasattr(numpy, name):
        raise AttributeError(f"module 'cupy' has no attribute {name!r} (the strict stand-in serves "
                             f"the names of CuPy 14's top-level module that NumPy also has)")
    value = getattr(numpy, name)
    if name in FROM_NUMPY or isinstance(value, type) or not callable(value):
        return value
    if isinstance(value, numpy.ufunc):
        return ufunc(value, name)
    return function(name, value)
