"""cupy.cuda.cublas stand-in (cupy_backends/cuda/libs/cublas.pyx): `gemmEx` and
`gemmStridedBatchedEx` as cuBLAS takes them, on raw device pointers, column-major.

Each call is checked the way cuBLAS would fail or silently misread: every pointer must lie inside a
live cupy allocation of the current device with room for the matrices its leading dimension and
batch stride describe; a leading dimension below the stored matrix's row count is
CUBLAS_STATUS_INVALID_VALUE; the compute type must suit the data types (64F for float64, 32F or
32F_FAST_TF32 for float32, 32F for float16 and bfloat16 inputs; anything else is
CUBLAS_STATUS_NOT_SUPPORTED); alpha and beta are read from host memory in the compute type's
precision. 32F_FAST_16BF and 32F_FAST_16F on float32 inputs let cuBLAS convert A and B to 16 bits:
the stand-in refuses inputs that are not already on that grid, where the conversion would change
them (a real GPU would silently round). The product is NumPy's, computed in float32 for 16-bit inputs, and written through the
column-major view of C. One launch is recorded per call, with its dtypes, compute type, transposes,
sizes, leading dimensions and strides.

While a stream captures, these bindings refuse every call, as CuPy's do (its setStream raises
NotImplementedError). `c_api` stands for the library's C API, which cuBLAS lets a capture record
once the handle's stream is the capturing one and the handle holds a workspace of the caller's
(cublasSetWorkspace after cublasSetStream, which resets it): the stand-in refuses a captured
product without both."""
import ctypes

import numpy

from .. import _core, _strict
from . import runtime
from .stream import get_current_stream

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_PEDANTIC = 68, 69
CUBLAS_COMPUTE_32F_FAST_16F, CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_COMPUTE_32F_FAST_TF32 = 74, 75, 77
CUBLAS_COMPUTE_64F, CUBLAS_COMPUTE_64F_PEDANTIC = 70, 71
COMPUTE_NAMES = {CUBLAS_COMPUTE_32F: "32F", CUBLAS_COMPUTE_32F_PEDANTIC: "32F_PEDANTIC",
                 CUBLAS_COMPUTE_32F_FAST_TF32: "32F_FAST_TF32", CUBLAS_COMPUTE_32F_FAST_16F: "32F_FAST_16F",
                 CUBLAS_COMPUTE_32F_FAST_16BF: "32F_FAST_16BF", CUBLAS_COMPUTE_64F: "64F",
                 CUBLAS_COMPUTE_64F_PEDANTIC: "64F_PEDANTIC"}


def _bfloat16():
    import ml_dtypes
    return numpy.dtype(ml_dtypes.bfloat16)


#: cudaDataType -> NumPy dtype (runtime.CUDA_R_*)
def _dtype(code):
    table = {runtime.CUDA_R_16F: numpy.dtype(numpy.float16), runtime.CUDA_R_32F: numpy.dtype(numpy.float32),
             runtime.CUDA_R_64F: numpy.dtype(numpy.float64)}
    if code == runtime.CUDA_R_16BF:
        return _bfloat16()
    if code not in table:
        raise CUBLASError(7, f"data type {code} is not one the stand-in knows")
    return table[code]


class CUBLASError(RuntimeError):
    """cuBLAS status `status` (7: INVALID_VALUE, 15: NOT_SUPPORTED, 14: INTERNAL_ERROR)."""

    NAMES = {7: "CUBLAS_STATUS_INVALID_VALUE", 15: "CUBLAS_STATUS_NOT_SUPPORTED",
             14: "CUBLAS_STATUS_INTERNAL_ERROR"}

    def __init__(self, status, why=""):
        self.status = status
        super().__init__(f"{self.NAMES.get(status, status)}" + (f": {why}" if why else ""))


def _check_compute(compute, dtypes):
    names = {d.name for d in dtypes[:2]}
    allowed = ({CUBLAS_COMPUTE_64F, CUBLAS_COMPUTE_64F_PEDANTIC} if names == {"float64"} else
               {CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_COMPUTE_32F_FAST_TF32,
                CUBLAS_COMPUTE_32F_FAST_16F, CUBLAS_COMPUTE_32F_FAST_16BF}
               if names == {"float32"} else
               {CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_PEDANTIC} if len(names) == 1 else set())
    if compute not in allowed or (names == {"float64"}) != (dtypes[2].name == "float64"):
        raise CUBLASError(15, f"compute type {compute} with A, B, C of {[d.name for d in dtypes]}")


def _check_on_grid(compute, a, b):
    """Under 32F_FAST_16F / 32F_FAST_16BF, A and B must lie on the 16-bit grid (inf included)."""
    grid = {CUBLAS_COMPUTE_32F_FAST_16F: numpy.float16, CUBLAS_COMPUTE_32F_FAST_16BF: _bfloat16()}.get(compute)
    if grid is None:
        return
    for what, x in (("A", a), ("B", b)):
        with numpy.errstate(over="ignore", invalid="ignore"):
            moved = x.astype(grid).astype(x.dtype) != x
        if numpy.any(moved & ~numpy.isnan(x)):
            raise AssertionError(f"{COMPUTE_NAMES[compute]}: {what} holds {int(moved.sum())} values off the "
                                 f"{numpy.dtype(grid).name} grid, which cuBLAS would round")


def _scalar(ptr, compute):
    kind = ctypes.c_double if compute in (CUBLAS_COMPUTE_64F, CUBLAS_COMPUTE_64F_PEDANTIC) else ctypes.c_float
    return kind.from_address(ptr).value


