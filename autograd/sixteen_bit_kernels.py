"""CUDA kernels that read and write a GPU's 16-bit activations (--fp16/--bf16), each computing
in float32 and rounding where the CPU's emulation rounds (precision.py), so the numbers are the
emulation's:

- the residual stream: bias + dropout + residual add in one kernel. Under 16-bit storage a
  block's branch ends as two rounded ops, t = y + bias on the 16-bit grid, then residual +
  dropout(t) on the grid again; as separate array ops that is an add, a rounding, the add and the
  rounding that makes the 16-bit copy: four launches, each reading and writing float32. The kernel
  reads y (the projection's 16-bit or float32 output), the 16-bit bias, the keep mask and the
  residual (16-bit, or float32 where the stream starts: the embedding's output) and writes the
  block's output as a 16-bit array, the residual stream Megatron keeps, which LayerNorm's row
  kernels and the next block's kernel read as it is;
- a Linear's bias add, which writes the Linear's 16-bit output from its GEMM's float32 one;
- the MLP's bias + GeLU (tanh form), from the first GEMM's output (16-bit, or float32 sums, then
  also keeping GeLU's 16-bit input: the GEMM epilogue's numbers where nvmath-python is absent), and
  its backward, from a 16-bit (or float32) gradient to a 16-bit one;
- the embedding's end: dropout(x + rows), the word embedding's lookup plus the position table's
  rows, rounded after the add and again after the dropout, as the two ops it fuses;
- dropout's backward, from a 16-bit (or float32) gradient to a 16-bit one.

Products and sums use the _rn intrinsics so the compiler cannot contract them into a fused
multiply-add the emulation does not make. Each kernel's source names its twin (row_kernels.py's
convention), the NumPy function computing the same numbers, which the strict CuPy stand-in runs
in its place.
"""
import numpy

from . import precision

#: Each 16-bit format's CUDA header, type, rounding conversion from float and widening to float
#: (row_kernels.py's 16-bit variants use the same table)
CUDA_16_BIT = {"bf16": {"header": "cuda_bf16.h", "kept": "__nv_bfloat16", "to_kept": "__float2bfloat16_rn",
                        "from_kept": "__bfloat162float"},
               "fp16": {"header": "cuda_fp16.h", "kept": "__half", "to_kept": "__float2half_rn",
                        "from_kept": "__half2float"}}
_SIXTEEN_BIT = {fmt: (t["header"], t["kept"], t["to_kept"], t["from_kept"]) for fmt, t in CUDA_16_BIT.items()}

_SOURCE = r"""
#include <{header}>
{prelude}typedef {store} ST;
typedef {y_type} YT;
typedef {residual_type} RT;
#define WIDE_Y(v) {wide_y}(v)
#define WIDE_R(v) {wide_r}(v)
#define HAS_KEEP {has_keep}
#define HAS_BIAS {has_bias}
// the value on the 16-bit grid, as float: the rounding a 16-bit store makes
__device__ __forceinline__ float on_grid(float v) { return {from_16}({to_16}(v)); }

// twin: {module}:{twin}
// without a bias (HAS_BIAS 0: the bias argument is y again, unread) y is on the grid already
extern "C" __global__ void bias_dropout_add_{name}(
        const YT* y, const ST* bias, const bool* keep, const RT* residual, ST* out, float scale,
        long long n, long long cols) {
    EACH_INDEX {
#if HAS_BIAS
        float t = on_grid(__fadd_rn(WIDE_Y(y[i]), {from_16}(bias[i % cols])));
#else
        float t = WIDE_Y(y[i]);
#endif
#if HAS_KEEP
        t = __fmul_rn(__fmul_rn(t, keep[i] ? 1.0f : 0.0f), scale);
#endif
        out[i] = {to_16}(__fadd_rn(t, WIDE_R(residual[i])));
    }
}
"""

_BIAS_ADD_SOURCE = r"""
#include <{header}>
{prelude}typedef {store} ST;

// twin: {module}:bias_add_twin
extern "C" __global__ void bias_add_{fmt}(const float* y, const ST* bias, ST* out, long long n, long long cols) {
    EACH_INDEX
        out[i] = {to_16}(__fadd_rn(y[i], {from_16}(bias[i % cols])));
}
"""

