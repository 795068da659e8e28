"""CUDA kernels for the Llama family's layer on a GPU's 16-bit activations (--fp16/--bf16):
RMSNorm (one launch forward; backward one for the gain's gradient and one for the input's, which
can add the residual path's gradient), SwiGLU (one launch each way) and the rotary embedding (one
launch each way).

Each reads 16-bit arrays (or float32 ones on the 16-bit grid), computes in float32 operation by
operation as its op's chain does (ops/rms_norm.py, ops/swiglu.py, ops/rotary.py) and rounds as
it stores, so its numbers are the CPU emulation's: the twins the strict CuPy stand-in runs call
those very chains on the widened inputs and round the results. A row's or a column's sum is
accumulated in double here, where the chains' NumPy sums are pairwise in float32: the two agree
to float32's rounding of the sum (the GPU tests allow that), as CuPy's own reductions do.
Conventions as sixteen_bit_kernels.py's (the _rn intrinsics, the twin line, `render`, `launch`).
"""
import numpy

from . import precision
from .row_kernels import BLOCK_SUM, threads_for
from .sixteen_bit_kernels import launch, operand, render, short_name

_RSTD = r"""
// the chains' 1 / sqrt(squares / n + eps), operation by operation
__device__ __forceinline__ float rstd_of(float squares, float n, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(squares, n), eps)));
}
"""

_RMS_FORWARD = BLOCK_SUM + _RSTD + r"""
// twin: npmegatron.autograd.ops.rms_norm:rms_norm_forward_twin
// one block a row: the row's sum of squares (kept for backward), then x * rstd * weight stored
extern "C" __global__ void rms_norm_forward_{name}(const XT* x, const ST* weight, ST* out, float* squares,
                                                   int cols, float n, float eps) {
    __shared__ double shared[32];
    size_t start = (size_t)blockIdx.x * cols;
    double sum = 0.0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = WIDE_X(x[start + c]);
        sum += (double)__fmul_rn(v, v);
    }
    float total = (float)block_sum(sum, shared);
    float rstd = rstd_of(total, n, eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        out[start + c] = {to_16}(__fmul_rn(__fmul_rn(WIDE_X(x[start + c]), rstd), {from_16}(weight[c])));
    if (threadIdx.x == 0) squares[blockIdx.x] = total;
}
"""

_RMS_WEIGHT_GRAD = _RSTD + r"""
// twin: npmegatron.autograd.ops.rms_norm:rms_norm_weight_grad_twin
// the gain's gradient, sum over rows of g xhat (xhat recomputed), written (or, with accumulate,
// added) into gw: a block of 32 x 32 threads takes 32 columns, each thread every 32nd row
extern "C" __global__ void rms_norm_weight_grad_{name}(const GT* g, const XT* x, const float* squares, float* gw,
                                                       long long rows, int cols, float n, float eps, int accumulate) {
    __shared__ double part[32][33];
    int c = blockIdx.x * 32 + threadIdx.x;
    double sum = 0.0;
    if (c < cols) {
        for (long long r = threadIdx.y; r < rows; r += 32) {
            float xhat = __fmul_rn(WIDE_X(x[r * cols + c]), rstd_of(squares[r], n, eps));
            sum += (double)__fmul_rn(WIDE_G(g[r * cols + c]), xhat);
        }
    }
    part[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        double total = 0.0;
        for (int i = 0; i < 32; ++i) total += part[i][threadIdx.x];
        gw[c] = accumulate ? __fadd_rn(gw[c], (float)total) : (float)total;
    }
}
"""

_RMS_BACKWARD = BLOCK_SUM + _RSTD + r"""
// twin: npmegatron.autograd.ops.rms_norm:rms_norm_backward_twin
// gx = (g weight - xhat mean(g weight xhat)) rstd, rounded; with add_pending, the residual path's
// 16-bit gradient is then added and the sum rounded: the tape's rounding and the fork's sum
extern "C" __global__ void rms_norm_backward_{name}(const GT* g, const ST* weight, const XT* x, const float* squares,
                                                    const ST* pending, ST* gx, int cols, float n, float eps,
                                                    int add_pending) {
    __shared__ double shared[32];
    size_t start = (size_t)blockIdx.x * cols;
    float rstd = rstd_of(squares[blockIdx.x], n, eps);
    double sum = 0.0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float xhat = __fmul_rn(WIDE_X(x[start + c]), rstd);
        sum += (double)__fmul_rn(__fmul_rn(WIDE_G(g[start + c]), {from_16}(weight[c])), xhat);
    }
    float mean = __fdiv_rn((float)block_sum(sum, shared), n);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float xhat = __fmul_rn(WIDE_X(x[start + c]), rstd);
        float gh = __fmul_rn(WIDE_G(g[start + c]), {from_16}(weight[c]));
        ST d = {to_16}(__fmul_rn(__fsub_rn(gh, __fmul_rn(xhat, mean)), rstd));
        gx[start + c] = add_pending ? {to_16}(__fadd_rn({from_16}(pending[start + c]), {from_16}(d))) : d;
    }
}
"""

