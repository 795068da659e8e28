"""LayerNorm's row kernels on the GPU, written in CUDA C, each with the NumPy twin it must equal.

`cupy.fuse` ends a kernel at its one reduction, so a LayerNorm built from fused chains takes three
launches forward (the mean, the centred squares' sum, the normalisation) and three backward.
A row of GPT-2 (768 to a few thousand values) fits one thread block, so one block a row can
reduce twice and write the row in a single launch, as Apex's and Megatron's fused LayerNorm do:
forward is one launch, and backward one for the input's gradient (plus the fused column sums of
the weight's and bias's gradients, nn.py). Sums accumulate in double, as the CPU's numba
kernels do; the values written are the array's dtype.

Each kernel's source names its twin (`// twin: module:function`): the NumPy function that
computes the same numbers from the same arguments, in place on the output arrays. The strict
CuPy stand-in (tests/fakes/strict_cupy) runs the twin where CuPy would run the kernel, so the CPU
tests count and check every launch of this path; the GPU test files hold the kernels to their
twins on a real card.

Under --fp16/--bf16 each kernel also comes in a "kept input" variant (`keep=` the format): forward
keeps LayerNorm's input itself as a 16-bit array (exact: the input lies on the grid) and each
row's mean and 1/std in double, in place of the float32 xhat; backward recomputes xhat from them
with forward's own expression, so the numbers are the same bit for bit in fewer bytes. That
variant writes its output in 16 bits too, rounded as it stores (the rounding the CPU's emulation
makes after the op), and takes as its input either a float32 array on the grid or the 16-bit
residual stream itself (sixteen_bit_kernels.py), which it then keeps without writing a copy.
"""
import numpy

from . import precision
from .sixteen_bit_kernels import CUDA_16_BIT
from .backend import get_array_module

BLOCK_SUM = r"""
// The sum of v over the block, returned to every thread (blockDim.x a multiple of 32, <= 1024).
__device__ double block_sum(double v, double* shared) {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffff, v, offset);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();                      // shared may still be read by a previous call
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    double total = 0.0;
    for (int w = 0; w < warps; ++w) total += shared[w];
    return total;
}
"""

_FORWARD = BLOCK_SUM + r"""
// twin: {module}:layer_norm_forward_rows{twin}
// kept: xhat, or (KEEP_INPUT) x in 16 bits; stats: rstd, or (KEEP_INPUT) mean and 1/std in double.
extern "C" __global__ void layer_norm_forward_rows_{name}(
        const XTYPE* x, const WTYPE* weight, const WTYPE* bias, KEPT* kept, OTYPE* out, STAT* stats,
        int cols, double eps) {
    __shared__ double shared[32];
    size_t start = (size_t)blockIdx.x * cols;
    double sum = 0.0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) sum += (double)X(x[start + c]);
    double mean = block_sum(sum, shared) / cols;
    double squares = 0.0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        double d = (double)X(x[start + c]) - mean;
        squares += d * d;
    }
    double inv = 1.0 / sqrt(block_sum(squares, shared) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        {T} h = ({T})(((double)X(x[start + c]) - mean) * inv);
#if !INPUT_16_BIT
        kept[start + c] = TO_KEPT(KEEP_INPUT ? x[start + c] : h);
#endif
        out[start + c] = TO_OUT(h * WEIGHT(weight[c]) + WEIGHT(bias[c]));
    }
    if (threadIdx.x == 0) {
#if KEEP_INPUT
        stats[2 * blockIdx.x] = mean;
        stats[2 * blockIdx.x + 1] = inv;
#else
        stats[blockIdx.x] = ({T})inv;
#endif
    }
}
"""

_BACKWARD = BLOCK_SUM + r"""
// twin: {module}:layer_norm_backward_rows{twin}
// gx = rstd (gh - mean(gh) - xhat mean(gh xhat)), gh = g weight; plus `pending` (the gradient
// the input already has from its other consumer, the residual path) when add_pending is 1. With
// 16-bit gradients the sum is of d rounded (the tape rounds LayerNorm's gradient first), rounded
// again as it is stored (the emulation rounds the fork's float32 sum before its next use).
extern "C" __global__ void layer_norm_backward_rows_{name}(
        const GTYPE* g, const WTYPE* weight, const KEPT* kept, const STAT* stats, const GTYPE* pending,
        GTYPE* gx, int cols, int add_pending) {
    __shared__ double shared[32];
    size_t start = (size_t)blockIdx.x * cols;
    double sum_gh = 0.0, sum_ghx = 0.0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        double gh = (double)G(g[start + c]) * (double)WEIGHT(weight[c]);
        sum_gh += gh;
        sum_ghx += gh * (double)XHAT(blockIdx.x, start + c);
    }
    double mean_gh = block_sum(sum_gh, shared) / cols;
    double mean_ghx = block_sum(sum_ghx, shared) / cols;
    double inv = (double)RSTD(blockIdx.x);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        double gh = (double)G(g[start + c]) * (double)WEIGHT(weight[c]);
        {T} d = ({T})((gh - mean_gh - (double)XHAT(blockIdx.x, start + c) * mean_ghx) * inv);
        gx[start + c] = TO_G(add_pending ? G(pending[start + c]) + G(TO_G(d)) : d);
    }
}
"""

