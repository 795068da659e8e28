"""cupy.ndarray stand-in: a NumPy array in "device memory" that the host cannot touch implicitly.

What CuPy does (cupy/_core/core.pyx, _kernel.pyx, _routines_indexing.pyx) and is kept:
* `__array__` raises TypeError ("Implicit conversion to a NumPy array is not allowed...");
* elementwise kernels take cupy arrays and Python/NumPy scalars only: a NumPy array, even 0-d,
  or a list raises TypeError ("Unsupported type ...", _scalar.pyx CScalar);
* reductions and scalar indexing give 0-d cupy arrays; basic indexing gives views;
* `float()`, `int()`, `bool()`, `complex()`, `repr`, `.get()`, `.item()`, `.tolist()`, pickling
  and boolean-mask indexing copy to the host and wait (counted as "sync");
* an array is bound to the device current at its allocation; a kernel on another device refuses
  it (ValueError, _kernel.pyx _check_peer_access, peer access taken as unavailable);
* no `__index__`, no `__hash__`; `copy()`/`deepcopy` work across devices, to the current one.

Stricter than CuPy, to catch bugs:
* `__array_ufunc__ = None` and `__array_function__` raising: `numpy.exp(x)`, `numpy.sum(x)`,
  `numpy_array + x` raise TypeError (CuPy would dispatch them to itself);
* assigning a NumPy array or a list into a cupy array raises (CuPy uploads it implicitly on the
  advanced-indexing path);
* `bool()` of an empty array raises ValueError (CuPy warns and returns False);
* out-of-bounds integer indices raise IndexError (CuPy wraps them around);
* `empty`, `empty_like` and `ndarray(shape)` are filled with NaN (floats) or 0xA5 bytes, so
  reading memory nobody wrote shows up."""
import numpy
import weakref

from . import _strict


class HostArrayError(TypeError, ValueError):
    """Host data (a NumPy array or a list) where CuPy needs a device array. A TypeError as CuPy
    raises for kernel arguments, and a ValueError as it raises for `fill`."""


SCALARS = (bool, int, float, complex, numpy.generic)
_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
             "Please use `.get()` to construct a NumPy array explicitly.")


# --- device memory registry: which buffers are live cupy allocations -----------------------

class Buffer:
    """One allocation: [start, start + nbytes) on `device`, alive while its NumPy root is."""

    __slots__ = ("start", "nbytes", "root", "owner", "device")

    def __init__(self, start, nbytes, root, owner, device):
        self.start, self.nbytes, self.device = start, nbytes, device
        self.root = weakref.ref(root, lambda ref: _forget(start, nbytes, ref))
        self.owner = weakref.ref(owner)
        _strict.allocated(nbytes, root)


#: start address -> Buffer. Entries disappear when their NumPy root is freed.
buffers = {}


def _forget(start, nbytes, ref):
    """The allocation at `start` was freed (its NumPy root died): drop it, unless the address
    already holds a newer allocation."""
    _strict.freed(nbytes, allocation=True)
    entry = buffers.get(start)
    if entry is not None and entry.root is ref:
        del buffers[start]


def address(a):
    """The address of a NumPy array's first element (what `cupy.ndarray.data.ptr` gives)."""
    return a.__array_interface__["data"][0]


def _root(a):
    while isinstance(a.base, numpy.ndarray):
        a = a.base
    return a


def find_buffer(ptr, nbytes):
    """The live Buffer holding [ptr, ptr + nbytes), or None."""
    entry = buffers.get(ptr)
    if entry is not None and nbytes <= entry.nbytes and entry.root() is not None:
        return entry
    for entry in buffers.values():
        if entry.start <= ptr and ptr + nbytes <= entry.start + entry.nbytes and entry.root() is not None:
            return entry
    return None


# --- wrapping ------------------------------------------------------------------------------

def wrap(a, device=None):
    """A cupy array over NumPy array `a` (a view of an existing allocation keeps its device and
    its base; a new allocation belongs to `device`, by default the current one)."""
    obj = ndarray.__new__(ndarray)
    adopt(obj, a if isinstance(a, numpy.ndarray) else numpy.asarray(a), device)
    return obj