_SWIGLU_TYPES = r"""
#include <{header}>
{prelude}typedef {store} ST;
typedef {y_type} YT;
typedef {g_type} GT;
"""

_SWIGLU_FORWARD = _SWIGLU_TYPES + r"""
// twin: npmegatron.autograd.ops.swiglu:swiglu_forward_twin
// out (rows, half) = silu(gate) * up of y (rows, 2 half) = [gate | up], as swiglu_forward's chain
extern "C" __global__ void swiglu_forward_{name}(const YT* y, ST* out, long long n, long long half) {
    EACH_INDEX {
        long long at = (i / half) * 2 * half + i % half;
        float gate = {wide_y}(y[at]), up = {wide_y}(y[at + half]);
        out[i] = {to_16}(__fmul_rn(__fdiv_rn(gate, __fadd_rn(expf(-gate), 1.0f)), up));
    }
}
"""

_SWIGLU_BACKWARD = _SWIGLU_TYPES + r"""
// twin: npmegatron.autograd.ops.swiglu:swiglu_backward_twin
// grad = [d_gate | d_up] of g (rows, half), as swiglu_backward_'s chain
extern "C" __global__ void swiglu_backward_{name}(const GT* g, const YT* y, ST* grad, long long n, long long half) {
    EACH_INDEX {
        long long at = (i / half) * 2 * half + i % half;
        float gate = {wide_y}(y[at]), up = {wide_y}(y[at + half]), gi = {wide_g}(g[i]);
        float s = __fdiv_rn(1.0f, __fadd_rn(expf(-gate), 1.0f));
        float silu = __fmul_rn(gate, s);
        float d_gate = __fadd_rn(__fsub_rn(silu, __fmul_rn(silu, s)), s);
        grad[at] = {to_16}(__fmul_rn(__fmul_rn(d_gate, up), gi));
        grad[at + half] = {to_16}(__fmul_rn(gi, silu));
    }
}
"""

_ROTARY = r"""
#include <{header}>
{prelude}typedef {store} ST;
typedef {x_type} XT;

// twin: npmegatron.autograd.ops.rotary:rotary_twin
// out (b, t, heads, d), C-ordered, of x read through element strides from `x` (a view's first
// element): each head's first 2 half channels turned pairwise by the angles of its position, as
// rotate_pairs_'s chain; the rest copied
extern "C" __global__ void rotary_{name}(const XT* x, const float* cos, const float* sin, ST* out, long long n,
                                         int t, int heads, int d, int half, long long sb, long long st,
                                         long long sh, long long sd) {
    EACH_INDEX {
        long long rest = i / d;
        int c = i % d, h = rest % heads, p = (rest / heads) % t;
        long long base = (rest / heads / t) * sb + p * st + h * sh;
        float v;
        if (c < 2 * half) {
            int k = c < half ? c : c - half;
            float first = {wide_x}(x[base + k * sd]), second = {wide_x}(x[base + (k + half) * sd]);
            float co = cos[p * half + k], si = sin[p * half + k];
            v = c < half ? __fsub_rn(__fmul_rn(first, co), __fmul_rn(second, si))
                         : __fadd_rn(__fmul_rn(second, co), __fmul_rn(first, si));
        } else {
            v = {wide_x}(x[base + c * sd]);
        }
        out[i] = {to_16}(v);
    }
}
"""


def _row_types(fmt, x_dtype, g_dtype=None):
    """The typedefs and widenings of the RMSNorm kernels' x (and g) operands."""
    (x_type, wide_x) = operand(x_dtype, fmt)
    (g_type, wide_g) = operand(numpy.float32 if g_dtype is None else g_dtype, fmt)
    return (f"typedef {x_type} XT;\n#define WIDE_X(v) {wide_x}(v)\n"
            f"typedef {g_type} GT;\n#define WIDE_G(v) {wide_g}(v)\n")


