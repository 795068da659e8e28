"""`a @ b`, cupy.matmul and cupy.dot as CuPy 14 takes them to cuBLAS (cupy/_core/_routines_linalg.pyx:
`dot`, `tensordot_core`, `tensordot_core_v11`, `matmul`), recorded launch by launch, so tests can
see the GEMMs a model asks for and the copies CuPy makes on the way.

What CuPy does and is recorded here (compute capability 8.0 or more, no HIP):
* at most 2-D (`dot`): operands of another dtype are cast (a copy each); an operand neither C- nor
  F-contiguous is copied (`_mat_to_cublas_contiguous`); then one `gemmEx` whose transposes
  follow the operands' memory order and whose compute type is `get_compute_type(dtype)`: 32F for
  float32 (32F_FAST_TF32 after `set_compute_type(float32, COMPUTE_TYPE_TF32)` or with CUPY_TF32=1),
  64F for float64, 32F for float16 and bfloat16 (their products accumulated in float32);
* more than 2-D (`matmul`): float16 is computed in float32 (both operands cast, the result cast
  back), every operand that is not C-contiguous in the compute dtype is copied
  (`ascontiguousarray`), the transposes are always N, N, and the compute type is the dtype itself
  (the TF32 setting is not read); a broadcast batch goes through `sgemmBatched`/`dgemmBatched`
  after three pointer kernels; any other dtype (bfloat16 included) goes to CuPy's integer
  kernel, not to cuBLAS;
* an `out=` that is not C-contiguous or not of the result dtype gets a temporary and a copy.
The values are NumPy's matmul of the operands, in the result dtype."""
import os

import numpy

from . import _core, _strict

COMPUTE_TYPE_TBD, COMPUTE_TYPE_DEFAULT, COMPUTE_TYPE_PEDANTIC = 0, 1, 2
COMPUTE_TYPE_FP16, COMPUTE_TYPE_FP32, COMPUTE_TYPE_FP64 = 3, 4, 5
COMPUTE_TYPE_BF16, COMPUTE_TYPE_TF32 = 6, 7
_compute_types = {}         # dtype name -> compute type set by set_compute_type
CUDA_NAMES = {"float16": "R_16F", "bfloat16": "R_16BF", "float32": "R_32F", "float64": "R_64F",
              "complex64": "C_32F", "complex128": "C_64F"}


def set_compute_type(dtype, compute_type):
    """cupy._core.set_compute_type: process-wide, per dtype."""
    if compute_type not in range(8):
        raise ValueError(f"Unknown compute type: {compute_type}")
    _compute_types[numpy.dtype(dtype).name] = compute_type


def get_compute_type(dtype):
    name = numpy.dtype(dtype).name
    if name not in _compute_types:
        tf32 = name in ("float32", "complex64") and int(os.environ.get("CUPY_TF32", "0")) > 0
        _compute_types[name] = COMPUTE_TYPE_TF32 if tf32 else COMPUTE_TYPE_DEFAULT
    return _compute_types[name]


def _cublas_compute(dtype):
    """The cuBLAS compute type tensordot_core_v11 passes for a result of `dtype`."""
    name, chosen = numpy.dtype(dtype).name, get_compute_type(dtype)
    if name in ("float16", "bfloat16", "float32", "complex64"):
        if chosen == COMPUTE_TYPE_PEDANTIC:
            return "32F_PEDANTIC"
        return "32F_FAST_TF32" if chosen == COMPUTE_TYPE_TF32 and name in ("float32", "complex64") else "32F"
    if name in ("float64", "complex128"):
        return "64F_PEDANTIC" if chosen == COMPUTE_TYPE_PEDANTIC else "64F"
    raise ValueError(f"Invalid dtype: {dtype}")


def _hidden_copy(a, why, dtype=None):
    """A copy CuPy makes inside the call: a launch and a temporary allocation."""
    _strict.launch("copy", "hidden copy", read=(a,), written=(a.size * numpy.dtype(dtype or a.dtype).itemsize,),
                   hidden=why, dtype=str(dtype or a.dtype), shape=a.shape)
    _strict.allocated(a.size * numpy.dtype(dtype or a.dtype).itemsize)
    _strict.freed(a.size * numpy.dtype(dtype or a.dtype).itemsize)


def _operands(a, b):
    for x in (a, b):
        if type(x) is not _core.ndarray:
            _core.refuse_host(x, "matmul operand")
        _core.check_device(x)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("Scalar operands are not allowed, use '*' instead")


def _result(a, b, dtype, out):
    """NumPy's product in `dtype`, written to `out` when given."""
    with _core.quiet():
        value = numpy.matmul(a._a, b._a).astype(dtype, copy=False)
    if out is None:
        return _core.wrap(value)
    _core.check_device(out)
    out._a[...] = value
    return out