def adopt(obj, a, device=None):
    """Make `obj` the cupy array over `a`, registering `a`'s allocation if it is new."""
    obj._a, obj._base = a, None
    root = _root(a)
    if root.nbytes == 0:
        obj._device = _strict.current_device() if device is None else device
        return
    start = address(root)
    entry = buffers.get(start)
    if entry is not None and entry.root() is root:
        owner = entry.owner()
        if owner is None:
            entry.owner = weakref.ref(obj)
        else:
            obj._base = owner
        obj._device = entry.device
        return
    if _strict.device_count() < 1:
        from .cuda.runtime import CUDARuntimeError
        raise CUDARuntimeError(100)
    obj._device = _strict.current_device() if device is None else device
    buffers[start] = Buffer(start, root.nbytes, root, obj, obj._device)


def wrap_result(r):
    """NumPy results as CuPy gives them: arrays and scalars become cupy arrays (0-d for scalars),
    tuples and lists are wrapped item by item, anything else is returned as is."""
    if isinstance(r, numpy.ndarray):
        return wrap(r)
    if isinstance(r, numpy.generic):
        return wrap(numpy.asarray(r))
    if isinstance(r, tuple):
        return tuple(wrap_result(x) for x in r)
    if isinstance(r, list):
        return [wrap_result(x) for x in r]
    return r


def garbage(a):
    """Fill a fresh allocation as uninitialised device memory might read: NaN or 0xA5 bytes."""
    if a.dtype.kind in "fc":
        a.fill(numpy.nan)
    elif a.dtype.kind == "b":
        a.fill(True)
    elif a.size and a.flags.c_contiguous:
        a.view(numpy.uint8).fill(0xA5)
    return a


# --- argument checks -----------------------------------------------------------------------

def check_device(x):
    """CuPy's _check_peer_access, with peer access taken as unavailable."""
    current = _strict.current_device()
    if x._device != current:
        raise ValueError(f"The device where the array resides ({x._device}) is different from "
                         f"the current device ({current}). Peer access is unavailable between "
                         f"these devices.")


def refuse_host(x, what="argument"):
    raise HostArrayError(f"Unsupported type {type(x)}: a host {what} where CuPy needs a cupy "
                         f"array or a scalar (copy it explicitly with cupy.asarray)")


def elementwise_operand(x):
    """A kernel argument as NumPy sees it: cupy arrays unwrapped (device checked), scalars as
    they are; NumPy arrays (even 0-d) and lists refused, as CuPy's CScalar does."""
    if type(x) is ndarray:
        check_device(x)
        return x._a
    if isinstance(x, SCALARS):
        return x
    if isinstance(x, (numpy.ndarray, list, tuple)):
        refuse_host(x)
    raise TypeError(f"Unsupported type {type(x)}")


def unwrap(obj, allow_host=False):
    """Unwrap cupy arrays (device checked) anywhere in lists, tuples and dicts, for functions
    that are not elementwise. NumPy arrays with ndim >= 1 are refused unless allow_host."""
    if type(obj) is ndarray:
        check_device(obj)
        return obj._a
    if isinstance(obj, numpy.ndarray):
        if obj.ndim and not allow_host:
            refuse_host(obj)
        return obj
    if isinstance(obj, (list, tuple)):
        items = [unwrap(x, allow_host) for x in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, dict):
        return {k: unwrap(v, allow_host) for k, v in obj.items()}
    from . import _fusion
    if isinstance(obj, _fusion.Proxy):
        raise TypeError("a cupy.fuse proxy passed to a function cupy.fuse does not support")
    return obj


def quiet():
    """CuPy kernels never warn about division by zero or invalid values; NumPy would."""
    return numpy.errstate(all="ignore")


# --- indexing ------------------------------------------------------------------------------

def _index_item(k, notes):
    if type(k) is ndarray:
        check_device(k)
        if k.dtype == numpy.bool_:
            notes.add("mask_index")
        return k._a
    if isinstance(k, (numpy.ndarray, list)):
        notes.add("upload")
        arr = numpy.asarray(k)
        if arr.dtype == numpy.bool_:
            notes.add("mask_index")
        return k if isinstance(k, numpy.ndarray) else arr
    if isinstance(k, (bool, numpy.bool_)):
        notes.add("mask_index")
    from . import _fusion
    if isinstance(k, _fusion.Proxy):
        raise TypeError("a cupy.fuse proxy cannot be an index")
    return k


def _basic(item):
    return item is None or item is Ellipsis or isinstance(item, (int, numpy.integer, slice))