def _matrix(ptr, dtype, rows, cols, ld, stride, batch, what):
    """The column-major (batch, rows, cols) NumPy view cuBLAS reads at `ptr`."""
    if ld < max(1, rows):
        raise CUBLASError(7, f"{what}: leading dimension {ld} < {rows} rows")
    item = dtype.itemsize
    span = ((batch - 1) * stride + (cols - 1) * ld + rows) * item if rows and cols and batch else 0
    entry = _core.find_buffer(ptr, span) if span else None
    if span and entry is None:
        raise CUBLASError(14, f"{what} at {ptr:#x}: {span} bytes are not inside one live cupy allocation")
    if span and entry.device != runtime.getDevice():
        raise CUBLASError(14, f"{what} is on device {entry.device}, the call on {runtime.getDevice()}")
    if not span:
        return numpy.zeros((batch, rows, cols), dtype)
    memory = numpy.frombuffer((ctypes.c_ubyte * entry.nbytes).from_address(entry.start), numpy.uint8)
    return numpy.ndarray((batch, rows, cols), dtype, buffer=memory, offset=ptr - entry.start,
                         strides=(stride * item, item, ld * item))


def _gemm(routine, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB,
          beta, C, Ctype, ldc, strideC, batch, compute):
    # alpha and beta are read now, from host memory, as cuBLAS reads them (a graph keeps the values)
    _gemm_on(routine, transa, transb, m, n, k, _scalar(alpha, compute), A, Atype, lda, strideA, B, Btype, ldb,
             strideB, _scalar(beta, compute), C, Ctype, ldc, strideC, batch, compute)


@_strict.device_work
def _gemm_on(routine, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB,
             beta, C, Ctype, ldc, strideC, batch, compute):
    dtypes = [_dtype(Atype), _dtype(Btype), _dtype(Ctype)]
    _check_compute(compute, dtypes)
    if min(m, n, k, batch) < 0 or transa not in (0, 1) or transb not in (0, 1):
        raise CUBLASError(7, f"m={m} n={n} k={k} batch={batch} transa={transa} transb={transb}")
    a = _matrix(A, dtypes[0], *((k, m) if transa else (m, k)), lda, strideA, batch, "A")
    b = _matrix(B, dtypes[1], *((n, k) if transb else (k, n)), ldb, strideB, batch, "B")
    c = _matrix(C, dtypes[2], m, n, ldc, strideC, batch, "C")
    _strict.launch("gemm", routine, read=(a, b, c) if beta else (a, b), written=(c,),      # C is read when beta != 0
                   routine=routine, a=dtypes[0].name, b=dtypes[1].name, c=dtypes[2].name,
                   compute=COMPUTE_NAMES[compute], transa="NT"[transa], transb="NT"[transb], m=m, n=n, k=k,
                   batch=batch, lda=lda, ldb=ldb, ldc=ldc, strides=(strideA, strideB, strideC), direct=True)
    _check_on_grid(compute, a, b)
    work = numpy.float64 if dtypes[2].name == "float64" else numpy.float32
    op_a = a.astype(work).swapaxes(1, 2) if transa else a.astype(work)
    op_b = b.astype(work).swapaxes(1, 2) if transb else b.astype(work)
    value = alpha * numpy.matmul(op_a, op_b)
    if beta:
        value += beta * c.astype(work)
    c[...] = value.astype(dtypes[2])


def gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
           computeType, algo):
    _strict.refuse_cublas_in_capture()
    _gemm("gemmEx", transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0, beta, C, Ctype,
          ldc, 0, 1, computeType)


def gemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
                         strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
    _strict.refuse_cublas_in_capture()
    _gemm("gemmStridedBatchedEx", transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
          strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType)


class _CApi:
    """libcublas's C entry points as ctypes calls them (pointers as ints; status 0 returned)."""

    def __init__(self):
        self.handles = {}       # handle -> {"stream": pointer, "workspace": (pointer, bytes) or None}

    def cublasSetStream_v2(self, handle, stream):
        self.handles[handle] = {"stream": stream, "workspace": None}
        return 0

    def cublasSetWorkspace_v2(self, handle, workspace, nbytes):
        if _core.find_buffer(workspace, nbytes) is None:
            raise CUBLASError(7, f"workspace at {workspace:#x}: {nbytes} bytes are not inside one live allocation")
        self.handles.setdefault(handle, {"stream": 0})["workspace"] = (workspace, nbytes)
        return 0

    def _ready(self, handle, routine):
        state = self.handles.get(handle, {})
        if state.get("stream") != get_current_stream().ptr:
            raise _strict.StreamCaptureError(f"{routine} on a handle whose stream is not the current one: "
                                             "cublasSetStream first")
        if _strict.capturing() and not state.get("workspace"):
            raise _strict.StreamCaptureError(f"{routine} captured on a handle without a workspace of the caller's "
                                             "(cublasSetWorkspace after cublasSetStream)")

    def cublasGemmEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
                     ldc, computeType, algo):
        self._ready(handle, "cublasGemmEx")
        _gemm("gemmEx", transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0, beta, C, Ctype,
              ldc, 0, 1, computeType)
        return 0

    def cublasGemmStridedBatchedEx(self, handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype,
                                   ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
        self._ready(handle, "cublasGemmStridedBatchedEx")
        _gemm("gemmStridedBatchedEx", transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
              strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType)
        return 0


c_api = _CApi()