_COLUMNS = r"""
// twin: {module}:layer_norm_column_sums_rows{twin}
// gw = sum over rows of g xhat and gb = sum over rows of g, written (or, with accumulate_*, added)
// straight into their destinations. A block of 32 x 32 threads takes 32 columns: each thread sums
// every 32nd row of its column, then the first row of threads adds the 32 partial sums in order.
extern "C" __global__ void layer_norm_column_sums_{name}(
        const GTYPE* g, const KEPT* kept, const STAT* stats, {T}* gw, {T}* gb, int rows, int cols,
        int accumulate_w, int accumulate_b) {
    __shared__ double part_w[32][33], part_b[32][33];
    int c = blockIdx.x * 32 + threadIdx.x;
    double sw = 0.0, sb = 0.0;
    if (c < cols) {
        for (int r = threadIdx.y; r < rows; r += 32) {
            double gv = (double)G(g[(size_t)r * cols + c]);
            sw += gv * (double)XHAT(r, (size_t)r * cols + c);
            sb += gv;
        }
    }
    part_w[threadIdx.y][threadIdx.x] = sw;
    part_b[threadIdx.y][threadIdx.x] = sb;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        double tw = 0.0, tb = 0.0;
        for (int i = 0; i < 32; ++i) { tw += part_w[i][threadIdx.x]; tb += part_b[i][threadIdx.x]; }
        gw[c] = accumulate_w ? gw[c] + ({T})tw : ({T})tw;
        gb[c] = accumulate_b ? gb[c] + ({T})tb : ({T})tb;
    }
}
"""

_TYPES = {numpy.dtype(numpy.float32): "float", numpy.dtype(numpy.float64): "double"}

#: What the kept array and the statistics are: xhat and rstd in the array's dtype, or (KEEP_INPUT)
#: the input in 16 bits and each row's mean and 1/std in double. XHAT(row, i) is xhat's element i
#: either way: under KEEP_INPUT recomputed with forward's expression, so bit for bit the same.
_KEPT_XHAT = r"""
#define KEEP_INPUT 0
typedef {T} KEPT;
typedef {T} STAT;
typedef {T} OTYPE;
#define TO_KEPT(v) (v)
#define TO_OUT(v) (v)
#define XHAT(row, i) kept[i]
#define RSTD(row) stats[row]
"""
_KEPT_INPUT = r"""
#include <{header}>
#define KEEP_INPUT 1
typedef {kept} KEPT;
typedef double STAT;
typedef {kept} OTYPE;
#define TO_KEPT(v) {to_kept}(v)
#define TO_OUT(v) {to_kept}(v)
#define XHAT(row, i) (({T})(((double){from_kept}(kept[i]) - stats[2 * (row)]) * stats[2 * (row) + 1]))
#define RSTD(row) (({T})stats[2 * (row) + 1])
"""
_SIXTEEN_BIT = CUDA_16_BIT
#: The input's type: the array's, or (the 16-bit residual stream, sixteen_bit_kernels.py) the kept
#: format's, which is then the kept array itself (forward writes no copy).
_INPUT_AS_ARRAY = r"""
#define INPUT_16_BIT 0
typedef {T} XTYPE;
#define X(v) (v)
"""
_INPUT_16_BIT = r"""
#define INPUT_16_BIT 1
typedef KEPT XTYPE;
#define X(v) {from_kept}(v)
"""
#: The gradients' type (backward's g and gx): the array's, or (a GPU's 16-bit gradients, from a
#: GEMM that rounds as it stores) the kept format's, gx then rounded as it is stored.
_GRADS_AS_ARRAY = r"""
typedef {T} GTYPE;
#define G(v) (v)
#define TO_G(v) (v)
"""
_GRADS_16_BIT = r"""
typedef KEPT GTYPE;
#define G(v) {from_kept}(v)
#define TO_G(v) {to_kept}(v)
"""
#: The weight's and bias's type: the array's, or (a GPU's --fp16/--bf16 parameters) 16-bit.
_WEIGHT_AS_ARRAY = r"""
typedef {T} WTYPE;
#define WEIGHT(v) (v)
"""
_WEIGHT_16_BIT = r"""
#include <{header}>
typedef {kept} WTYPE;
#define WEIGHT(v) {from_kept}(v)
"""