_BIAS_GELU_SOURCE = r"""
#include <{header}>
{prelude}typedef {store} ST;
typedef {y_type} YT;
#define KEEPS_INPUT {keeps_input}

// twin: {module}:{twin}
// elementwise.py's _gelu_tanh on x = y + b, operation by operation; with KEEPS_INPUT also x
// rounded into `kept` (GeLU's input, which GeluMLP's backward reads: a GEMM epilogue's GELU_AUX)
extern "C" __global__ void bias_gelu_tanh_{name}(const YT* y, const ST* b, ST* out, ST* kept, float cubic,
                                                  float sqrt_2_over_pi, long long n, long long cols) {
    EACH_INDEX {
        float x = __fadd_rn({wide_y}(y[i]), {from_16}(b[i % cols]));
        float t = gelu_tanh_t(x, cubic, sqrt_2_over_pi);
        out[i] = {to_16}(__fmul_rn(__fmul_rn(__fadd_rn(t, 1.0f), x), 0.5f));
#if KEEPS_INPUT
        kept[i] = {to_16}(x);
#endif
    }
}
"""

_BIAS_GELU_BACKWARD_SOURCE = r"""
#include <{header}>
{prelude}typedef {store} ST;
typedef {g_type} GT;
typedef {y_type} YT;

// twin: {module}:bias_gelu_tanh_backward_twin
// elementwise.py's bias_gelu_tanh_backward_recomputed, operation by operation, rounded to 16 bits
// as it is stored (the bias's gradient is a GEMV of it: ops/arithmetic.py)
extern "C" __global__ void bias_gelu_tanh_backward_{name}(
        const GT* g, const YT* y, const ST* b, ST* out, float cubic, float sqrt_2_over_pi,
        float cubic_grad, long long n, long long cols) {
    EACH_INDEX {
        float x = __fadd_rn({wide_y}(y[i]), {from_16}(b[i % cols]));
        float t = gelu_tanh_t(x, cubic, sqrt_2_over_pi);
        float grad = __fmul_rn(__fadd_rn(__fmul_rn(__fmul_rn(x, x), cubic_grad), sqrt_2_over_pi), x);
        grad = __fmul_rn(grad, __fadd_rn(-__fmul_rn(t, t), 1.0f));
        grad = __fmul_rn(__fmul_rn(__fadd_rn(grad, __fadd_rn(t, 1.0f)), 0.5f), {wide_g}(g[i]));
        out[i] = {to_16}(grad);
    }
}
"""

_ADD_ROWS_DROPOUT_SOURCE = r"""
#include <{header}>
{prelude}typedef {store} ST;
typedef {x_type} XT;
#define HAS_ROWS {has_rows}
#define HAS_KEEP {has_keep}

// twin: {module}:add_rows_dropout_twin
// dropout(x + rows): rows (a table's rows, one per position) repeat every `cols` values of x; the
// sum is on the 16-bit grid before the dropout (the emulation's two rounded ops). Without rows
// (HAS_ROWS 0: the argument is x again and cols 0, unread) x is on the grid already.
extern "C" __global__ void add_rows_dropout_{name}(const XT* x, const ST* rows, const bool* keep, ST* out,
                                                   float scale, long long n, long long cols) {
    EACH_INDEX {
#if HAS_ROWS
        float t = __fadd_rn({wide_x}(x[i]), {from_16}(rows[i % cols]));
        t = {from_16}({to_16}(t));
#else
        float t = {wide_x}(x[i]);
#endif
#if HAS_KEEP
        t = __fmul_rn(__fmul_rn(t, keep[i] ? 1.0f : 0.0f), scale);
#endif
        out[i] = {to_16}(t);
    }
}
"""

_DROPOUT_BACKWARD_SOURCE = r"""
#include <{header}>
{prelude}typedef {store} ST;
typedef {g_type} GT;

// twin: {module}:dropout_backward_twin
// dropouts.py's dropout_backward chain (g where kept, times 1 / (1 - p)), rounded as it is stored
extern "C" __global__ void dropout_backward_{name}(const GT* g, const bool* keep, ST* out, float scale,
                                                   long long n) {
    EACH_INDEX
        out[i] = {to_16}(__fmul_rn(__fmul_rn({wide_g}(g[i]), keep[i] ? 1.0f : 0.0f), scale));
}
"""

