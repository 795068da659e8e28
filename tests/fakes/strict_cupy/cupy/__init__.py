"""A strict NumPy-backed stand-in for CuPy 14, for tests on machines without a GPU.

Put its folder (tests/fakes/strict_cupy, see activate.py) first on sys.path / PYTHONPATH and
`import cupy`, `import cupyx`, `from cupy.cuda import nccl` get this package instead of CuPy.
It behaves as CuPy does where bugs hide, and is stricter where that catches them:

* cupy.ndarray (cupy._core) wraps a NumPy array "on the device": implicit conversion raises
  (`numpy.asarray(x)`, `numpy.exp(x)`, `numpy.sum(x)`, `numpy_array + x`); NumPy arrays and lists
  are refused as operands and in cupy.* functions other than asarray/array; reductions and
  scalar indexing give 0-d cupy arrays; each array belongs to the device current at its
  allocation, and using it while another device is current raises ValueError; `empty` memory
  reads as NaN / 0xA5 bytes.
* Host interactions are counted (cupy._strict):
    counters()           -> {"sync": n, "upload": n, "query": n, "download": n}
    reasons(kind)        -> Counter of reasons ("get", "float", "bool", "mask_index", ...)
    records(kind=None)   -> [Record(kind, reason, where)], where = "file:line in function" of
                            the first frame outside the stand-in
    report(kind)         -> a readable summary for assertion messages
    forbid(*kinds)       -> context manager: HostSyncError at the first such interaction
    expect(sync=0, ...)  -> context manager: assert exact counts inside the block
    events(prefix=None)  -> the CUDA/NCCL/fusion call log (dicts with "what")
    reset()              -> clear counters, records and the log
  "sync": .get(), .item(), .tolist(), .tobytes(), float/int/bool/complex(), repr/str/format,
  `in`, pickling, cupy.asnumpy, boolean-mask indexing (get and set), nonzero, argwhere,
  flatnonzero, unique, where(cond), compress, extract, bincount, set routines,
  Stream/Device/Event.synchronize(). "upload": cupy.asarray/array of host data, NumPy arrays
  or lists as indices, ndarray.set. "query": Event.done, Stream.done. "download":
  .get(blocking=False).
* cupy.fuse (cupy._fusion) runs the body on proxies that refuse what CuPy's fusion refuses.
* cupy.random: NumPy generators behind CuPy's API; no generator state can be read or saved.
* cupy.cuda: runtime.getDeviceCount() from env STRICT_CUPY_DEVICES (default 8; 0/none: no
  driver), Device, Stream, Event, get_current_stream; cupy.cuda.nccl over MPI.
* cupy.RawKernel for sources that name a NumPy twin (cupy._raw).
* cupyx.scatter_add, cupyx.scipy.special.erf.

The rest of `cupy.<name>` is NumPy's function of that name under CuPy's rules, for the names
CuPy 14's top level has (cupy._cupy_names)."""
from . import _strict  # noqa: F401
from ._core import HostArrayError, ndarray  # noqa: F401
from ._functions import (array, asanyarray, asarray, asnumpy, get_array_module,  # noqa: F401
                         lookup as _lookup, ufunc)
from ._fusion import fuse  # noqa: F401
from . import cuda, lib, random  # noqa: F401
from ._raw import RawKernel  # noqa: F401

__version__ = "14.0.0"
_cache = {}


def is_available():
    return cuda.is_available()


_MemoryPool = cuda.MemoryPool
_pool, _pinned_pool = _MemoryPool(), _MemoryPool()


def get_default_memory_pool():
    return _pool


def get_default_pinned_memory_pool():
    return _pinned_pool


def _not_emulated(name):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"cupy.{name} (a CUDA kernel) is not emulated by the strict stand-in")
    return refuse


ElementwiseKernel = _not_emulated("ElementwiseKernel")
ReductionKernel = _not_emulated("ReductionKernel")
RawModule = _not_emulated("RawModule")


def __getattr__(name):
    """cupy.<name>: NumPy's function, ufunc, type or constant under CuPy's rules (cached)."""
    if name.startswith("__"):
        raise AttributeError(name)
    if name not in _cache:
        _cache[name] = _lookup(name)
    return _cache[name]
