"""The vocabulary-parallel cross-entropy's passes over the logits on a GPU, in CUDA C: one read of
the logits forward and one backward, from float32 logits or a GPU's 16-bit ones (--fp16/--bf16),
computing in float32.

Forward, one block a row finds the row's maximum m and the sum s of exp(z - m) in one pass, as an
online softmax does (a larger value rescales the sum so far), and reads the target's logit; ranks
then exchange the maxima, the target logits and the rescaled sums (cross_entropy.py). Backward
writes scale * (softmax - one-hot) for every column, zeros past the real vocabulary, in the
gradient's dtype (16-bit where the logits are: rounded as it is stored, the rounding the tape
makes in the CPU's emulation).

Each kernel's source names its twin (autograd/row_kernels.py's convention), the NumPy function
the strict CuPy stand-in runs in its place: the twins compute the fused chains' numbers (the
maximum, then the sum of exp(z - maximum)), which a GPU's kernel equals up to the order of its
float32 sums.
"""
import numpy

from ..autograd import precision
from ..autograd.row_kernels import threads_for
from ..autograd.sixteen_bit_kernels import CUDA_16_BIT, launch

_WARP_COMBINE = r"""
#define NEG_INF __int_as_float(0xff800000)     // -inf (NVRTC defines no INFINITY without math.h)
// (m, s) of two parts combined: the larger maximum, each sum rescaled to it (a part with no value
// yet has m = -inf and s = 0)
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
    float top = fmaxf(m, m2);
    if (top == NEG_INF) return;
    s = s * expf(m - top) + s2 * expf(m2 - top);
    m = top;
}
"""

_FORWARD = r"""
{header}typedef {logit} LT;
#define WIDE(v) {wide}(v)
""" + _WARP_COMBINE + r"""
// twin: {module}:row_statistics_twin
// per row: its maximum over the real columns, the sum of exp(z - maximum) (of exp(z) where the
// maximum is -inf) and the logit at column target[row]
extern "C" __global__ void cross_entropy_rows_{name}(
        const LT* logits, const long long* target, float* row_max, float* sums, float* target_logit,
        int real, long long width) {
    __shared__ float shared_m[32], shared_s[32];
    const LT* row = logits + (size_t)blockIdx.x * width;
    float m = NEG_INF, s = 0.0f;
    for (int c = threadIdx.x; c < real; c += blockDim.x) {
        float z = WIDE(row[c]);
        if (z > m) { s = s * expf(m - z) + 1.0f; m = z; }
        else if (z != NEG_INF) s += expf(z - m);
    }
    for (int offset = 16; offset > 0; offset /= 2)
        combine(m, s, __shfl_xor_sync(0xffffffff, m, offset), __shfl_xor_sync(0xffffffff, s, offset));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { shared_m[warp] = m; shared_s[warp] = s; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < blockDim.x / 32; ++w) combine(m, s, shared_m[w], shared_s[w]);
        row_max[blockIdx.x] = m;
        sums[blockIdx.x] = m == NEG_INF ? 0.0f : s;
        target_logit[blockIdx.x] = WIDE(row[target[blockIdx.x]]);
    }
}
"""

_BACKWARD = r"""
{header}typedef {logit} LT;
typedef {grad} GT;
#define WIDE(v) {wide}(v)
#define STORE(v) {store}(v)

// twin: {module}:softmax_minus_one_hot_twin
// grad = scale * (exp(z - shift) / sum_exp - (column == target)), cross_entropy.py's chain
// operation by operation; padded columns (at or past `real`) 0; target -1: another rank's column
extern "C" __global__ void cross_entropy_grad_rows_{name}(
        const LT* logits, const float* shift, const float* sum_exp, const long long* target,
        const float* scale, long long scale_stride, GT* grad, int real, long long width) {
    size_t start = (size_t)blockIdx.x * width;
    float m = shift[blockIdx.x], total = sum_exp[blockIdx.x], k = scale[blockIdx.x * scale_stride];
    long long t = target[blockIdx.x];
    for (long long c = threadIdx.x; c < width; c += blockDim.x) {
        float v = 0.0f;
        if (c < real) {
            v = __fdiv_rn(expf(__fsub_rn(WIDE(logits[start + c]), m)), total);
            v = __fmul_rn(__fsub_rn(v, c == t ? 1.0f : 0.0f), k);
        }
        grad[start + c] = STORE(v);
    }
}
"""


def _types(dtype):
    """(header line, C type, widening to float or storing from it) of float32 or a 16-bit dtype."""
    fmt = precision.format_of(dtype)
    if fmt is None:
        if numpy.dtype(dtype) != numpy.float32:
            raise ValueError(f"the cross-entropy kernels read float32 or 16-bit logits, not {numpy.dtype(dtype)}")
        return "", "float", "(float)", "(float)"
    t = CUDA_16_BIT[fmt]
    return f"#include <{t['header']}>\n", t["kept"], t["from_kept"], t["to_kept"]


