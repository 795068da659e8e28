"""cupy.fuse stand-in: runs the Python body eagerly, on proxies that allow what CuPy's fusion
trace allows and refuse what it refuses.

From CuPy v14 (cupy/_core/fusion.pyx `fuse`, `Fusion.__call__`, `_FusionHistory`,
cupy/_core/_fusion_interface.py `_VariableProxy`):
* `fuse(f)`, `fuse()(f)`, `fuse(kernel_name='k')(f)`; the name is `kernel_name or f.__name__`
  (a functools.partial has no __name__: AttributeError). `fuse(f, kernel_name='k')` returns a
  decorator in CuPy, not a fused function: refused here with a TypeError saying so.
* A fused function takes positional arguments only. Without a cupy array among them the body
  runs as plain Python (NumPy arrays in, NumPy out). With one, every argument must be a cupy
  array, a scalar or None (a NumPy array is refused), and the body sees proxies:
  - `bool()`, `int()`, `float()`, `complex()` of a proxy raise TypeError (no Python control
    flow on values); `.shape` raises NotImplementedError; `len()`, iteration and indexing
    (other than `x[...] = v` / `x[:] = v`) raise TypeError (CuPy's new fusion allows some
    basic indexing; the stand-in refuses all of it);
  - operators, comparisons, `astype`, `copy`, cupy ufuncs (`cupy.exp`, `cupy.maximum`,
    `cupyx.scipy.special.erf`, ... with `out=` an array proxy), `cupy.where(c, x, y)`,
    `cupy.clip`, `cupy.copy`, `cupy.real/imag/around/round` work; other cupy functions raise;
  - in-place operators and `out=` write into the argument itself, as the kernel does;
  - one reduction (sum, prod, nansum, nanprod, amax/max, amin/min, all, any; no keepdims, no
    dtype), after which only the reduced value and new constants may be used ("Shape
    mismatch" otherwise, as _FusionHistory._get_fusion_var);
  - a concrete cupy or NumPy array met inside the body (captured from the enclosing scope) is
    refused;
  - Python scalars stay weak (the array's dtype wins); arithmetic between scalars only gives a
    strong (float64/int64) value, as the old fusion's `make_fusion_var(..., is_weak=False)`.
* The body must return a proxy, a tuple of proxies, or None (else TypeError); results are new
  arrays broadcast to the arguments' common shape (unless reduced), never an argument itself.

Not emulated: kernel compilation and caching, CuPy's exact type-promotion tables (NumPy's are
used), the new-fusion fallback's extra features. Each call logs {"what": "fuse.call", "name"}."""
import contextlib
import functools
import threading

import numpy

from . import _strict
from ._core import HostArrayError, SCALARS, ndarray, quiet, wrap

_trace = threading.local()
#: Names of every function made by cupy.fuse, in creation order.
kernel_names = []

REDUCTIONS = {"sum": numpy.sum, "prod": numpy.prod, "nansum": numpy.nansum,
              "nanprod": numpy.nanprod, "amax": numpy.max, "max": numpy.max,
              "amin": numpy.min, "min": numpy.min, "all": numpy.all, "any": numpy.any}
_SCALAR_ONLY = "Cannot convert to Python scalar in cupy.fuse"


def fusing():
    return getattr(_trace, "active", False)


@contextlib.contextmanager
def _tracing():
    """A trace; `_trace.read` and `_trace.written` collect the ids of the NumPy arrays its
    operations read and write (the call's bytes are those of the arguments among them)."""
    _trace.active, _trace.reduced = True, False
    _trace.read, _trace.written = set(), set()
    try:
        yield
    finally:
        _trace.active = False


# --- proxies -------------------------------------------------------------------------------