def rms_code(kind, fmt, x_dtype, g_dtype=None):
    """(CUDA source, kernel name) of RMSNorm's `kind` kernel ("forward", "weight_grad",
    "backward") for 16-bit format fmt, x (and g) of these dtypes (float32 or fmt's)."""
    template = {"forward": _RMS_FORWARD, "weight_grad": _RMS_WEIGHT_GRAD, "backward": _RMS_BACKWARD}[kind]
    name = f"{fmt}_x_{short_name(x_dtype)}" + ("" if kind == "forward" else f"_g_{short_name(g_dtype)}")
    header = "#include <{header}>\ntypedef {store} ST;\n"
    source = render(header + _row_types(fmt, x_dtype, g_dtype) + template, fmt, name=name)
    return source, f"rms_norm_{kind}_{name}"


def swiglu_code(direction, fmt, y_dtype, g_dtype=numpy.float32):
    """(CUDA source, kernel name) of SwiGLU's "forward" or "backward" kernel for y (and g) of
    these dtypes (float32 or fmt's)."""
    (y_type, wide_y), (g_type, wide_g) = operand(y_dtype, fmt), operand(g_dtype, fmt)
    name = f"{fmt}_y_{short_name(y_dtype)}" + ("" if direction == "forward" else f"_g_{short_name(g_dtype)}")
    template = _SWIGLU_FORWARD if direction == "forward" else _SWIGLU_BACKWARD
    source = render(template, fmt, y_type=y_type, wide_y=wide_y, g_type=g_type, wide_g=wide_g, name=name)
    return source, f"swiglu_{direction}_{name}"


def rotary_code(fmt, x_dtype):
    """(CUDA source, kernel name) of the rotary kernel reading x of this dtype (float32 or fmt's)."""
    x_type, wide_x = operand(x_dtype, fmt)
    name = f"{fmt}_x_{short_name(x_dtype)}"
    return render(_ROTARY, fmt, x_type=x_type, wide_x=wide_x, name=name), f"rotary_{name}"


def _device_16_bit(a, fmt):
    """Whether `a` is a C-ordered device array of fmt's 16-bit format or float32."""
    return (type(a).__module__.startswith("cupy") and a.size > 0 and a.flags.c_contiguous
            and (a.dtype == numpy.float32 or precision.format_of(a.dtype) == fmt))


# --- RMSNorm ----------------------------------------------------------------------------------

def takes_rms_norm(x, weight, fmt):
    """Whether the RMSNorm kernels take x (rows, cols) with this weight: fmt's 16-bit arrays
    (x may also be float32 on the grid), C-ordered, on the device."""
    return (x.ndim == 2 and _device_16_bit(x, fmt) and precision.format_of(weight.dtype) == fmt
            and weight.flags.c_contiguous and weight.shape == x.shape[-1:])


def rms_norm_forward(x, weight, eps, fmt):
    """(out, squares): RMSNorm of the rows of x as fmt's 16-bit array, and each row's sum of
    squares (float32, what backward recomputes xhat from), in one launch."""
    import cupy
    rows, cols = x.shape
    out, squares = cupy.empty(x.shape, precision.sixteen_bit_dtype(fmt)), cupy.empty(rows, numpy.float32)
    launch(("rms forward", fmt, x.dtype), lambda: rms_code("forward", fmt, x.dtype),
           (x, weight, out, squares, numpy.int32(cols), numpy.float32(cols), numpy.float32(eps)), x.size,
           grid=(rows,), block=(threads_for(cols),))
    return out, squares