#: Every row kernel by name (a test's fresh CuPy stand-in forgets what an earlier one compiled).
KERNELS = {}


class RowKernel:
    """A CUDA kernel run with one thread block per row of a C-ordered (rows, cols) array."""

    def __init__(self, name, source):
        self.name, self.source = name, source
        self._compiled = {}     # variant -> cupy.RawKernel, compiled on first use
        KERNELS[name] = self

    def __call__(self, rows, cols, variant, *args):
        self.launch(variant, (rows,), (threads_for(cols),), args)

    def launch(self, variant, grid, block, args):
        """variant: `code`'s arguments (the arrays' dtype, the kept format or None, the weight's
        16-bit format or None, and the 16-bit input's and gradients' flags)."""
        import cupy
        kernel = self._compiled.get(variant)
        if kernel is None:
            kernel = self._compiled[variant] = cupy.RawKernel(*self.code(*variant))
        kernel(grid, block, args)

    def code(self, dtype, keep=None, weight=None, input_16_bit=False, grads_16_bit=False):
        """(CUDA source, kernel name) for arrays of `dtype`, keeping xhat (keep None) or the input
        in the 16-bit format `keep`, with weights of the arrays' dtype or of 16-bit format `weight`;
        with input_16_bit, forward's input is that 16-bit array itself (keep's format); with
        grads_16_bit, backward's g and gx are keep's 16-bit arrays."""
        type_name = _TYPES[numpy.dtype(dtype)]
        prelude = _KEPT_XHAT if keep is None else _KEPT_INPUT.format(T="{T}", **_SIXTEEN_BIT[keep])
        prelude += _INPUT_16_BIT.format(**_SIXTEEN_BIT[keep]) if input_16_bit else _INPUT_AS_ARRAY
        prelude += _GRADS_16_BIT.format(**_SIXTEEN_BIT[keep]) if grads_16_bit else _GRADS_AS_ARRAY
        prelude += _WEIGHT_AS_ARRAY if weight is None else _WEIGHT_16_BIT.format(**_SIXTEEN_BIT[weight])
        name = (type_name + ("" if keep is None else f"_kept_{keep}") + ("_input_16_bit" if input_16_bit else "")
                + ("_grads_16_bit" if grads_16_bit else "") + ("" if weight is None else f"_weight_{weight}"))
        twin = ("" if keep is None else "_16_bit_input" if input_16_bit else "_16_bit_grads" if grads_16_bit
                else "_kept_input")
        source = (prelude + self.source).replace("{T}", type_name).replace("{module}", __name__)
        return source.replace("{twin}", twin).replace("{name}", name), f"{self.name}_{name}"


def all_sources():
    """(kernel name, CUDA source) of every variant `RowKernel.code` makes: each kernel for each
    dtype, kept format and weight format (a superset: the column sums are launched with weight None
    only). CI compiles them all with NVRTC on a GPU-less machine (tests/test_cuda_sources_compile.py),
    so a compile error never reaches a GPU."""
    formats = (None, *_SIXTEEN_BIT)
    return [kernel.code(dtype, keep, weight, *sixteen)[::-1] for kernel in KERNELS.values()
            for dtype in _TYPES for keep in formats for weight in formats
            for sixteen in ((False, False), ((True, False) if kernel is _forward_kernel else (False, True)))
            if keep or sixteen == (False, False)]