_PRELUDE = r"""
// a grid-stride loop over the n values
#define EACH_INDEX for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; \
                        i += (long long)gridDim.x * blockDim.x)
// elementwise.py's _gelu_tanh's t = tanh(sqrt(2/pi) (x + 0.044715 x^3)), operation by operation
__device__ __forceinline__ float gelu_tanh_t(float x, float cubic, float sqrt_2_over_pi) {
    float t = __fmul_rn(__fmul_rn(x, x), cubic);
    return tanhf(__fmul_rn(__fmul_rn(__fadd_rn(t, 1.0f), x), sqrt_2_over_pi));
}
"""

#: threads a block, and at most this many blocks (each thread then loops), as bf16_bits.py's kernels
THREADS, MAX_BLOCKS = 256, 4096


def operand(dtype, fmt):
    """(C type, widening to float) of an operand of numpy `dtype`: float32, or fmt's 16-bit type."""
    if numpy.dtype(dtype) == numpy.float32:
        return "float", "(float)"
    if precision.format_of(dtype) != fmt:
        raise ValueError(f"the {fmt} residual kernel reads float32 or {fmt} arrays, not {numpy.dtype(dtype)}")
    return _SIXTEEN_BIT[fmt][1], _SIXTEEN_BIT[fmt][3]


def code(fmt, y_dtype, residual_dtype, has_keep, has_bias=True):
    """(CUDA source, kernel name) of the variant for 16-bit format `fmt`, y and the residual of
    these dtypes (float32 or fmt's), with or without a keep mask, with or without a bias."""
    (y_type, wide_y), (residual_type, wide_r) = operand(y_dtype, fmt), operand(residual_dtype, fmt)
    name = (f"{fmt}_y_{short_name(y_dtype)}_residual_{short_name(residual_dtype)}" + ("_dropout" if has_keep else "")
            + ("" if has_bias else "_no_bias"))
    source = render(_SOURCE, fmt, y_type=y_type, residual_type=residual_type, wide_y=wide_y, wide_r=wide_r,
                    has_keep=str(int(has_keep)), has_bias=str(int(has_bias)), name=name,
                    twin="bias_dropout_add_twin" if has_bias else "dropout_add_twin")
    return source, f"bias_dropout_add_{name}"


def render(template, fmt, **values):
    """template with fmt's header, types and conversions, this module's name and `values` filled in."""
    header, store, to_16, from_16 = _SIXTEEN_BIT[fmt]
    values = dict(prelude=_PRELUDE, header=header, store=store, to_16=to_16, from_16=from_16, module=__name__,
                  fmt=fmt, **values)
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template


#: the bias + GeLU kernel's twin, the chain it equals (ops/elementwise.py, a layer above this one)
GELU_TWIN = "npmegatron.autograd.ops.elementwise:bias_gelu_tanh_twin"


#: ... and the variant's that also keeps GeLU's input
GELU_KEEPING_INPUT_TWIN = "npmegatron.autograd.ops.elementwise:bias_gelu_tanh_keeping_input_twin"


def bias_gelu_code(fmt, y_dtype, keeps_input=False):
    """(CUDA source, kernel name) of bias + GeLU (tanh) from y of `y_dtype` to fmt's 16 bits;
    keeps_input: also y + b rounded to fmt's 16 bits."""
    y_type, wide_y = operand(y_dtype, fmt)
    name = f"{fmt}_y_{short_name(y_dtype)}" + ("_keeping_input" if keeps_input else "")
    twin = GELU_KEEPING_INPUT_TWIN if keeps_input else GELU_TWIN
    source = render(_BIAS_GELU_SOURCE.replace("{module}:{twin}", twin), fmt, y_type=y_type, wide_y=wide_y, name=name,
                    keeps_input=str(int(keeps_input)))
    return source, f"bias_gelu_tanh_{name}"


GELU_BACKWARD_TWIN = "npmegatron.autograd.ops.elementwise:bias_gelu_tanh_backward_twin"