class Proxy:
    """What a fused body receives for a scalar argument (and the base of ArrayProxy)."""

    __array_ufunc__ = None
    __hash__ = None

    def __init__(self, value):
        self._v = value
        self._postmap = getattr(_trace, "reduced", False)

    def __repr__(self):
        return f"<{type(self).__name__} {self.dtype}>"

    @property
    def dtype(self):
        return numpy.asarray(self._v).dtype if not isinstance(self._v, numpy.ndarray) else self._v.dtype

    @property
    def ndim(self):
        return self._v.ndim if isinstance(self._v, numpy.ndarray) else -1

    @property
    def shape(self):
        raise NotImplementedError("`shape` is not supported, currently.")

    def __bool__(self):
        raise TypeError(_SCALAR_ONLY)

    __int__ = __float__ = __complex__ = __index__ = __bool__

    def __len__(self):
        raise TypeError("len() of a value inside cupy.fuse")

    def __iter__(self):
        raise TypeError("iteration over a value inside cupy.fuse")

    def __getitem__(self, key):
        raise TypeError("indexing inside cupy.fuse is refused by the strict stand-in")

    def __array__(self, dtype=None, copy=None):
        raise TypeError("a cupy.fuse value cannot become a NumPy array")

    def __array_function__(self, func, types, args, kwargs):
        raise TypeError(f"numpy.{func.__name__} inside cupy.fuse: call cupy.{func.__name__}")

    def astype(self, dtype, order=None, casting=None, subok=None, copy=True):
        if order is not None or casting is not None or subok is not None:
            raise TypeError("order/casting/subok are not supported yet")
        dtype = numpy.dtype(dtype)
        if not copy and self.dtype == dtype:
            return self
        _check_phase(self)
        _trace.read.add(id(self._v))
        value = numpy.asarray(self._v).astype(dtype)
        return make(value if isinstance(self._v, numpy.ndarray) else value[()], weak=False)

    def copy(self):
        return call_ufunc(numpy.positive, "copy", (self,), {})

    def sum(self, axis=None, dtype=None, out=None, keepdims=False):
        return call_reduction("sum", self, axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def prod(self, axis=None, dtype=None, out=None, keepdims=False):
        return call_reduction("prod", self, axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def max(self, axis=None, out=None, keepdims=False):
        return call_reduction("max", self, axis=axis, out=out, keepdims=keepdims)

    def min(self, axis=None, out=None, keepdims=False):
        return call_reduction("min", self, axis=axis, out=out, keepdims=keepdims)

    def all(self, axis=None, out=None, keepdims=False):
        return call_reduction("all", self, axis=axis, out=out, keepdims=keepdims)

    def any(self, axis=None, out=None, keepdims=False):
        return call_reduction("any", self, axis=axis, out=out, keepdims=keepdims)


def _binary(ufunc, reflected=False):
    def op(self, other):
        args = (other, self) if reflected else (self, other)
        return call_ufunc(ufunc, ufunc.__name__, args, {})
    return op


def _inplace(ufunc):
    def op(self, other):
        return call_ufunc(ufunc, ufunc.__name__, (self, other), {"out": self})
    return op


def _unary(ufunc):
    return lambda self: call_ufunc(ufunc, ufunc.__name__, (self,), {})


_OPERATORS = {"add": numpy.add, "sub": numpy.subtract, "mul": numpy.multiply,
              "truediv": numpy.true_divide, "floordiv": numpy.floor_divide,
              "mod": numpy.remainder, "pow": numpy.power, "lshift": numpy.left_shift,
              "rshift": numpy.right_shift, "and": numpy.bitwise_and, "or": numpy.bitwise_or,
              "xor": numpy.bitwise_xor}
for _name, _ufunc in _OPERATORS.items():
    setattr(Proxy, f"__{_name}__", _binary(_ufunc))
    if _name != "pow":      # CuPy's proxies define no __rpow__: `2 ** x` fails in a fused body
        setattr(Proxy, f"__r{_name}__", _binary(_ufunc, True))
for _name, _ufunc in {"lt": numpy.less, "le": numpy.less_equal, "gt": numpy.greater,
                      "ge": numpy.greater_equal, "eq": numpy.equal, "ne": numpy.not_equal}.items():
    setattr(Proxy, f"__{_name}__", _binary(_ufunc))
Proxy.__neg__, Proxy.__invert__ = _unary(numpy.negative), _unary(numpy.invert)


class ArrayProxy(Proxy):
    """What a fused body receives for a cupy array: in-place operators write into it."""

    def __setitem__(self, key, value):
        if key is Ellipsis or (isinstance(key, slice) and key == slice(None)):
            call_ufunc(numpy.positive, "copy", (value,), {"out": self})
        else:
            raise ValueError("The fusion supports `[...]` or `[:]`.")


for _name, _ufunc in _OPERATORS.items():
    setattr(ArrayProxy, f"__i{_name}__", _inplace(_ufunc))


def make(value, weak):
    """A proxy over a computed value: arrays as ArrayProxy; scalars strong unless `weak`."""
    if isinstance(value, numpy.ndarray):
        return ArrayProxy(value)
    if not weak and not isinstance(value, numpy.generic):
        value = numpy.asarray(value)[()]
    return Proxy(value)


# --- operations inside a trace -------------------------------------------------------------

def _check_phase(proxy):
    """After the reduction only post-reduction values may be used (fusion.pyx 'Shape mismatch')."""
    if proxy._postmap != _trace.reduced:
        raise ValueError("Shape mismatch: a value from before the reduction used after it "
                         "(cupy.fuse allows no map between pre- and post-reduction values)")


def _operand(x):
    """A proxy's value, or a constant; concrete arrays refused."""
    if isinstance(x, Proxy):
        _check_phase(x)
        _trace.read.add(id(x._v))
        return x._v
    if isinstance(x, (ndarray, numpy.ndarray)):
        raise TypeError("Concrete ndarray is not supported in fusion: an array captured from "
                        "outside the cupy.fuse body; pass it as an argument")
    if isinstance(x, SCALARS):
        return x
    raise TypeError(f"Unsupported type {type(x)}")


def _strong(v):
    """A weak Python scalar as the strong NumPy scalar the old fusion makes of it."""
    return numpy.asarray(v)[()] if isinstance(v, (bool, int, float, complex)) else v


def call_ufunc(ufunc, name, args, kwargs):
    """A cupy ufunc called inside a trace (fusion.pyx _FusionHistory.call_ufunc)."""
    kwargs = dict(kwargs)
    out = kwargs.pop("out", None)
    if kwargs:
        raise TypeError(f"Wrong arguments {kwargs}")
    ins, outs = list(args[:ufunc.nin]), list(args[ufunc.nin:])
    if out is not None:
        if outs:
            raise ValueError("cannot specify 'out' as both a positional and keyword argument")
        outs = [out]
    if len(ins) != ufunc.nin or len(outs) > ufunc.nout:
        raise ValueError("invalid number of arguments")
    if not all(isinstance(o, ArrayProxy) for o in outs):
        raise TypeError("return arrays must be of ArrayType")
    values = [_operand(x) for x in ins]
    any_array = any(isinstance(v, numpy.ndarray) for v in values)
    if not any_array:
        values = [_strong(v) for v in values]
    with quiet():
        if outs:
            for o in outs:
                _check_phase(o)
                _trace.written.add(id(o._v))
            ufunc(*values, out=tuple(o._v for o in outs) if len(outs) > 1 else outs[0]._v)
            return outs[0] if len(outs) == 1 else tuple(outs)
        result = ufunc(*values)
    if any_array:       # NumPy gives a scalar for 0-d operands; CuPy's kernel a 0-d array
        result = tuple(map(numpy.asarray, result)) if isinstance(result, tuple) else numpy.asarray(result)
    if isinstance(result, tuple):
        return tuple(make(r, weak=False) for r in result)
    return make(result, weak=False)


def call_reduction(name, arg, axis=None, dtype=None, out=None, keepdims=False):
    """cupy.sum & co. inside a trace: one reduction, no keepdims (sumprod.py, order.py)."""
    if keepdims:
        raise NotImplementedError(f"cupy.{name} does not support `keepdims` in fusion yet.")
    if dtype is not None:
        raise NotImplementedError(f"cupy.{name} with dtype= inside cupy.fuse: the old fusion "
                                  f"drops it; cast with astype first")
    if not isinstance(arg, ArrayProxy):
        raise TypeError(f"cupy.{name} inside cupy.fuse needs an array argument")
    if _trace.reduced:
        raise NotImplementedError("Multiple reduction is not implemented yet")
    _check_phase(arg)
    _trace.read.add(id(arg._v))
    with quiet():
        result = REDUCTIONS[name](arg._v, axis=axis)
    _trace.reduced = True
    proxy = ArrayProxy(numpy.asarray(result))
    if out is not None:
        out[...] = proxy
        return out
    return proxy


def call_function(name, args, kwargs):
    """The non-ufunc cupy functions that support fusion; anything else raises."""
    if name in REDUCTIONS:
        return call_reduction(name, *args, **kwargs)
    if name == "where":
        if len(args) + len(kwargs) != 3:
            raise TypeError("cupy.where inside cupy.fuse needs (condition, x, y)")
        return call_ufunc(_WHERE, "where", args, kwargs)
    if name == "clip":
        return call_ufunc(_CLIP, "clip", args, kwargs)
    if name == "copy":
        return call_ufunc(numpy.positive, "copy", args[:1], {})
    if name in ("real", "imag"):
        return call_ufunc(_PART[name], name, args, kwargs)
    if name in ("around", "round"):
        decimals = args[1] if len(args) > 1 else kwargs.pop("decimals", 0)
        return call_ufunc(_rounder(decimals), name, args[:1], kwargs)
    raise TypeError(f"cupy.{name} is not supported inside cupy.fuse (only ufuncs, where, clip, "
                    f"copy, real, imag, around/round and one reduction)")


class _Elementwise:
    """A NumPy function posing as a ufunc with `nin` inputs and one output (for where/real)."""

    nout = 1

    def __init__(self, fn, nin, name):
        self.fn, self.nin, self.__name__ = fn, nin, name

    def __call__(self, *args, out=None):
        result = self.fn(*args)
        if out is not None:
            out[...] = result
            return out
        return result


_WHERE = _Elementwise(numpy.where, 3, "where")
_CLIP = _Elementwise(numpy.clip, 3, "clip")
_PART = {"real": _Elementwise(numpy.real, 1, "real"), "imag": _Elementwise(numpy.imag, 1, "imag")}


def _rounder(decimals):
    return _Elementwise(lambda a: numpy.round(a, decimals), 1, "around")


# --- cupy.fuse -----------------------------------------------------------------------------

def _argument(a):
    """A fused function's argument as the body sees it."""
    if isinstance(a, ndarray):
        from ._core import check_device
        check_device(a)
        return ArrayProxy(a._a)
    if a is None:
        return None
    if isinstance(a, numpy.ndarray):
        raise HostArrayError("a NumPy array passed to a cupy.fuse function with cupy arrays")
    if isinstance(a, SCALARS):
        return Proxy(a)
    raise TypeError(f"Invalid argument type for cupy.fuse: {type(a)}")


def _result(value, shape):
    """A proxy the body returned, as a new cupy array of the launch shape."""
    if not isinstance(value, Proxy):
        raise TypeError(f"Fusion function can't return {type(value)}")
    v = numpy.asarray(value._v)
    if not value._postmap:
        v = numpy.broadcast_to(v, numpy.broadcast_shapes(v.shape, shape))
    return wrap(numpy.array(v))


class Fusion:
    """A function made by cupy.fuse (CuPy's fusion.pyx Fusion)."""

    def __init__(self, func, name=None):
        self.func = func
        self.name = name or func.__name__
        kernel_names.append(self.name)

    def __repr__(self):
        return f"<Fusion '{self.name}'>"

    @_strict.device_work
    def __call__(self, *args):
        _strict.log_event("fuse.call", name=self.name)
        if fusing() or not any(isinstance(a, ndarray) for a in args):
            return self.func(*args)
        shape = numpy.broadcast_shapes(*[a.shape for a in args if isinstance(a, ndarray)])
        with _tracing(), _strict.emulating():       # arguments are pre-reduction values of this trace
            returned = self.func(*[_argument(a) for a in args])
            read, written = _trace.read, _trace.written
        results = () if returned is None else tuple(_result(r, shape) for r in (
            returned if isinstance(returned, tuple) else (returned,)))
        # the kernel reads the arguments its body reads and writes those it writes, and its results
        arrays = [a for a in args if isinstance(a, ndarray)]
        _strict.launch("fused", self.name, read=[a for a in arrays if id(a._a) in read],
                       written=[a for a in arrays if id(a._a) in written] + list(results))
        if returned is None:
            return None
        return results if isinstance(returned, tuple) else results[0]

    def clear_cache(self):
        pass


def fuse(*args, **kwargs):
    """cupy.fuse: as a decorator, bare or with kernel_name=."""
    def wrapper(f, kernel_name=None):
        return Fusion(f, kernel_name)

    if len(args) == 1 and not kwargs and callable(args[0]):
        return functools.update_wrapper(wrapper(args[0]), args[0])
    if args and callable(args[0]):
        raise TypeError("cupy.fuse(f, kernel_name=...) returns a decorator in CuPy, not a fused "
                        "function (fusion.pyx fuse); write cupy.fuse(kernel_name=...)(f)")
    return lambda f: functools.update_wrapper(wrapper(f, *args, **kwargs), f)