def index(key):
    """(NumPy key, host notes) for a cupy index: cupy arrays unwrapped; NumPy arrays and lists
    are uploads; a boolean mask is a sync (CuPy counts its True values on the host). A basic
    index gets a trailing Ellipsis so NumPy returns a 0-d view, never a scalar, as CuPy does."""
    notes = set()
    items = key if isinstance(key, tuple) else (key,)
    items = tuple(_index_item(k, notes) for k in items)
    if all(_basic(k) for k in items) and not any(k is Ellipsis for k in items):
        items += (Ellipsis,)
    for what in sorted(notes):
        if what == "upload":
            _strict.note("upload", "index")
        else:
            _strict.note("sync", what)
    return items


# --- the array -----------------------------------------------------------------------------

class Flags:
    """ndarray.flags: c_contiguous, f_contiguous, owndata (also as flags['C_CONTIGUOUS'])."""

    def __init__(self, a, owndata):
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = owndata

    def __getitem__(self, name):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata}[name]


class MemoryPointer:
    """ndarray.data: `ptr` is the address of the array's first element in the NumPy buffer."""

    def __init__(self, array):
        self.ptr = address(array._a)
        self.device_id = array._device
        if len(view_records) > 10_000:
            for ptr in [p for p, r in view_records.items() if r[0]() is None]:
                del view_records[ptr]
        view_records[self.ptr] = (weakref.ref(_root(array._a)), array.dtype, array.size,
                                  bool(array._a.flags.c_contiguous))

    def __int__(self):
        return self.ptr

    @property
    def device(self):
        from .cuda.device import Device
        return Device(self.device_id)


#: ptr -> (allocation ref, dtype, size, c_contiguous) of the last array whose .data gave that
#: ptr (valid while that allocation lives): lets the NCCL stand-in check the dtype, size and
#: contiguity behind a raw pointer, even when the view itself was a temporary.
view_records = {}


def _binary(ufunc, reflected=False, inplace=False):
    """An arithmetic dunder through NumPy's ufunc, with CuPy's operand rules."""
    @_strict.device_work
    def op(self, other):
        if isinstance(other, (numpy.ndarray, list, tuple)):
            refuse_host(other, "operand")
        if type(other) is not ndarray and not isinstance(other, SCALARS):
            return NotImplemented
        check_device(self)
        o = elementwise_operand(other)
        with quiet():
            if inplace:
                ufunc(self._a, o, out=self._a)
                _strict.launch("elementwise", ufunc.__name__, read=(self._a, o), written=(self._a,))
                return self
            result = wrap_result(ufunc(o, self._a) if reflected else ufunc(self._a, o))
        _strict.launch("elementwise", ufunc.__name__, read=(self._a, o), written=(result,))
        return result
    op.__name__ = ufunc.__name__
    return op


def _compare(ufunc, none_value):
    """A comparison: 0-d NumPy arrays compared as scalars; None or objects without their own
    __eq__ give all-False for == and all-True for != (core.pyx __richcmp__)."""
    compare = _binary(ufunc)

    def op(self, other):
        if isinstance(other, numpy.ndarray) and other.ndim == 0:
            other = other.item()
        if none_value is not None and (other is None or (
                type(other) is not ndarray and not isinstance(other, (SCALARS, numpy.ndarray, list, tuple))
                and type(other).__eq__ is object.__eq__)):
            check_device(self)
            return wrap(numpy.full(self.shape, none_value))
        return compare(self, other)
    return op


def _unary(ufunc):
    @_strict.device_work
    def op(self):
        check_device(self)
        with quiet():
            result = wrap_result(ufunc(self._a))
        _strict.launch("elementwise", ufunc.__name__, read=(self._a,), written=(result,))
        return result
    return op