def threads_for(cols):
    """Threads a block: about four values each, whole warps, at most 1024."""
    return min(1024, max(32, -(-cols // 128) * 32))


def gpu_supports(x):
    """True for the arrays the row kernels take: CuPy, float32/float64, C-ordered rows."""
    return (get_array_module(x) is not numpy and (x.dtype in _TYPES or precision.format_of(x.dtype)) and x.ndim == 2
            and x.flags.c_contiguous and x.shape[0] > 0 and x.shape[1] > 0)


_forward_kernel = RowKernel("layer_norm_forward_rows", _FORWARD)
_backward_kernel = RowKernel("layer_norm_backward_rows", _BACKWARD)
_columns_kernel = RowKernel("layer_norm_column_sums", _COLUMNS)


def layer_norm_forward(x, weight, bias, eps, keep=None):
    """LayerNorm over the rows of a C-ordered 2-D CuPy array, one launch: (out, kept, stats), kept
    and stats being xhat and rstd, or with keep="bf16"/"fp16" (x on that grid, or x a 16-bit
    array) x as a 16-bit array and each row's (mean, 1/std) in float64, and out 16-bit (module
    docstring)."""
    xp = get_array_module(x)
    rows, cols = x.shape
    if precision.format_of(x.dtype):      # the 16-bit residual stream: x is kept as it is
        out = xp.empty(x.shape, x.dtype)
        stats = xp.empty((rows, 2), numpy.float64)
        _forward_kernel(rows, cols, (numpy.float32, precision.format_of(x.dtype), precision.format_of(weight.dtype), True),
                        x, _contiguous(weight), _contiguous(bias), x, out, stats, numpy.int32(cols), numpy.float64(eps))
        return out, x, stats
    if keep is None:
        out, kept, stats = xp.empty_like(x), xp.empty_like(x), xp.empty((rows, 1), x.dtype)
    else:
        out, kept = (xp.empty(x.shape, precision.sixteen_bit_dtype(keep)) for _ in range(2))
        stats = xp.empty((rows, 2), numpy.float64)
    _forward_kernel(rows, cols, (x.dtype, keep, precision.format_of(weight.dtype)), x, _contiguous(weight),
                    _contiguous(bias), kept, out, stats, numpy.int32(cols), numpy.float64(eps))
    return out, kept, stats


def layer_norm_backward(g, weight, kept, stats, pending=None):
    """The input's gradient (plus `pending`, when given, added in the same kernel): one launch."""
    xp = get_array_module(g)
    rows, cols = g.shape
    gx = xp.empty_like(g)
    _backward_kernel(rows, cols, _grad_variant(g, kept, weight), _contiguous(g),
                     _contiguous(weight), kept, stats,
                     g if pending is None else _contiguous(pending), gx, numpy.int32(cols),
                     numpy.int32(pending is not None))
    return gx


def layer_norm_column_sums(g, kept, stats, gw=None, gb=None):
    """(gw, gb): the weight's and the bias's gradients, sum(g xhat) and sum(g) over rows, in one
    launch. gw and gb: None for new arrays, or (array, accumulate) to write into (Context.destination)."""
    xp = get_array_module(g)
    rows, cols = g.shape
    variant = _grad_variant(g, kept, None)
    outs = [(xp.empty(cols, variant[0]), False) if d is None else d for d in (gw, gb)]
    (w, add_w), (b, add_b) = outs
    _columns_kernel.launch(variant, (-(-cols // 32),), (32, 32),
                           (_contiguous(g), kept, stats, _contiguous(w), _contiguous(b), numpy.int32(rows),
                            numpy.int32(cols), numpy.int32(add_w), numpy.int32(add_b)))
    return w, b


def _grad_variant(g, kept, weight):
    """The backward kernels' variant for gradient g: its own dtype, or (a 16-bit g, which comes with
    a kept 16-bit input) float32 arithmetic on 16-bit g and gx."""
    keep, sixteen = precision.format_of(kept.dtype), precision.format_of(g.dtype) is not None
    return (numpy.dtype(numpy.float32) if sixteen else g.dtype, keep, precision.format_of(weight.dtype)
            if weight is not None else None, False, sixteen)


def _contiguous(a):
    """The kernels index raw memory: a strided array is refused rather than copied unseen."""
    if not a.flags.c_contiguous:
        raise ValueError(f"the LayerNorm row kernels need C-ordered arrays, got strides {a.strides}")
    return a


# --- the twins: the kernels' arithmetic in NumPy, in place on the output arrays ---------------

def layer_norm_forward_rows(x, weight, bias, xhat, out, rstd, cols, eps):
    """layer_norm_forward_rows_{T}: sums in float64, values in x's dtype."""
    wide = x.astype(numpy.float64)
    mean = wide.sum(axis=-1, keepdims=True) / int(cols)
    d = wide - mean
    inv = 1.0 / numpy.sqrt((d * d).sum(axis=-1, keepdims=True) / int(cols) + float(eps))
    xhat[...] = d * inv
    out[...] = xhat * weight + bias
    rstd[...] = inv


def layer_norm_backward_rows(g, weight, xhat, rstd, pending, gx, cols, add_pending):
    """layer_norm_backward_rows_{T}: sums in float64, the result in g's dtype, then + pending."""
    gh = g.astype(numpy.float64) * weight.astype(numpy.float64)
    mean_gh = gh.sum(axis=-1, keepdims=True) / int(cols)
    mean_ghx = (gh * xhat).sum(axis=-1, keepdims=True) / int(cols)
    d = ((gh - mean_gh - xhat.astype(numpy.float64) * mean_ghx) * rstd.astype(numpy.float64)).astype(g.dtype)
    if add_pending:
        gx[...] = pending + d
    else:
        gx[...] = d


def layer_norm_column_sums_rows(g, xhat, stats, gw, gb, rows, cols, accumulate_w, accumulate_b):
    """layer_norm_column_sums_{T}: sums in float64, each cast to g's dtype, then added if asked."""
    wide = g.astype(numpy.float64)
    sums = ((wide * xhat).sum(axis=0).astype(g.dtype), wide.sum(axis=0).astype(g.dtype))
    for out, total, accumulate in zip((gw, gb), sums, (accumulate_w, accumulate_b)):
        if accumulate:
            out += total
        else:
            out[...] = total


def xhat_from_input(kept, stats, dtype):
    """XHAT of the kept-input variant: forward's xhat, recomputed from x and the row's statistics
    (NumPy or CuPy arrays)."""
    return ((kept.astype(numpy.float64) - stats[:, :1]) * stats[:, 1:]).astype(dtype)


def layer_norm_forward_rows_kept_input(x, weight, bias, kept, out, stats, cols, eps):
    """layer_norm_forward_rows_{T}_kept_{fmt}: the same output; x kept in 16 bits, (mean, 1/std)."""
    xhat, rstd = numpy.empty_like(x), numpy.empty((x.shape[0], 1), x.dtype)
    layer_norm_forward_rows(x, weight, bias, xhat, out, rstd, cols, eps)
    wide = x.astype(numpy.float64)
    stats[:, 0] = wide.sum(axis=-1) / int(cols)
    d = wide - stats[:, :1]
    stats[:, 1] = 1.0 / numpy.sqrt((d * d).sum(axis=-1) / int(cols) + float(eps))
    kept[...] = x.astype(kept.dtype)
    if not numpy.array_equal(kept.astype(x.dtype), x, equal_nan=True):
        raise ValueError("LayerNorm would keep its input in 16 bits, but the input is not on the 16-bit "
                         "grid (the kernel assumes it is a rounded activation)")


def layer_norm_forward_rows_16_bit_input(x, weight, bias, kept, out, stats, cols, eps):
    """layer_norm_forward_rows_float_kept_{fmt}_input_16_bit: x is the 16-bit array kept (passed
    again as `kept`, unwritten); the same numbers as from x's float32 widening."""
    layer_norm_forward_rows_kept_input(x.astype(numpy.float32), weight, bias, x.copy(), out, stats, cols, eps)


def layer_norm_backward_rows_kept_input(g, weight, kept, stats, pending, gx, cols, add_pending):
    """layer_norm_backward_rows_{T}_kept_{fmt}: xhat and rstd recomputed, then the same formula."""
    layer_norm_backward_rows(g, weight, xhat_from_input(kept, stats, g.dtype), stats[:, 1:].astype(g.dtype),
                             pending, gx, cols, add_pending)


def layer_norm_backward_rows_16_bit_grads(g, weight, kept, stats, pending, gx, cols, add_pending):
    """layer_norm_backward_rows_float_kept_{fmt}_grads_16_bit: the kept-input kernel's numbers
    from g's float32 widening, gx rounded into its 16 bits as stored; with add_pending, that
    rounded gradient plus the pending 16-bit one in float32, rounded again."""
    wide = numpy.empty(gx.shape, numpy.float32)
    layer_norm_backward_rows_kept_input(g.astype(numpy.float32), weight, kept, stats, None, wide, cols, 0)
    rounded = wide.astype(gx.dtype)
    if add_pending:
        rounded = (pending.astype(numpy.float32) + rounded.astype(numpy.float32)).astype(gx.dtype)
    gx[...] = rounded


def layer_norm_column_sums_rows_16_bit_grads(g, kept, stats, gw, gb, rows, cols, accumulate_w, accumulate_b):
    """layer_norm_column_sums_float_kept_{fmt}_grads_16_bit: the same sums of g's float32 widening."""
    layer_norm_column_sums_rows_kept_input(g.astype(numpy.float32), kept, stats, gw, gb, rows, cols,
                                           accumulate_w, accumulate_b)


def layer_norm_column_sums_rows_kept_input(g, kept, stats, gw, gb, rows, cols, accumulate_w, accumulate_b):
    """layer_norm_column_sums_{T}_kept_{fmt}: xhat recomputed, then the same sums."""
    layer_norm_column_sums_rows(g, xhat_from_input(kept, stats, g.dtype), stats, gw, gb, rows, cols,
                                accumulate_w, accumulate_b)