def bias_gelu_backward_code(fmt, g_dtype, y_dtype):
    """(CUDA source, kernel name) of bias + GeLU's backward from g and y of these dtypes."""
    (g_type, wide_g), (y_type, wide_y) = operand(g_dtype, fmt), operand(y_dtype, fmt)
    name = f"{fmt}_g_{short_name(g_dtype)}_y_{short_name(y_dtype)}"
    source = render(_BIAS_GELU_BACKWARD_SOURCE.replace("{module}:bias_gelu_tanh_backward_twin", GELU_BACKWARD_TWIN),
                     fmt, g_type=g_type, wide_g=wide_g, y_type=y_type, wide_y=wide_y, name=name)
    return source, f"bias_gelu_tanh_backward_{name}"


def bias_add_code(fmt):
    """(CUDA source, kernel name) of the bias add that writes a Linear's 16-bit output."""
    return render(_BIAS_ADD_SOURCE, fmt), f"bias_add_{fmt}"


def add_rows_dropout_code(fmt, x_dtype, has_rows, has_keep):
    """(CUDA source, kernel name) of dropout(x + rows) from x of `x_dtype` to fmt's 16 bits."""
    x_type, wide_x = operand(x_dtype, fmt)
    name = f"{fmt}_x_{short_name(x_dtype)}" + ("_rows" if has_rows else "") + ("_dropout" if has_keep else "")
    source = render(_ADD_ROWS_DROPOUT_SOURCE, fmt, x_type=x_type, wide_x=wide_x, name=name,
                    has_rows=str(int(has_rows)), has_keep=str(int(has_keep)))
    return source, f"add_rows_dropout_{name}"


def dropout_backward_code(fmt, g_dtype):
    """(CUDA source, kernel name) of dropout's backward from g of `g_dtype` to fmt's 16 bits."""
    g_type, wide_g = operand(g_dtype, fmt)
    name = f"{fmt}_g_{short_name(g_dtype)}"
    return render(_DROPOUT_BACKWARD_SOURCE, fmt, g_type=g_type, wide_g=wide_g, name=name), f"dropout_backward_{name}"


def short_name(dtype):
    return "float32" if numpy.dtype(dtype) == numpy.float32 else "16"


_compiled = {}


def bias_dropout_add(y, bias, keep, residual, scale, fmt):
    """residual + dropout(y + bias) as the 16-bit format `fmt` stores it (module docstring), a new
    C-ordered 16-bit array; keep None: no dropout; bias None: residual + dropout(y) (a block
    without biases, the Llama family's). y, keep and the residual: C-ordered device arrays of one
    shape; bias: fmt's 16-bit array of y's last dimension."""
    import cupy
    variant = (fmt, numpy.dtype(y.dtype), numpy.dtype(residual.dtype), keep is not None, bias is not None)
    out = cupy.empty(y.shape, precision.sixteen_bit_dtype(fmt))
    launch(variant, lambda: code(*variant),
           (y, y if bias is None else bias, y if keep is None else keep, residual, out,
            numpy.float32(1.0 if scale is None else scale), numpy.int64(y.size), numpy.int64(y.shape[-1])), y.size)
    return out


