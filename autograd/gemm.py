"""Matrix products, written once for NumPy and for cuBLAS (and Intel MKL on the CPU, where the
`mkl` extra is installed: cpu_blas.py).

`matmul(a, b)` is `a @ b` for a (..., m, k) and b (..., k, n) with broadcast batch dimensions; with
`out=` it writes there, and with `accumulate=True` it adds to `out` (cuBLAS's beta = 1: no
temporary, no extra kernel). On NumPy it is `@`, except that with the `mkl` extra installed a
single matrix product goes to MKL (cpu_blas.py), laid out as the cuBLAS calls below. On CuPy it
calls cuBLAS itself, through CuPy's bindings (cupy.cuda.cublas.gemmEx / gemmStridedBatchedEx),
because `cupy.matmul` of more than two dimensions (CuPy 14, cupy/_core/_routines_linalg.pyx
`matmul`):
  * copies every operand that is not C-contiguous (`ascontiguousarray`), where cuBLAS reads a
    transposed or strided operand as it lies: attention's q, k and v are strided views of the
    fused QKV output, and k^T and the backward's transposes are views;
  * passes the array dtype as the compute type, so TF32 (`set_compute_type`) is never used for a
    batched product;
  * computes float16 in float32 by casting both operands and the result, and sends bfloat16 to an
    integer kernel, not to cuBLAS;
  * runs a product with a broadcast batch through sgemmBatched after three pointer kernels.
Here every product is one gemmEx (batch dimensions folded into the rows where the layout allows,
as for x (b, t, k) @ w (k, n)) or one gemmStridedBatchedEx per batch dimension that cannot be
folded into a single stride; transposes are cuBLAS flags read from the strides; the compute type
is 64F for float64, 32F for float32 (32F_FAST_TF32 after `enable_tf32()`), and 32F for float16 and
bfloat16 inputs, which may write a float32 `out` (16-bit products summed into float32 gradients).

`grid="bf16"` or `"fp16"` says that both float32 operands already lie on that 16-bit grid (the
rounding emulation of precision.py keeps activations, weights and gradients there): the compute
type becomes 32F_FAST_16BF or 32F_FAST_16F, which lets cuBLAS convert the inputs to 16 bits and
run 16-bit tensor cores with float32 sums. On the grid that conversion is exact, so the result is
the float32 product up to the order of the sums.
"""
import itertools
import math

import numpy

from . import cpu_blas, cublas_capture
from .backend import get_array_module

_settings = {"tf32": False}


def enable_tf32():
    """Multiply float32 matrices on TF32 tensor cores (inputs rounded to 10 mantissa bits, sums kept
    in float32), in this module's products and in any `cupy.matmul` (CuPy's compute type for
    float32). Process-wide; below compute capability 8.0 cuBLAS runs plain float32."""
    import cupy
    from cupy._core import _routines_linalg
    cupy._core.set_compute_type(numpy.float32, _routines_linalg.COMPUTE_TYPE_TF32)
    _settings["tf32"] = True


def matmul(a, b, out=None, accumulate=False, grid=None):
    """a @ b (written to `out` when given, added to it with accumulate=True); grid: the 16-bit
    format both operands lie on, or None (module docstring)."""
    if type(a) is not numpy.ndarray or type(b) is not numpy.ndarray:
        if get_array_module(a, b) is not numpy:
            return _cublas_matmul(a, b, out, accumulate, grid)
    if _cpu_blas_takes(a, b, out, accumulate):
        return _blas_matmul(numpy, a, b, out, accumulate, cpu_blas.run)
    return _numpy_matmul(a, b, out, accumulate)