class ndarray:
    """cupy.ndarray(shape, dtype=float): an uninitialised array on the current device."""

    __slots__ = ("_a", "_device", "_base", "__weakref__")
    __array_ufunc__ = None
    __array_priority__ = 100
    __hash__ = None

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None or strides is not None:
            raise NotImplementedError("the strict stand-in makes no ndarray over a memptr")
        adopt(self, garbage(numpy.empty(shape, dtype, order=order)))

    # -- refused host conversions --
    def __array__(self, dtype=None, copy=None):
        raise TypeError(_IMPLICIT)

    def __array_function__(self, func, types, args, kwargs):
        raise TypeError(f"numpy.{func.__name__} called on a cupy array: call cupy.{func.__name__} "
                        f"(or xp.{func.__name__} with xp from get_array_module); the strict "
                        f"stand-in refuses NumPy's dispatch to CuPy")

    # -- metadata (no device work) --
    @property
    def shape(self):
        return self._a.shape

    @shape.setter
    def shape(self, value):
        self._a.shape = value

    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)

    @property
    def flags(self):
        return Flags(self._a, self._base is None)

    @property
    def base(self):
        """The array this one is a view of (the owner of the allocation), else None."""
        return self._base

    @property
    def data(self):
        return MemoryPointer(self)

    @property
    def device(self):
        from .cuda.device import Device
        return Device(self._device)

    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self._a.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self._a.shape[0]))

    # -- host syncs --
    def get(self, stream=None, order="C", out=None, blocking=True):
        _strict.note("sync" if blocking else "download", "get" if blocking else "get(blocking=False)")
        if out is not None:
            if not isinstance(out, numpy.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
            out[...] = self._a
            return out
        return numpy.array(self._a, order=order)

    def set(self, arr, stream=None):
        if not isinstance(arr, numpy.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        _strict.note("upload", "set")
        self._a[...] = arr

    def _host(self, reason):
        _strict.note("sync", reason)
        return self._a

    def item(self):
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self._host("item").item()

    def tolist(self):
        return self._host("tolist").tolist()

    def tobytes(self, order="C"):
        return self._host("tobytes").tobytes(order)

    def __float__(self):
        return float(self._host("float"))

    def __int__(self):
        return int(self._host("int"))

    def __complex__(self):
        return complex(self._host("complex"))

    def __bool__(self):
        if self.size == 0:
            raise ValueError("The truth value of an empty array is ambiguous (CuPy warns and "
                             "returns False; the strict stand-in refuses)")
        if self.size > 1:
            raise ValueError("The truth value of an array with more than one element is "
                             "ambiguous. Use a.any() or a.all()")
        return bool(self._host("bool").reshape(()))

    def __repr__(self):
        return repr(self._host("repr"))

    def __str__(self):
        return str(self._host("str"))

    def __format__(self, spec):
        return format(self._host("format"), spec)

    def __contains__(self, value):
        check_device(self)
        return bool((self._host("contains") == elementwise_operand(value)).any())

    def __reduce__(self):
        _strict.note("sync", "pickle")
        from . import array
        return array, (numpy.array(self._a),)

    def __copy__(self):
        return self.copy()

    @_strict.device_work
    def __deepcopy__(self, memo):
        result = wrap(numpy.array(self._a), device=self._device)
        _strict.launch("copy", "copy", read=(self._a,), written=(result,))
        return result

    # -- indexing --
    @_strict.device_work
    def __getitem__(self, key):
        check_device(self)
        k = index(key)
        result = wrap_result(self._a[k])
        if advanced(k):     # reads the elements it gathers, and the indices
            _strict.launch("elementwise", "take", read=(result, *indices(k)), written=(result,))
        return result

    @_strict.device_work
    def __setitem__(self, key, value):
        check_device(self)
        if isinstance(value, numpy.ndarray) and value.ndim == 0:
            value = value.item()
        k = index(key)
        v = elementwise_operand(value)
        target = self._a[k]     # the elements written (a copy of them for an advanced index)
        _strict.launch("elementwise", "scatter" if advanced(k) else "copy" if type(value) is ndarray else "fill",
                       read=(v, *indices(k)), written=(target.size * target.itemsize,))
        with quiet():
            self._a[k] = v

    # -- arithmetic --
    __add__, __radd__, __iadd__ = (_binary(numpy.add), _binary(numpy.add, True),
                                   _binary(numpy.add, inplace=True))
    __sub__, __rsub__, __isub__ = (_binary(numpy.subtract), _binary(numpy.subtract, True),
                                   _binary(numpy.subtract, inplace=True))
    __mul__, __rmul__, __imul__ = (_binary(numpy.multiply), _binary(numpy.multiply, True),
                                   _binary(numpy.multiply, inplace=True))
    __truediv__, __rtruediv__, __itruediv__ = (
        _binary(numpy.true_divide), _binary(numpy.true_divide, True),
        _binary(numpy.true_divide, inplace=True))
    __floordiv__, __rfloordiv__, __ifloordiv__ = (
        _binary(numpy.floor_divide), _binary(numpy.floor_divide, True),
        _binary(numpy.floor_divide, inplace=True))
    __mod__, __rmod__, __imod__ = (_binary(numpy.remainder), _binary(numpy.remainder, True),
                                   _binary(numpy.remainder, inplace=True))
    __pow__, __rpow__, __ipow__ = (_binary(numpy.power), _binary(numpy.power, True),
                                   _binary(numpy.power, inplace=True))
    def __matmul__(self, other):
        return _routines_linalg.matmul(self, other)

    def __rmatmul__(self, other):
        return _routines_linalg.matmul(other, self)

    __and__, __rand__, __iand__ = (_binary(numpy.bitwise_and), _binary(numpy.bitwise_and, True),
                                   _binary(numpy.bitwise_and, inplace=True))
    __or__, __ror__, __ior__ = (_binary(numpy.bitwise_or), _binary(numpy.bitwise_or, True),
                                _binary(numpy.bitwise_or, inplace=True))
    __xor__, __rxor__, __ixor__ = (_binary(numpy.bitwise_xor), _binary(numpy.bitwise_xor, True),
                                   _binary(numpy.bitwise_xor, inplace=True))
    __lshift__, __rlshift__ = _binary(numpy.left_shift), _binary(numpy.left_shift, True)
    __rshift__, __rrshift__ = _binary(numpy.right_shift), _binary(numpy.right_shift, True)
    __lt__, __le__ = _compare(numpy.less, None), _compare(numpy.less_equal, None)
    __gt__, __ge__ = _compare(numpy.greater, None), _compare(numpy.greater_equal, None)
    __eq__, __ne__ = _compare(numpy.equal, False), _compare(numpy.not_equal, True)
    __neg__, __pos__ = _unary(numpy.negative), _unary(numpy.positive)
    __abs__, __invert__ = _unary(numpy.absolute), _unary(numpy.invert)

    def __divmod__(self, other):
        return (self // other, self % other)

    # -- methods with CuPy-specific rules --
    @_strict.device_work
    def copy(self, order="C"):
        """To the current device, from any device (CuPy copies across devices)."""
        result = wrap(numpy.array(self._a, order=order))
        _strict.launch("copy", "copy", read=(self._a,), written=(result,))
        return result

    @_strict.device_work
    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        check_device(self)
        if not copy and numpy.dtype(dtype) == self.dtype:
            return self
        result = wrap(self._a.astype(dtype, order=order, casting=casting or "unsafe"))
        _strict.launch("copy", "astype", read=(self._a,), written=(result,), dtype=str(numpy.dtype(dtype)))
        return result

    def view(self, dtype=None, array_class=None):
        check_device(self)
        return wrap(self._a.view() if dtype is None else self._a.view(dtype))

    @_strict.device_work
    def fill(self, value):
        check_device(self)
        if type(value) is ndarray:
            if value.shape != ():
                raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
            check_device(value)
            value = value._a
        elif isinstance(value, numpy.ndarray):
            if value.shape != ():
                raise HostArrayError("non-scalar numpy.ndarray cannot be used for fill")
            value = value.item()
        elif not isinstance(value, SCALARS):
            raise TypeError(f"Unsupported type {type(value)}")
        _strict.launch("elementwise", "fill", written=(self._a,))
        self._a.fill(value)

    @_strict.device_work
    def reshape(self, *shape, order="C"):
        check_device(self)
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        result = self._a.reshape(shape, order=order)
        result = wrap(result)
        if _root(result._a) is not _root(self._a):
            _strict.launch("copy", "reshape", read=(self._a,), written=(result,))
        return result

    def nonzero(self):
        check_device(self)
        _strict.note("sync", "nonzero")
        result = wrap_result(self._a.nonzero())
        _strict.launch("elementwise", "nonzero", read=(self._a,), written=result)
        return result

    def compress(self, condition, axis=None, out=None):
        check_device(self)
        _strict.note("sync", "compress")
        return call(self._a.compress, (condition,), {"axis": axis, "out": out}, self)

    def dot(self, b, out=None):
        if type(b) is not ndarray:
            raise TypeError(f"Argument 'b' has incorrect type (expected cupy.ndarray, got "
                            f"{type(b).__name__})")
        return _routines_linalg.dot(self, b, out)

    def ptp(self, axis=None, out=None, keepdims=False):
        return call(numpy.ptp, (self, axis), {"out": out, "keepdims": keepdims})

    @property
    def T(self):
        check_device(self)
        return wrap(self._a.T)

    @property
    def mT(self):
        check_device(self)
        return wrap(self._a.mT)

    @property
    def real(self):
        check_device(self)
        return wrap(self._a.real)

    @real.setter
    def real(self, value):
        self.real[...] = value

    @property
    def imag(self):
        check_device(self)
        return wrap(self._a.imag)

    @imag.setter
    def imag(self, value):
        self.imag[...] = value

    def scatter_add(self, slices, value):
        scatter(numpy.add, self, slices, value)

    def scatter_max(self, slices, value):
        scatter(numpy.maximum, self, slices, value)

    def scatter_min(self, slices, value):
        scatter(numpy.minimum, self, slices, value)


@_strict.device_work
def call(fn, args, kwargs, *more_arrays, allow_host=False, launches=True):
    """Run a NumPy callable on unwrapped arguments and wrap its result; `out=` writes into the
    given cupy array's buffer and returns that very array; `more_arrays` (checked for their device)
    are read too (the array a bound method belongs to). One kernel launch is recorded when
    the call writes `out=` or makes a new array (a view of its inputs launches nothing), unless
    `launches` is False."""
    for x in more_arrays:
        check_device(x)
    out = kwargs.get("out")
    if out is None:
        kwargs.pop("out", None)
    args, kwargs = unwrap(args, allow_host), unwrap(kwargs, allow_host)
    with quiet():
        result = fn(*args, **kwargs)
    name = getattr(fn, "__name__", "call")
    read = arrays((more_arrays, args, {k: v for k, v in kwargs.items() if k != "out"}))
    if type(out) is ndarray and result is out._a:
        if launches:
            _strict.launch(kernel_kind(name), name, read=read, written=(out,))
        return out
    before = _strict.memory()["allocations"]
    wrapped = wrap_result(result)
    if launches and _strict.memory()["allocations"] > before:
        _strict.launch(kernel_kind(name), name, read=read, written=arrays(wrapped))
    return wrapped


def arrays(obj):
    """The NumPy and cupy arrays in nested lists, tuples and dicts (what a call reads or writes)."""
    if isinstance(obj, (numpy.ndarray, ndarray)):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [a for x in obj for a in arrays(x)]
    if isinstance(obj, dict):
        return arrays(list(obj.values()))
    return []


#: Functions and methods CuPy runs as reduction kernels (the rest are elementwise).
REDUCTION_NAMES = frozenset({"sum", "prod", "max", "min", "amax", "amin", "argmax", "argmin", "mean",
                             "var", "std", "all", "any", "nansum", "nanprod", "nanmax", "nanmin",
                             "nanmean", "cumsum", "cumprod", "count_nonzero", "trace", "average",
                             "reduce", "accumulate", "reduceat", "ptp", "median", "logsumexp"})


def kernel_kind(name):
    return "reduction" if name in REDUCTION_NAMES else "elementwise"


def indices(key):
    """The index arrays of a NumPy index (from index()): what a gather or scatter also reads."""
    return [k for k in key if isinstance(k, numpy.ndarray)]


def advanced(key):
    """Whether a NumPy index (from index()) is advanced: a gather or scatter kernel, not a view."""
    return any(isinstance(k, (numpy.ndarray, list)) for k in key)


def _method(name):
    """A method of numpy.ndarray with CuPy's argument rules (cupy arrays only)."""
    def method(self, *args, **kwargs):
        return call(getattr(self._a, name), args, kwargs, self)
    method.__name__ = method.__qualname__ = name
    return method


# The rest of CuPy's ndarray methods (core.pyx), done by NumPy. Nothing else exists on the class:
# a NumPy-only method (ctypes, tostring, itemset, resize, ...) is an AttributeError, as in CuPy.
for _name in ("transpose", "swapaxes", "flatten", "ravel", "squeeze", "take", "argsort",
              "argpartition", "diagonal", "max", "argmax", "min", "argmin", "clip", "round",
              "trace", "sum", "cumsum", "mean", "var", "std", "prod", "cumprod", "all", "any",
              "conj", "conjugate", "repeat", "choose", "sort", "partition", "searchsorted", "put"):
    setattr(ndarray, _name, _method(_name))


@_strict.device_work
def scatter(ufunc, a, slices, value):
    """cupyx.scatter_add and friends: `ufunc.at`, so repeated indices all count."""
    check_device(a)
    if isinstance(value, numpy.ndarray) and value.ndim:
        refuse_host(value, "value")
    k, v = index(slices), elementwise_operand(value)
    target = a._a[k]        # each element it adds into is read and written
    _strict.launch("elementwise", f"scatter_{ufunc.__name__}", read=(v, *indices(k), target.size * target.itemsize),
                   written=(target.size * target.itemsize,))
    with quiet():
        ufunc.at(a._a, k, v)


from . import _gemm as _routines_linalg      # noqa: E402  (it uses this module's wrap and checks)
from ._gemm import set_compute_type  # noqa: E402,F401