@_strict.device_work
def dot(a, b, out=None):
    """cupy.dot (and matmul of at most 2-D operands) on `_routines_linalg.dot`."""
    _operands(a, b)
    dtype = numpy.promote_types(a.dtype, b.dtype)
    if out is not None and (not out.flags.c_contiguous or out.dtype != dtype):
        result = dot(a, b)
        _strict.launch("copy", "hidden copy", read=(result,), written=(out,), hidden="out= of another layout or dtype",
                       dtype=str(out.dtype), shape=out.shape)
        out._a[...] = result._a
        return out
    left = a._a.reshape(1, -1) if a.ndim == 1 else a._a
    right = b._a.reshape(-1, 1) if b.ndim == 1 else b._a
    n, k, m = left.shape[0], left.shape[1], right.shape[1]
    written = (n * m * dtype.itemsize,)       # the (n, m) product
    if n == 1 and m == 1:
        _strict.launch("reduction", "_tensordot_core_mul_sum", read=(a, b), written=written, dtype=str(dtype))
        return _result(a, b, dtype, out)
    for operand in (a, b):
        if operand.dtype != dtype:
            _hidden_copy(operand, f"cast {operand.dtype} to {dtype}", dtype)
    transposes = []
    for operand, transpose in ((left.T, 0), (right, 1)):    # (k, n) and (k, m), as tensordot_core
        if operand.flags.f_contiguous:
            transposes.append(transpose)
        else:
            if not operand.flags.c_contiguous:
                _hidden_copy(operand, "operand neither C- nor F-contiguous", dtype)
            transposes.append(1 - transpose)
    if dtype.kind in "biu":
        _strict.launch("elementwise", "_integral_tensordot_core", read=(a, b), written=written, dtype=str(dtype))
    else:
        flag = "NT"
        _strict.refuse_cublas_in_capture()
        _strict.launch("gemm", "gemmEx", read=(a, b), written=written, routine="gemmEx", a=str(dtype), b=str(dtype),
                       c=str(dtype),
                       compute=_cublas_compute(dtype), transa=flag[transposes[1]], transb=flag[transposes[0]],
                       m=m, n=n, k=k, batch=1)
    return _result(a, b, dtype, out)


@_strict.device_work
def matmul(a, b, out=None):
    """cupy.matmul and `@`."""
    _operands(a, b)
    ndim = max(a.ndim, b.ndim)
    if ndim <= 2:
        return dot(a, b, out)
    ret_dtype = numpy.promote_types(a.dtype, b.dtype)
    dtype = numpy.dtype(numpy.float32) if ret_dtype == numpy.float16 else ret_dtype
    for operand in (a, b):
        if operand.dtype != dtype:
            _hidden_copy(operand, f"cast {operand.dtype} to {dtype} for a batched GEMM", dtype)
        elif not operand._a.flags.c_contiguous:
            _hidden_copy(operand, "batched operand not C-contiguous", dtype)
    left = a._a.reshape((1,) * (ndim - a.ndim) + a.shape) if a.ndim > 1 else a._a.reshape(1, -1)
    right = b._a.reshape((1,) * (ndim - b.ndim) + b.shape) if b.ndim > 1 else b._a.reshape(-1, 1)
    batch_shape = numpy.broadcast_shapes(left.shape[:-2], right.shape[:-2])
    broadcast = left.shape[:-2] != batch_shape or right.shape[:-2] != batch_shape
    n, k, m = left.shape[-2], left.shape[-1], right.shape[-1]
    fields = dict(a=str(dtype), b=str(dtype), c=str(dtype), transa="N", transb="N", m=m, n=n, k=k,
                  batch=int(numpy.prod(batch_shape)))
    product = fields["batch"] * n * m * dtype.itemsize
    # the operands as the GEMM reads them: in the compute dtype (a cast or copy's result)
    read = [x.size * dtype.itemsize if x.dtype != dtype or not x._a.flags.c_contiguous else x for x in (a, b)]
    if dtype.char not in "efdFD":
        _strict.launch("elementwise", "_integral_tensordot_core_batched", read=read, written=(product,),
                       dtype=str(dtype), shape=batch_shape)
    elif broadcast:
        for _ in range(3):
            _strict.launch("elementwise", "cupy_mat_ptrs")
        routine = {"float32": "sgemmBatched", "float64": "dgemmBatched"}.get(dtype.name, "gemmBatched")
        _strict.refuse_cublas_in_capture()
        _strict.launch("gemm", routine, read=read, written=(product,), routine=routine, compute=CUDA_NAMES[dtype.name],
                       **fields)
    else:
        _strict.refuse_cublas_in_capture()
        _strict.launch("gemm", "gemmStridedBatchedEx", read=read, written=(product,), routine="gemmStridedBatchedEx",
                       compute=CUDA_NAMES[dtype.name], **fields)
    if dtype != ret_dtype or (out is not None and (out.dtype != dtype or not out.flags.c_contiguous)):
        _strict.launch("copy", "hidden copy", read=(product,), written=(product // dtype.itemsize * ret_dtype.itemsize,),
                       hidden=f"result from {dtype} to {ret_dtype}", dtype=str(ret_dtype))
    return _result(a, b, ret_dtype, out)