def _cpu_blas_takes(a, b, out, accumulate):
    """Whether MKL (cpu_blas.py) computes this NumPy product: one matrix product (b a matrix, a
    a matrix or C-contiguous rows of one, as a Linear's input), aligned arrays of one of its
    dtypes, any `out` a writable row-major array of that dtype (C-contiguous where rows are
    folded) apart from both operands (BLAS would write over what it reads), and every size and
    stride within MKL's 32-bit integers. Anything else goes to NumPy, which also words the
    errors."""
    if not cpu_blas.available() or b.ndim != 2 or a.ndim < 2 or a.shape[-1] != b.shape[0]:
        return False
    if a.dtype not in cpu_blas.DTYPES or b.dtype != a.dtype or (accumulate and out is None):
        return False
    folded = a.ndim > 2
    if folded and not a.flags.c_contiguous:
        return False
    if out is not None and (out.dtype != a.dtype or out.shape != a.shape[:-1] + b.shape[1:]
                            or not out.flags.writeable or (folded and not out.flags.c_contiguous)
                            or _layout(out.shape, out.strides, out.itemsize)[0] != 0
                            or numpy.may_share_memory(out, a) or numpy.may_share_memory(out, b)):
        return False
    arrays = (a, b) if out is None else (a, b, out)
    if not all(x.flags.aligned for x in arrays):
        return False        # a stride that is no multiple of the element size (a record's field)
    spans = [a.size, b.size, math.prod(a.shape[:-1]) * b.shape[1]]
    spans += [abs(s) // x.itemsize for x in arrays for s in x.strides]
    return max(spans) < 2 ** 31


def rows(x):
    """x (..., k) as a 2-D (rows, k) array: a view wherever the leading dimensions fold."""
    return x.reshape(-1, x.shape[-1])


def _numpy_matmul(a, b, out, accumulate):
    # one 2-D GEMM over all rows: NumPy runs (b, t, k) @ (k, n) as b GEMMs of t rows, measured
    # 3-5 % slower for the model's four Linear shapes at b 8, t 256 on 2 cores
    fold = b.ndim == 2 and a.ndim > 2 and a.flags.c_contiguous
    if out is not None and not accumulate and _blas_writes(a, b, out, fold):
        numpy.matmul(rows(a) if fold else a, b, out=rows(out) if fold else out)
        return out
    product = (rows(a) @ b).reshape(a.shape[:-1] + (b.shape[-1],)) if fold else a @ b
    if out is None:
        return product
    if accumulate:
        out += product
    else:
        out[...] = product
    return out


def _blas_writes(a, b, out, fold):
    """Whether NumPy's GEMM can write a @ b into `out` itself (no temporary, no copy): out has the
    product's shape and dtype and its matrices' rows are evenly spaced runs (else NumPy would take
    its loop without BLAS), C-contiguous where the rows are folded."""
    if a.ndim < 2 or b.ndim < 2 or out.dtype != numpy.result_type(a, b):
        return False
    shape = numpy.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    if out.shape != shape or (fold and not out.flags.c_contiguous):
        return False
    return out.strides[-1] == out.itemsize and _layout(out.shape, out.strides, out.itemsize)[0] == 0


# --- cuBLAS ------------------------------------------------------------------------------------

def _cublas_matmul(a, b, out, accumulate, grid):
    """a @ b by the cached plan of its layout (_GemmPlan), made on the first product of that
    layout: a step's products repeat the same few layouts, so the host's work per product is a
    dict lookup and the cuBLAS calls, not the layout's analysis again."""
    key = (a.shape, a.strides, a.dtype, b.shape, b.strides, b.dtype, accumulate, grid, _settings["tf32"],
           None if out is None else (out.shape, out.strides, out.dtype))
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()      # shapes that keep changing (a growing KV cache): start again
        plan = _plans[key] = _GemmPlan.make(a, b, out, accumulate, grid)
    if plan is _UNPLANNED:
        return _blas_matmul(get_array_module(a, b), a, b, out, accumulate, lambda *args: _run(*args, grid))
    return plan.run(a, b, out)


#: layout key -> _GemmPlan (or _UNPLANNED: an operand cuBLAS cannot read as it lies, an empty product)
_plans = {}
MAX_PLANS = 4096
_UNPLANNED = object()


class _GemmPlan:
    """The cuBLAS calls of one layout of (a, b, out): each call's arguments with the three
    pointers left out, and where each pointer lies from its array's start (batch offsets)."""

    def __init__(self, out_shape, out_dtype, calls):
        self.out_shape, self.out_dtype, self.calls = out_shape, out_dtype, calls

    @classmethod
    def make(cls, a, b, out, accumulate, grid):
        """The plan of this layout, from one dry run of _blas_matmul whose calls are recorded
        rather than made (the products' arguments, pointers as offsets), or _UNPLANNED."""
        if a.dtype != b.dtype:
            raise TypeError(f"matmul of {a.dtype} and {b.dtype}: cast one operand first")
        if any(_layout(x.shape, x.strides, x.itemsize)[0] is None for x in (a, b)):
            return _UNPLANNED       # a copy first: rare, and not worth a plan
        xp = get_array_module(a, b)
        recorded = []
        target = out if out is not None else xp.empty(numpy.broadcast_shapes(a.shape[:-2], b.shape[:-2])
                                                     + (a.shape[-2], b.shape[-1]), a.dtype)
        _blas_matmul(xp, a, b, target, accumulate,
                     lambda *args: recorded.append(_run(*args, grid, record=True)))
        if not recorded:
            return _UNPLANNED       # no product to make: an empty result, or k = 0
        bases = (a.data.ptr, b.data.ptr, target.data.ptr)
        calls = [(routine, c_routine, args, [(i, operand, ptr - bases[operand]) for i, operand, ptr in pointers])
                 for routine, c_routine, args, pointers in recorded[0]]
        return cls(target.shape, target.dtype, calls)

    def run(self, a, b, out):
        import cupy
        if out is None:
            out = cupy.empty(self.out_shape, self.out_dtype)
        bases = (a.data.ptr, b.data.ptr, out.data.ptr)
        cublas = cupy.cuda.cublas
        handle = cupy.cuda.device.get_cublas_handle()
        captured = cublas_capture.capturing(cupy)
        for routine, c_routine, args, pointers in self.calls:
            args = list(args)
            for i, operand, offset in pointers:
                args[i] = bases[operand] + offset
            if captured:
                cublas_capture.call(cupy, handle, c_routine, *args)
            else:
                getattr(cublas, routine)(handle, *args)
        return out


def _blas_matmul(xp, a, b, out, accumulate, run):
    """a @ b by a BLAS that reads strided and transposed operands as they lie: the shapes checked,
    `out` made, the rows folded or the batch dimensions merged, then run(operands, (m, k, n),
    batch dimensions, accumulate): cuBLAS's calls (_run) or MKL's (cpu_blas.run)."""
    batch = numpy.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    (m, k), n = a.shape[-2:], b.shape[-1]
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out=")
        out = xp.empty(batch + (m, n), a.dtype)
    elif out.shape != batch + (m, n) or _layout(out.shape, out.strides, out.itemsize)[0] != 0:
        raise ValueError(f"out ({out.shape}, strides {out.strides}) is not a row-major {batch + (m, n)}")
    if out.size == 0:
        return out
    if k == 0:
        if not accumulate:
            out.fill(0)
        return out
    # an operand cuBLAS cannot address (neither its rows nor its columns evenly spaced) is copied
    a, b = (x if _layout(x.shape, x.strides, x.itemsize)[0] is not None else xp.ascontiguousarray(x)
            for x in (a, b))
    folded = _fold_rows(a, b, out, batch)
    if folded:
        operands, batch_dims = folded, []
        m = folded[2].rows
    else:
        operands = [_operand(x, batch) for x in (a, b, out)]
        batch_dims = _merge([(size, [op.batch_strides[i] for op in operands]) for i, size in enumerate(batch)])
    run(operands, (m, k, n), batch_dims, accumulate)
    return out


class _Operand:
    """An array as cuBLAS is given it: its pointer, its element size and dtype, its batch
    dimensions' strides in elements (0 where broadcast) and its matrix's (flag, leading
    dimension)."""

    def __init__(self, x, batch_strides, matrix_shape, matrix_strides):
        self.ptr = x.ctypes.data if isinstance(x, numpy.ndarray) else x.data.ptr
        self.itemsize, self.dtype = x.itemsize, x.dtype
        self.batch_strides, self.rows = batch_strides, matrix_shape[0]
        self.flag, self.ld = _layout(matrix_shape, matrix_strides, x.itemsize)


def _operand(x, batch):
    """x (..., r, c) broadcast against the batch shape `batch`."""
    own = [s // x.itemsize for s in x.strides[:-2]]
    strides = [0] * (len(batch) - len(own)) + [s if size > 1 else 0 for s, size in zip(own, x.shape[:-2])]
    return _Operand(x, strides, x.shape[-2:], x.strides[-2:])


def _fold_rows(a, b, out, batch):
    """With b one matrix for every batch entry (a weight) and the rows of a and of out each one
    evenly spaced run, the three as 2-D operands: one gemmEx instead of a batched GEMM."""
    if not batch or any(size > 1 and s for size, s in zip(b.shape[:-2], b.strides[:-2])):
        return None
    folded = [_fold(x) for x in (a, out)]
    if None in folded:
        return None
    (a_rows, a_stride), (out_rows, out_stride) = folded
    a_op = _Operand(a, [], (a_rows, a.shape[-1]), (a_stride, a.strides[-1]))
    out_op = _Operand(out, [], (out_rows, out.shape[-1]), (out_stride, out.strides[-1]))
    if a_op.flag is None or out_op.flag != 0:
        return None
    return [a_op, _Operand(b, [], b.shape[-2:], b.strides[-2:]), out_op]


def _fold(x):
    """(rows, row stride in bytes) of x (..., r, c) seen as one (rows, c) matrix, or None."""
    merged = _merge([(size, [stride]) for size, stride in zip(x.shape[:-1], x.strides[:-1])])
    if not merged:
        return 1, 0
    return (merged[0][0], merged[0][1][0]) if len(merged) == 1 else None


def _merge(dims):
    """Batch dimensions as (size, [stride of each array]), outer first, with every run of them
    that each array walks with one stride merged and size-1 dimensions dropped."""
    merged = []
    for size, strides in dims:
        if size == 1:
            continue
        if merged and all(outer == inner * size for outer, inner in zip(merged[-1][1], strides)):
            merged[-1] = (merged[-1][0] * size, strides)
        else:
            merged.append((size, strides))
    return merged


def _layout(shape, strides, itemsize):
    """(cuBLAS transpose flag, leading dimension in elements) of a matrix of `shape` and byte
    `strides`, stored row-major: 0 when its rows lie one after another, 1 when its columns do;
    None when neither (cuBLAS cannot read it without a copy)."""
    rows_, cols = shape[-2:]
    s_row, s_col = (s // itemsize for s in strides[-2:])
    if (s_col == 1 or cols == 1) and (rows_ == 1 or s_row >= max(cols, 1)):
        return 0, s_row if rows_ > 1 else max(cols, 1)
    if (s_row == 1 or rows_ == 1) and (cols == 1 or s_col >= max(rows_, 1)):
        return 1, s_col if cols > 1 else max(rows_, 1)
    return None, None


def _run(operands, shape, batch_dims, accumulate, grid, record=False):
    """The cuBLAS calls: one per index of the batch dimensions that could not be merged into the
    innermost one, each a gemmEx (no batch left) or a gemmStridedBatchedEx. cuBLAS is column-major,
    so it computes out^T = b^T a^T: our b is its A and our a its B. With `record`, the calls are
    returned instead of made: (routine, C routine, arguments, [(argument index, operand, pointer)])."""
    import cupy
    cublas, runtime = cupy.cuda.cublas, cupy.cuda.runtime
    a, b, out = operands
    m, k, n = shape
    inner, inner_strides = batch_dims[-1] if batch_dims else (1, [0, 0, 0])
    outer = batch_dims[:-1]
    compute, alpha, beta = _compute(cublas, a.dtype, out.dtype, accumulate, grid)
    types = [_cuda_type(runtime, op.dtype) for op in operands]
    recorded = []
    handle = None if record else cupy.cuda.device.get_cublas_handle()
    # CuPy's bindings refuse cuBLAS while a graph is captured; cublas_capture calls it there
    captured = not record and cublas_capture.capturing(cupy)
    for index in itertools.product(*(range(size) for size, _ in outer)):
        ptr_a, ptr_b, ptr_out = (op.ptr + op.itemsize * sum(i * strides[j] for i, (_, strides) in zip(index, outer))
                                 for j, op in enumerate(operands))
        if inner == 1:
            routine, c_routine, args = "gemmEx", "cublasGemmEx", (b.flag, a.flag, n, m, k, alpha, ptr_b, types[1], b.ld, ptr_a, types[0],
                                       a.ld, beta, ptr_out, types[2], out.ld, compute, cublas.CUBLAS_GEMM_DEFAULT)
        else:
            routine, c_routine, args = "gemmStridedBatchedEx", "cublasGemmStridedBatchedEx", (
                b.flag, a.flag, n, m, k, alpha, ptr_b, types[1], b.ld, inner_strides[1],
                ptr_a, types[0], a.ld, inner_strides[0], beta, ptr_out, types[2], out.ld, inner_strides[2],
                inner, compute, cublas.CUBLAS_GEMM_DEFAULT)
        if record:
            at = (6, 9, 13) if inner == 1 else (6, 10, 15)      # our b, a, out: their A, B, C
            recorded.append((routine, c_routine, args, [(at[0], 1, ptr_b), (at[1], 0, ptr_a), (at[2], 2, ptr_out)]))
        elif captured:
            cublas_capture.call(cupy, handle, c_routine, *args)
        else:
            getattr(cublas, routine)(handle, *args)
    return recorded


#: alpha and beta as cuBLAS reads them (host memory, in the compute type's precision): 0 and 1
_SCALARS = {"float32": numpy.array([0.0, 1.0], numpy.float32), "float64": numpy.array([0.0, 1.0])}


#: cublasComputeType_t values (cublas_api.h), for a CuPy that does not name them
_FAST_16 = {"fp16": ("CUBLAS_COMPUTE_32F_FAST_16F", 74), "bf16": ("CUBLAS_COMPUTE_32F_FAST_16BF", 75)}


def _compute(cublas, dtype, out_dtype, accumulate, grid=None):
    """(compute type, alpha pointer, beta pointer) for inputs of `dtype` written to `out_dtype`."""
    name, out_name = numpy.dtype(dtype).name, numpy.dtype(out_dtype).name
    if name == out_name == "float64":
        compute, scalars = cublas.CUBLAS_COMPUTE_64F, _SCALARS["float64"]
    elif name == out_name == "float32" and grid is not None:
        compute, scalars = getattr(cublas, *_FAST_16[grid]), _SCALARS["float32"]
    elif name == out_name == "float32":
        compute = cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if _settings["tf32"] else cublas.CUBLAS_COMPUTE_32F
        scalars = _SCALARS["float32"]
    elif name in ("float16", "bfloat16") and out_name in (name, "float32"):
        compute, scalars = cublas.CUBLAS_COMPUTE_32F, _SCALARS["float32"]
    else:
        raise TypeError(f"no cuBLAS product of {name} inputs into {out_name}")
    zero, one = scalars.ctypes.data, scalars.ctypes.data + scalars.itemsize
    return compute, one, one if accumulate else zero


def _cuda_type(runtime, dtype):
    return {"float16": runtime.CUDA_R_16F, "bfloat16": runtime.CUDA_R_16BF, "float32": runtime.CUDA_R_32F,
            "float64": runtime.CUDA_R_64F}[numpy.dtype(dtype).name]