def launch(key, make_code, args, n, grid=None, block=(THREADS,)):
    """Run the kernel `make_code()` makes (compiled once per CuPy module and key): over n values
    in a grid-stride loop, or with the `grid` and `block` given."""
    import cupy
    kernel = _compiled.get((cupy, key))     # per CuPy module: a test's stand-in is its own
    if kernel is None:
        kernel = _compiled[cupy, key] = cupy.RawKernel(*make_code())
    kernel(grid or (max(1, min(MAX_BLOCKS, -(-n // THREADS))),), block, args)


def add_rows_dropout(x, rows, keep, scale, fmt):
    """dropout(x + rows) as fmt's 16-bit array, in one launch (module docstring): x a C-ordered
    float32 or fmt's 16-bit device array, rows fmt's 16-bit C-ordered array whose size divides x's
    (None: no rows), keep a bool mask of x's shape (None: no dropout)."""
    import cupy
    out = cupy.empty(x.shape, precision.sixteen_bit_dtype(fmt))
    variant = (fmt, numpy.dtype(x.dtype), rows is not None, keep is not None)
    launch(("add rows dropout",) + variant, lambda: add_rows_dropout_code(*variant),
           (x, x if rows is None else rows, x if keep is None else keep, out,
            numpy.float32(1.0 if scale is None else scale), numpy.int64(x.size),
            numpy.int64(0 if rows is None else rows.size)), x.size)
    return out


def dropout_backward(g, keep, scale, fmt):
    """g where kept, times scale, rounded to fmt's 16-bit array (one launch) from C-ordered
    float32 or fmt's 16-bit device g."""
    import cupy
    out = cupy.empty(g.shape, precision.sixteen_bit_dtype(fmt))
    launch(("dropout backward", fmt, numpy.dtype(g.dtype)), lambda: dropout_backward_code(fmt, g.dtype),
           (g, keep, out, numpy.float32(scale), numpy.int64(g.size)), g.size)
    return out


def takes_16_bit_operand(a, fmt):
    """Whether the kernels above take device array `a` as an operand: non-empty, C-ordered,
    float32 or fmt's 16-bit."""
    return (type(a).__module__.startswith("cupy") and a.size > 0 and fmt in _SIXTEEN_BIT and a.flags.c_contiguous
            and (a.dtype == numpy.float32 or precision.format_of(a.dtype) == fmt))


def bias_gelu_tanh(y, b, fmt, cubic, sqrt_2_over_pi, keep_input=False):
    """gelu(y + b), the tanh form with these constants, as fmt's 16-bit array: the MLP's activation
    from its first GEMM's output (16-bit, or float32), computed operation by operation as the
    elementwise chain does (its twin, GELU_TWIN); keep_input: (that, y + b as fmt's 16-bit array),
    in the same launch."""
    import cupy
    out = cupy.empty(y.shape, precision.sixteen_bit_dtype(fmt))
    kept = cupy.empty(y.shape, out.dtype) if keep_input else out
    launch(("gelu", fmt, y.dtype, keep_input), lambda: bias_gelu_code(fmt, y.dtype, keep_input),
            (y, b, out, kept, numpy.float32(cubic), numpy.float32(sqrt_2_over_pi), numpy.int64(y.size),
             numpy.int64(y.shape[-1])), y.size)
    return (out, kept) if keep_input else out


def bias_gelu_tanh_backward(g, y, b, fmt, cubic, sqrt_2_over_pi, cubic_grad):
    """The gradient of gelu(y + b) at g rounded to fmt's 16 bits: the recomputing chain's numbers
    (GELU_BACKWARD_TWIN) in one launch, from 16-bit or float32 g and y."""
    import cupy
    out = cupy.empty(y.shape, precision.sixteen_bit_dtype(fmt))
    launch(("gelu backward", fmt, g.dtype, y.dtype), lambda: bias_gelu_backward_code(fmt, g.dtype, y.dtype),
            (g, y, b, out, numpy.float32(cubic), numpy.float32(sqrt_2_over_pi), numpy.float32(cubic_grad),
             numpy.int64(y.size), numpy.int64(y.shape[-1])), y.size)
    return out


def bias_add(y, bias, fmt):
    """y + bias as fmt's 16-bit array, rounded as it is stored (a Linear's output whose GEMM wrote
    float32 y: the sum the CPU's emulation rounds after the op), in one launch."""
    import cupy
    out = cupy.empty(y.shape, precision.sixteen_bit_dtype(fmt))
    launch(("bias", fmt), lambda: bias_add_code(fmt), (y, bias, out, numpy.int64(y.size), numpy.int64(y.shape[-1])),
            y.size)
    return out


def takes_bias_add(y, bias, fmt, y_16_bit=False):
    """Whether bias_add (with y_16_bit, bias_gelu_tanh) takes these: C-ordered float32 (or fmt's
    16-bit) device y, fmt's 16-bit bias of its last dimension."""
    y_ok = y.dtype == numpy.float32 or (y_16_bit and precision.format_of(y.dtype) == fmt)
    return (type(y).__module__.startswith("cupy") and y.size > 0 and fmt in _SIXTEEN_BIT
            and y_ok and y.flags.c_contiguous and precision.format_of(bias.dtype) == fmt
            and bias.flags.c_contiguous and bias.shape == y.shape[-1:])


def takes(y, bias, residual, fmt):
    """Whether bias_dropout_add takes these arrays (its keep mask is made of y's shape): C-ordered
    device arrays of one shape, y and the residual float32 or fmt's 16-bit, the bias fmt's 16-bit
    of y's last dimension, or None."""
    if not type(y).__module__.startswith("cupy") or y.size == 0 or fmt not in _SIXTEEN_BIT:
        return False
    for a in (y, residual):
        if a.shape != y.shape or not a.flags.c_contiguous or not (
                a.dtype == numpy.float32 or precision.format_of(a.dtype) == fmt):
            return False
    return bias is None or precision.format_of(bias.dtype) == fmt and bias.flags.c_contiguous and bias.shape == y.shape[-1:]


def bias_dropout_add_twin(y, bias, keep, residual, out, scale, n, cols):
    """bias_dropout_add_{fmt}_*: the kernel's numbers in NumPy (float32 arithmetic, each stored
    value rounded to out's 16-bit format), written into `out`."""
    fmt = precision.format_of(out.dtype)
    t = precision.round_(y.astype(numpy.float32) + bias.astype(numpy.float32), fmt)
    if keep.dtype == numpy.bool_:      # without a mask the kernel's keep argument is y (unread)
        t = t * keep.astype(numpy.float32)
        t *= numpy.float32(scale)
    out[...] = (t + residual.astype(numpy.float32)).astype(out.dtype)


def dropout_add_twin(y, unread, keep, residual, out, scale, n, cols):
    """bias_dropout_add_{fmt}_*_no_bias: residual + dropout(y) in float32 (y on the grid already),
    rounded to out's 16-bit format."""
    t = y.astype(numpy.float32)
    if keep.dtype == numpy.bool_:
        t = t * keep.astype(numpy.float32)
        t *= numpy.float32(scale)
    out[...] = (t + residual.astype(numpy.float32)).astype(out.dtype)


def add_rows_dropout_twin(x, rows, keep, out, scale, n, cols):
    """add_rows_dropout_{fmt}_*: (x + rows) rounded to out's 16-bit grid (without rows, x as it
    is), then where kept times scale, in float32, rounded to out's format."""
    fmt = precision.format_of(out.dtype)
    t = x.astype(numpy.float32)
    if cols:        # without rows cols is 0 (and the rows argument x, unread)
        t = precision.round_((t.reshape(-1, cols) + rows.astype(numpy.float32).reshape(-1)).reshape(x.shape), fmt)
    if keep.dtype == numpy.bool_:       # without a mask the keep argument is x (unread)
        t = t * keep.astype(numpy.float32)
        t *= numpy.float32(scale)
    out[...] = t.astype(out.dtype)


def dropout_backward_twin(g, keep, out, scale, n):
    """dropout_backward_{fmt}_*: g where kept, times scale, in float32, rounded to out's format."""
    t = g.astype(numpy.float32) * keep.astype(numpy.float32)
    t *= numpy.float32(scale)
    out[...] = t.astype(out.dtype)


def bias_add_twin(y, bias, out, n, cols):
    """bias_add_{fmt}: y + bias in float32, rounded to out's 16-bit format."""
    out[...] = (y + bias.astype(numpy.float32)).astype(out.dtype)


def all_sources():
    """(kernel name, CUDA source) of every variant, for the NVRTC compile in CI
    (tests/test_cuda_sources_compile.py)."""
    dtypes = {fmt: (numpy.float32, precision.sixteen_bit_dtype(fmt)) for fmt in _SIXTEEN_BIT}
    return [code(fmt, y, r, keep, bias)[::-1] for fmt in _SIXTEEN_BIT for y in dtypes[fmt] for r in dtypes[fmt]
            for keep in (False, True) for bias in (True, False)] + [bias_add_code(fmt)[::-1] for fmt in _SIXTEEN_BIT] + [
        bias_gelu_code(fmt, y, keeps)[::-1] for fmt in _SIXTEEN_BIT for y in dtypes[fmt] for keeps in (False, True)] + [
        bias_gelu_backward_code(fmt, g, y)[::-1] for fmt in _SIXTEEN_BIT for g in dtypes[fmt] for y in dtypes[fmt]] + [
        add_rows_dropout_code(fmt, x, rows, keep)[::-1] for fmt in _SIXTEEN_BIT for x in dtypes[fmt]
        for rows in (False, True) for keep in (False, True) if rows or keep] + [
        dropout_backward_code(fmt, g)[::-1] for fmt in _SIXTEEN_BIT for g in dtypes[fmt]]
