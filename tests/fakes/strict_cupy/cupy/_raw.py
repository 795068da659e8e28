"""cupy.RawKernel for kernels that name a NumPy twin.

The stand-in cannot run CUDA C. A kernel source that holds a line `// twin: module:function`
names the NumPy function that computes what the kernel computes, from the same arguments, in
place on the output arrays (npmegatron's autograd/row_kernels.py); calling the kernel records one
launch ("raw") and runs the twin on the arrays' NumPy data. Other sources are refused at
construction, as anything else the stand-in does not emulate. CuPy's launch rules that catch bugs
are kept: grid and block are tuples, a block holds at most 1024 threads, arguments are a tuple of
device arrays (on the current device, C-ordered: a kernel indexes raw memory) and NumPy scalars
(a Python scalar's C type would be CuPy's guess, not the kernel's).

The bytes a call reads and writes (cupy._strict.traffic) follow the kernel's parameters: an array
passed as a `const` pointer is read; one passed as another pointer is written, and read as well
when the twin's results depend on what it held before (the twin is run once more on copies of
the arguments with that array's bytes inverted: a kernel that adds into its output, or rounds an
array in place, reads it; one that only stores into it does not). An array passed as a `const`
pointer and again as another pointer that the twin leaves as it was is read only (a kernel given
its input again where one of its variants writes a copy, LayerNorm's 16-bit input). Each distinct
array counts its bytes once (a kernel given the same array for two parameters reads it once)."""
import importlib
import re

import numpy

from . import _strict
from ._core import check_device, ndarray

_TWIN = re.compile(r"//\s*twin:\s*([\w.]+):(\w+)")


class RawKernel:
    def __init__(self, code, name, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, jitify=False):
        found = _TWIN.search(code)
        if found is None:
            raise NotImplementedError("cupy.RawKernel: the strict stand-in runs only kernels whose "
                                      "source names a NumPy twin (`// twin: module:function`)")
        if not re.search(rf"__global__\s+void\s+{re.escape(name)}\s*\(", code):
            raise ValueError(f"cupy.RawKernel: no __global__ function {name!r} in the source "
                             "(CuPy's first launch would fail in cuModuleGetFunction)")
        self.code, self.name = code, name
        self.twin = getattr(importlib.import_module(found.group(1)), found.group(2))
        self.const = _const_pointers(code, name)

    @_strict.device_work
    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        for what, dims in (("grid", grid), ("block", block)):
            if not isinstance(dims, tuple) or not 1 <= len(dims) <= 3 or \
                    not all(isinstance(d, int) and d > 0 for d in dims):
                raise ValueError(f"cupy.RawKernel {what} must be a tuple of 1 to 3 positive ints, got {dims!r}")
        if int(numpy.prod(block)) > 1024:
            raise ValueError(f"a block of {block} threads is more than CUDA's 1024")
        if not isinstance(args, tuple):
            raise TypeError(f"cupy.RawKernel args must be a tuple, got {type(args).__name__}")
        values = []
        for i, a in enumerate(args):
            if isinstance(a, ndarray):
                check_device(a)
                if not a._a.flags.c_contiguous:
                    raise ValueError(f"argument {i} of {self.name} is not C-ordered (strides {a.strides}); "
                                     "the kernel would read it as if it were")
                values.append(a._a)
            elif isinstance(a, numpy.generic):
                values.append(a)
            else:
                raise TypeError(f"argument {i} of {self.name} is a {type(a).__name__}: pass device arrays "
                                "and NumPy scalars (numpy.int32, numpy.float64, ...)")
        with _strict.emulating():
            if _strict.replaying():
                self.twin(*values)
                return
            before = [v.copy() if isinstance(v, numpy.ndarray) else v for v in values]
            self.twin(*values)
            read, written = [], []
            constant = [id(v) for i, v in enumerate(values) if i < len(self.const) and self.const[i]]
            for i, v in enumerate(values):
                if not isinstance(v, numpy.ndarray):
                    continue
                if i < len(self.const) and self.const[i]:
                    read.append(v)
                    continue
                if id(v) in constant and v.tobytes() == before[i].tobytes():
                    continue        # the input again, unwritten
                written.append(v)
                if self._reads(before, values, i):
                    read.append(v)
        _strict.launch("raw", self.name, read=read, written=written)

    def _reads(self, before, after, i):
        """Whether the twin's results depend on what array argument `i` held before the call."""
        trial = [v.copy() if isinstance(v, numpy.ndarray) else v for v in before]
        bits = trial[i].reshape(-1).view(numpy.uint8)
        numpy.invert(bits, out=bits)
        with numpy.errstate(all="ignore"):
            self.twin(*trial)
        return any(isinstance(v, numpy.ndarray) and (j < len(self.const) and not self.const[j])
                   and v.tobytes() != w.tobytes() for j, (v, w) in enumerate(zip(trial, after)))


def _const_pointers(code, name):
    """Per parameter of the kernel `name` in `code`: whether it is a `const` pointer."""
    found = re.search(rf"__global__\s+void\s+{re.escape(name)}\s*\(([^)]*)\)", code)
    return [p.strip().startswith("const") and "*" in p for p in found.group(1).split(",")]
