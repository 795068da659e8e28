"""Intel MKL for the CPU's large GEMMs, where the `mkl` package is installed (the `mkl` extra).

NumPy's wheels multiply with OpenBLAS and cannot be pointed at another BLAS. PyTorch's CPU wheels
multiply with MKL. Which of the two is faster depends on the CPU: on 2 threads of one AMD EPYC
instance MKL ran GPT-2 124M's Linear GEMMs about 10 % faster than OpenBLAS (1-16 % by shape), on a
Zen 4 instance 11-13 % slower (1-28 % by shape; docs/benchmarks.md). With the extra installed,
gemm.py calls MKL's CBLAS itself, through ctypes, for float32 and float64 products that are one
matrix product: a Linear's (b, t, k) @ (k, n) with its rows folded, or any two matrices. The call
is laid out like gemm.py's cuBLAS calls: column-major with the operands swapped, so a transposed
or strided operand is read as it lies, and `accumulate` adds into `out` with beta = 1.

Batched products stay with NumPy (OpenBLAS). These are attention's per-head blocks of 128 query
rows, at about 30 us a product, and there a ctypes call and its layout checks cost more than MKL
saves: through this path a layer's attention took 59 ms against 41 ms.

MKL is loaded once, when this module is imported. Its OpenMP threads use GNU's runtime where the
system has libgomp: the one numba's kernels use when numba runs on OpenMP (its choice here), so the
process has one OpenMP runtime and OMP_WAIT_POLICY applies to both. Loading it here also lets
threadpoolctl find it from the start, so `bench step --threads`, the ranks' budget
(comm/runtime.py) and attention's one thread a share (cpu_blocks.each_share) limit it as they limit
OpenBLAS. NPMEGATRON_CPU_BLAS=openblas keeps NumPy's own GEMMs.
"""
import ctypes
import importlib.metadata
import os

import numpy

#: CBLAS's enum values (cblas.h): column-major; no transpose, transpose
COL_MAJOR, NO_TRANS, TRANS = 102, 111, 112
#: the environment variable that turns MKL off, and its value for that
SWITCH, OFF = "NPMEGATRON_CPU_BLAS", "openblas"
#: the dtypes MKL multiplies here (native byte order: a big-endian array compares unequal)
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64))


def _library_path():
    """The path of libmkl_rt in the installed `mkl` distribution, or None."""
    try:
        files = importlib.metadata.distribution("mkl").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in files if f.name.startswith("libmkl_rt.so")]
    return str(found[0].locate()) if found else None


#: mkl_service.h's layer values: 32-bit integers; Intel's or GNU's OpenMP threads
INTERFACE_LP64, THREADING_INTEL, THREADING_GNU = 0, 0, 3


def _load():
    """(library, {dtype: cblas_?gemm}), or (None, {}) where MKL is absent, switched off or cannot
    be loaded (then NumPy's OpenBLAS multiplies, as without the extra)."""
    path = None if os.environ.get(SWITCH, "").lower() == OFF else _library_path()
    if path is None:
        return None, {}
    try:
        library = ctypes.CDLL(path)
    except OSError:
        return None, {}
    # Set before MKL's first call, whatever the environment says: 32-bit integers (the argument
    # types below), and GNU's OpenMP where the system has it (the wheel brings only Intel's).
    library.MKL_Set_Interface_Layer.argtypes = library.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
    if library.MKL_Set_Interface_Layer(INTERFACE_LP64) != INTERFACE_LP64:
        return None, {}
    library.MKL_Set_Threading_Layer(THREADING_GNU if _has_gnu_openmp() else THREADING_INTEL)
    routines = {}
    for dtype, routine, scalar in ((DTYPES[0], "cblas_sgemm", ctypes.c_float),
                                   (DTYPES[1], "cblas_dgemm", ctypes.c_double)):
        gemm = getattr(library, routine)
        i, p = ctypes.c_int, ctypes.c_void_p
        gemm.argtypes = [i, i, i, i, i, i, scalar, p, i, p, i, scalar, p, i]
        gemm.restype = None
        routines[dtype] = gemm
    return library, routines


def _has_gnu_openmp():
    try:
        ctypes.CDLL("libgomp.so.1")
    except OSError:
        return False
    return True


_library, _routines = _load()


def available():
    """Whether large NumPy products go to MKL."""
    return _library is not None


def name():
    """Which BLAS runs the Linears' GEMMs on the CPU, as `bench step` reports it."""
    return f"MKL {importlib.metadata.version('mkl')}" if available() else "OpenBLAS (NumPy's)"


def run(operands, shape, batch_dims, accumulate):
    """gemm.py's `_run` on the CPU for one matrix product (no batch dimension is left after
    folding): out^T = b^T a^T column-major, so our b is MKL's A."""
    assert not batch_dims, "cpu_blas multiplies single matrices (gemm._cpu_blas_takes)"
    a, b, out = operands
    m, k, n = shape
    flag_a, flag_b = (TRANS if op.flag else NO_TRANS for op in (a, b))
    _routines[a.dtype](COL_MAJOR, flag_b, flag_a, n, m, k, 1.0, b.ptr, b.ld, a.ptr, a.ld,
                       1.0 if accumulate else 0.0, out.ptr, out.ld)
