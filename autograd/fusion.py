"""Elementwise chains written once: `cupy.fuse` compiles them on the GPU, NumPy runs the same body.

A chain is a Python function `body(xp, *arrays_and_scalars)` decorated with `@fused`. On CuPy
arrays it runs as one kernel made by `cupy.fuse`; on NumPy arrays the very same body runs
directly, so the CPU tests check the code the GPU compiles. `Fused.__call__` is the one place
that picks the path; on the CPU, large arrays go through the
multithreaded block engine of `cpu_blocks.py`, which runs the same body on blocks of rows.

The rules a body follows, read from CuPy's source (cupy/cupy, `cupy/_core/fusion.pyx`,
`cupy/_core/new_fusion.pyx`, `cupy/_core/_fusion_interface.py`, `cupy/_core/_fusion_trace.pyx`):

* Ufuncs come from `xp`, never from `numpy`. Under `cupy.fuse` the arguments are proxies
  (`_FusionVarArray`/`_ArrayProxy`) that define no `__array_ufunc__`; only CuPy's own ufuncs
  notice a trace (`_kernel.pyx`: `ufunc.__call__` checks `_fusion_thread_local.is_fusing()`), as do
  `cupy.where` (`_sorting/search.py`) and `cupy.clip`. So the decorator hands the body
  `xp`: NumPy (plus scipy's erf) on the CPU, CuPy (plus cupyx's erf, also a ufunc) on the GPU,
  bound with `functools.partial`. `Fusion.__init__` takes `name or func.__name__`, and a partial
  has no `__name__`, so `kernel_name` is always given (the body's name).
* Only elementwise ufunc calls, arithmetic and comparison operators, `astype`, `xp.where`, and
  in-place updates: `a += b` and `out=` are accepted on array proxies (`call_ufunc` takes an `out`
  that is an array proxy) and write to the argument itself on both paths, so a body may update its
  arguments in place (AdamW) but never returns an argument.
* No Python control flow on values: `bool()`, `int()`, `float()` of a proxy raise; `.shape` raises
  (`_VariableProxy.shape`); indexing is basic slicing only (we use none); a NumPy or CuPy array
  captured from the enclosing scope is refused ("Concrete ndarray is not supported in fusion").
* Reductions only as the last step (`_call_reduction`: "Multiple reduction is not implemented";
  `cupy.sum` in a fusion refuses `keepdims`): a body made with `@fused_reduction` ends with one
  `xp.sum(..., axis=...)`, so the elementwise work before it and the reduction are one kernel. On
  the CPU such a body always runs once on the whole arrays (row blocks would cut a column sum).
* Results: an array, a tuple of arrays, or None (`_fusion_trace.trace`).
* Scalars: Python scalars, passed as arguments or written as constants, are weak (the array's
  dtype wins) on both paths, so float32 stays float32. NumPy scalars are turned into Python ones
  here (NumPy 2 would let a numpy.float64 promote a float32 array). Scalar-with-scalar arithmetic
  is not done in a body: under the old fusion its result is a strong float64 that would push the
  array math to double on the GPU; such values are computed on the host and passed in.
* Kernels are cached per (dtypes, ndims) of the arguments (`Fusion.__call__`'s key), so one
  decorated function is made once at import, never inside a loop.
"""
import functools
import importlib

import numpy

from .cpu_blocks import WHOLE as _WHOLE, run_chain

#: Every chain by name: the strict-fusion test runs each one.
CHAINS = {}


class ArrayFunctions:
    """The `xp` a body sees: an array module, plus `erf`, which lives in scipy.special and
    cupyx.scipy.special rather than in NumPy or CuPy. Attributes are looked up once and cached."""

    def __init__(self, module, erf_module):
        self._module, self._erf_module = module, erf_module

    def __getattr__(self, name):
        owner = importlib.import_module(self._erf_module) if name == "erf" else self._module
        value = getattr(owner, name)
        setattr(self, name, value)
        return value


NUMPY_FUNCTIONS = ArrayFunctions(numpy, "scipy.special")


class Fused:
    """One chain: `body(xp, *args)` run by NumPy on host arrays, by `cupy.fuse` on CuPy arrays."""

    def __init__(self, body, reduction=False):
        functools.update_wrapper(self, body)
        self.body, self.name, self.reduction = body, body.__name__, reduction
        self._kernel = None

    def __call__(self, *args):
        # One loop, no helper calls (a GPU step makes a few hundred of these calls, and the host
        # issuing them is what bounds an eager step). A CuPy array (or a cupy.fuse proxy, when one
        # chain calls another) sends the chain to the GPU; a NumPy scalar becomes the Python scalar
        # of the same value, so it stays weak on both paths, except unsigned integers: hash
        # constants above 2**63 have no weak Python form that both NumPy and CuPy keep in uint64.
        on_gpu, converted = False, None
        for i, a in enumerate(args):
            if type(a).__module__.startswith("cupy"):
                on_gpu = True
            elif isinstance(a, numpy.generic) and a.dtype.kind != "u":
                converted = list(args) if converted is None else converted
                converted[i] = a.item()
        if converted is not None:
            args = tuple(converted)
        if on_gpu:
            kernel = self._kernel if self._kernel is not None else self.kernel()
            return kernel(*args)
        result = _WHOLE if self.reduction else run_chain(self.body, NUMPY_FUNCTIONS, args)
        if result is _WHOLE:
            return self.body(NUMPY_FUNCTIONS, *args)
        return result

    def kernel(self):
        """The cupy.fuse function, made on first GPU use (CuPy is imported only then)."""
        if self._kernel is None:
            import cupy
            xp = ArrayFunctions(cupy, "cupyx.scipy.special")
            self._kernel = cupy.fuse(kernel_name=self.name)(functools.partial(self.body, xp))
        return self._kernel

    def __repr__(self):
        return f"<fused chain {self.name}>"


def fused(body, reduction=False):
    """Decorator: make `body(xp, ...)` a chain (see the module docstring for what it may do)."""
    known = CHAINS.get(body.__name__)
    if known is not None and (known.__module__, known.__qualname__) != (body.__module__, body.__qualname__):
        raise ValueError(f"two fused chains are named {body.__name__!r} ({known.__module__} and "
                         f"{body.__module__}); kernel names must be unique")
    chain = CHAINS[body.__name__] = Fused(body, reduction)
    return chain


def fused_reduction(body):
    """Decorator: a chain that ends with one reduction (module docstring)."""
    return fused(body, reduction=True)