def _short(dtype):
    return precision.format_of(dtype) or "float32"


def forward_code(logit_dtype):
    """(CUDA source, kernel name) of the forward row statistics for logits of this dtype."""
    header, logit, wide, _ = _types(logit_dtype)
    name = _short(logit_dtype)
    source = (_FORWARD.replace("{header}", header).replace("{logit}", logit).replace("{wide}", wide)
              .replace("{module}", __name__).replace("{name}", name))
    return source, f"cross_entropy_rows_{name}"


def backward_code(logit_dtype, grad_dtype):
    """(CUDA source, kernel name) of the gradient kernel from logits of one dtype to a gradient of
    another (float32, or the logits' 16-bit format)."""
    header, logit, wide, _ = _types(logit_dtype)
    grad_header, grad, _, store = _types(grad_dtype)
    name = f"{_short(logit_dtype)}_grad_{_short(grad_dtype)}"
    source = (_BACKWARD.replace("{header}", header or grad_header).replace("{logit}", logit)
              .replace("{grad}", grad).replace("{wide}", wide).replace("{store}", store)
              .replace("{module}", __name__).replace("{name}", name))
    return source, f"cross_entropy_grad_rows_{name}"


def takes(flat):
    """Whether the kernels take these logits: a C-ordered (rows, width) device array of float32 or
    16-bit values."""
    return (type(flat).__module__.startswith("cupy") and flat.ndim == 2 and flat.size > 0
            and flat.flags.c_contiguous
            and (flat.dtype == numpy.float32 or precision.format_of(flat.dtype) is not None))


def row_statistics(flat, real, target):
    """(each row's maximum over its first `real` columns, the sum of exp(z - maximum), the logit at
    column target[row]), float32, in one launch: `target` int64 per row, a column in range."""
    import cupy
    rows = flat.shape[0]
    row_max, sums, target_logit = (cupy.empty(rows, numpy.float32) for _ in range(3))
    launch(("cross entropy rows", numpy.dtype(flat.dtype)), lambda: forward_code(flat.dtype),
           (flat, target, row_max, sums, target_logit, numpy.int32(real), numpy.int64(flat.shape[1])),
           rows, grid=(rows,), block=(threads_for(real),))
    return row_max, sums, target_logit


def softmax_minus_one_hot(flat, shift, sum_exp, target, scale, real, grad_dtype):
    """scale * (softmax - one-hot(target)) of the logits as a new array of grad_dtype, in one
    launch: shift and sum_exp float32 per row, target int64 per row (-1: another rank's), scale a
    float32 array of one value or one per row."""
    import cupy
    grad = cupy.empty(flat.shape, grad_dtype)
    variant = (numpy.dtype(flat.dtype), numpy.dtype(grad_dtype))
    launch(("cross entropy grad",) + variant, lambda: backward_code(*variant),
           (flat, shift, sum_exp, target, scale, numpy.int64(0 if scale.size == 1 else 1), grad,
            numpy.int32(real), numpy.int64(flat.shape[1])),
           flat.shape[0], grid=(flat.shape[0],), block=(threads_for(flat.shape[1]),))
    return grad


def row_statistics_twin(logits, target, row_max, sums, target_logit, real, width):
    """cross_entropy_rows_*: the maximum, then the sum of exp(z - maximum) in float32 as the fused
    chain sums it (a row of -inf is shifted by 0: its sum is 0), and the target's logit."""
    z = logits[:, :int(real)].astype(numpy.float32)
    row_max[...] = z.max(axis=1) if z.shape[1] else -numpy.inf
    shift = numpy.where(row_max == -numpy.inf, numpy.float32(0), row_max)
    sums[...] = numpy.sum(numpy.exp(z - shift[:, None]), axis=-1)
    target_logit[...] = numpy.take_along_axis(logits, target[:, None], axis=1)[:, 0].astype(numpy.float32)


def softmax_minus_one_hot_twin(logits, shift, sum_exp, target, scale, scale_stride, grad, real, width):
    """cross_entropy_grad_rows_*: cross_entropy.py's gradient chain in float32, stored in grad's
    dtype; padded columns 0."""
    real = int(real)
    out = logits[:, :real].astype(numpy.float32) - shift[:, None]
    numpy.exp(out, out=out)
    out /= sum_exp[:, None]
    out -= target[:, None] == numpy.arange(real)[None, :]
    out *= scale[:, None] if scale_stride else scale[0]
    grad[:, :real] = out.astype(grad.dtype)
    grad[:, real:] = 0


def all_sources():
    """(kernel name, CUDA source) of every variant, for the NVRTC compile in CI."""
    dtypes = [numpy.dtype(numpy.float32)] + [precision.sixteen_bit_dtype(fmt) for fmt in CUDA_16_BIT]
    return [forward_code(d)[::-1] for d in dtypes] + [
        backward_code(d, g)[::-1] for d in dtypes for g in {numpy.dtype(numpy.float32), d}]