def rms_norm_weight_grad(g, x, squares, eps, fmt, destination=None):
    """The gain's gradient (float32), into `destination` ((array, accumulate): Context.destination)
    or a new array, in one launch."""
    import cupy
    rows, cols = x.shape
    out, accumulate = destination if destination is not None else (cupy.empty(cols, numpy.float32), False)
    launch(("rms weight grad", fmt, x.dtype, g.dtype), lambda: rms_code("weight_grad", fmt, x.dtype, g.dtype),
           (g, x, squares, out, numpy.int64(rows), numpy.int32(cols), numpy.float32(cols), numpy.float32(eps),
            numpy.int32(accumulate)), x.size, grid=(-(-cols // 32),), block=(32, 32))
    return out


def rms_norm_backward(g, weight, x, squares, eps, fmt, pending=None):
    """x's gradient as fmt's 16-bit array (plus `pending`, fmt's 16-bit, when given: the sum rounded
    again), in one launch."""
    import cupy
    rows, cols = x.shape
    gx = cupy.empty(x.shape, precision.sixteen_bit_dtype(fmt))
    launch(("rms backward", fmt, x.dtype, g.dtype), lambda: rms_code("backward", fmt, x.dtype, g.dtype),
           (g, weight, x, squares, gx if pending is None else pending, gx, numpy.int32(cols), numpy.float32(cols),
            numpy.float32(eps), numpy.int32(pending is not None)), x.size, grid=(rows,),
           block=(threads_for(cols),))
    return gx


# --- SwiGLU -----------------------------------------------------------------------------------

def takes_swiglu(y, fmt, g=None):
    """Whether the SwiGLU kernels take y (..., 2 half), and the gradient g (..., half) when given:
    C-ordered device arrays, 16-bit or float32."""
    if not _device_16_bit(y, fmt) or y.shape[-1] % 2:
        return False
    return g is None or (_device_16_bit(g, fmt) and g.shape == y.shape[:-1] + (y.shape[-1] // 2,))


def swiglu_forward(y, fmt):
    """silu(gate) * up of y = [gate | up] as fmt's 16-bit array, in one launch."""
    import cupy
    half = y.shape[-1] // 2
    out = cupy.empty(y.shape[:-1] + (half,), precision.sixteen_bit_dtype(fmt))
    launch(("swiglu forward", fmt, y.dtype), lambda: swiglu_code("forward", fmt, y.dtype),
           (y, out, numpy.int64(out.size), numpy.int64(half)), out.size)
    return out


def swiglu_backward(g, y, fmt):
    """y's gradient [d_gate | d_up] as fmt's 16-bit array, from g (16-bit or float32), in one launch."""
    import cupy
    half = y.shape[-1] // 2
    grad = cupy.empty(y.shape, precision.sixteen_bit_dtype(fmt))
    launch(("swiglu backward", fmt, y.dtype, g.dtype), lambda: swiglu_code("backward", fmt, y.dtype, g.dtype),
           (g, y, grad, numpy.int64(g.size), numpy.int64(half)), g.size)
    return grad


# --- the rotary embedding ---------------------------------------------------------------------

def _strided(x):
    """(a C-ordered 1-D array from x's first to its last element, x's strides in elements): x a
    view (a head split of the QKV projection's output, a transposed gradient) of a C-ordered
    array; None where x's base is not C-ordered."""
    owner = x if x.base is None else x.base
    if not owner.flags.c_contiguous or any(s < 0 for s in x.strides):
        return None
    start = (x.data.ptr - owner.data.ptr) // x.itemsize
    strides = tuple(s // x.itemsize for s in x.strides)
    stop = start + sum((n - 1) * s for n, s in zip(x.shape, strides)) + 1
    return owner.reshape(-1)[start:stop], strides


def takes_rotary(x, cos, sin, fmt):
    """Whether the rotary kernel takes x (b, t, heads, d), 16-bit or float32, any strides into a
    C-ordered device array, and float32 C-ordered angle tables (t, half)."""
    if not type(x).__module__.startswith("cupy") or x.size == 0 or x.ndim != 4:
        return False
    if not (x.dtype == numpy.float32 or precision.format_of(x.dtype) == fmt):
        return False
    return all(a.dtype == numpy.float32 and a.flags.c_contiguous for a in (cos, sin)) and _strided(x) is not None


def rotary(x, cos, sin, fmt):
    """x with its pairs turned by the angles (cos, sin), as a C-ordered fmt 16-bit array, one launch."""
    import cupy
    flat, (sb, st, sh, sd) = _strided(x)
    b, t, heads, d = x.shape
    out = cupy.empty(x.shape, precision.sixteen_bit_dtype(fmt))
    launch(("rotary", fmt, x.dtype), lambda: rotary_code(fmt, x.dtype),
           (flat, cos, sin, out, numpy.int64(out.size), numpy.int32(t), numpy.int32(heads), numpy.int32(d),
            numpy.int32(cos.shape[1]), numpy.int64(sb), numpy.int64(st), numpy.int64(sh), numpy.int64(sd)), out.size)
    return out


def all_sources():
    """(kernel name, CUDA source) of every variant, for the NVRTC compile in CI
    (tests/test_cuda_sources_compile.py)."""
    sources = []
    for fmt in ("bf16", "fp16"):
        dtypes = (numpy.dtype(numpy.float32), precision.sixteen_bit_dtype(fmt))
        sources += [rms_code("forward", fmt, x)[::-1] for x in dtypes]
        sources += [rms_code(kind, fmt, x, g)[::-1] for kind in ("weight_grad", "backward") for x in dtypes
                    for g in dtypes]
        sources += [swiglu_code("forward", fmt, y)[::-1] for y in dtypes]
        sources += [swiglu_code("backward", fmt, y, g)[::-1] for y in dtypes for g in dtypes]
        sources += [rotary_code(fmt, x)[::-1] for x in dtypes]
    return sources
