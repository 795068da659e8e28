"""Broadcasting arithmetic and matrix products; gradients are summed back to each input's shape."""
import numpy

from .. import epilogues, gemm, precision, sixteen_bit_kernels
from ..backend import get_array_module
from ..errors import InputError
from ..function import Function, kept_16_bit_copy
from ..tensor import Tensor


def unbroadcast(grad, shape):
    """Sum a broadcast gradient back to `shape` (the conjugate of broadcasting)."""
    if grad.shape == tuple(shape):
        return grad
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1)
    return grad.sum(axis=axes).reshape(shape)


def _check_broadcast(op, a, b):
    try:
        get_array_module(a, b).broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise InputError(f"cannot {op} shapes {tuple(a.shape)} and {tuple(b.shape)}: they do not "
                         "broadcast; make trailing dimensions equal or 1") from None


def _operand(x, like):
    """Python numbers become 0-d arrays of the tensor's dtype, so float32 stays float32."""
    if isinstance(x, Tensor) or hasattr(x, "shape"):
        return x
    data = like.data if isinstance(like, Tensor) else like
    return get_array_module(data).asarray(x, dtype=data.dtype)


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        _check_broadcast("add", a, b)
        ctx.shapes = a.shape, b.shape
        return a + b

    @staticmethod
    def backward(ctx, g):
        sa, sb = ctx.shapes
        na, nb = ctx.needs_input_grad
        return (unbroadcast(g, sa) if na else None), (unbroadcast(g, sb) if nb else None)


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        _check_broadcast("multiply", a, b)
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        na, nb = ctx.needs_input_grad
        return (unbroadcast(g * b, a.shape) if na else None), (unbroadcast(g * a, b.shape) if nb else None)


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        _check_broadcast("divide", a, b)
        ctx.save_for_backward(a, b)
        return a / b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        na, nb = ctx.needs_input_grad
        ga = unbroadcast(g / b, a.shape) if na else None
        gb = unbroadcast(-g * a / (b * b), b.shape) if nb else None
        return ga, gb


class Pow(Function):
    @staticmethod
    def forward(ctx, a, b):
        _check_broadcast("raise", a, b)
        out = a ** b
        ctx.save_for_backward(a, b, out)
        return out

    @staticmethod
    def backward(ctx, g):
        a, b, out = ctx.saved
        na, nb = ctx.needs_input_grad
        ga = unbroadcast(g * b * a ** (b - 1), a.shape) if na else None
        gb = unbroadcast(g * out * get_array_module(a).log(a), b.shape) if nb else None
        return ga, gb


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, g):
        return -g


def _swap(x):
    return x.swapaxes(-1, -2)


def _check_matmul(a, b):
    if a.ndim < 2 or b.ndim < 2:
        raise InputError(f"matmul needs arrays of at least 2 dimensions, got shapes {tuple(a.shape)} "
                         f"and {tuple(b.shape)}; reshape vectors to (1, n) or (n, 1)")
    if a.shape[-1] != b.shape[-2]:
        raise InputError(f"cannot matmul shapes {tuple(a.shape)} and {tuple(b.shape)}: inner "
                         f"dimensions {a.shape[-1]} and {b.shape[-2]} differ")
    try:
        get_array_module(a, b).broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise InputError(f"cannot matmul shapes {tuple(a.shape)} and {tuple(b.shape)}: batch "
                         "dimensions do not broadcast") from None


def bias_grad(g):
    """g summed over every axis but the last. On NumPy one matrix-vector product: BLAS runs it on
    all the budget's threads where NumPy's sum(axis=0) uses one (measured 0.3 ms against 1.3 ms
    for 2048 x 2048 float32). On a GPU one reduction kernel: `ones @ g` would also allocate and
    fill the ones."""
    g2 = gemm.rows(g)
    xp = get_array_module(g)
    if xp is numpy:
        return xp.ones(g2.shape[0], g.dtype) @ g2
    return g2.sum(axis=0)


def _weight_grad(x, g, grid=None, destination=None, weight=None, result=None):
    """x^T g summed over all leading dimensions in one GEMM (no per-batch temporaries); written
    into or added to `destination` (Context.destination) by the GEMM itself when given. A weight
    that is a transposed view (the output layer's, the embedding's transpose) gets its gradient in
    the same memory order, (g^T x)^T: its leaf's gradient is then C-ordered, and adds to the
    embedding's own without a strided pass over the vocabulary. `result(shape)` makes the array a
    new gradient is written to (16-bit operands: float32), else the product's dtype."""
    if destination is None and weight is not None and weight.ndim == 2 and _transposed(weight):
        out = None if result is None else result(weight.shape[::-1])
        return gemm.matmul(gemm.rows(g).T, gemm.rows(x), out=out, grid=grid).T
    if destination is None:
        out = None if result is None else result(x.shape[-1:] + g.shape[-1:])
        return gemm.matmul(gemm.rows(x).T, gemm.rows(g), out=out, grid=grid)
    out, accumulate = destination
    return gemm.matmul(gemm.rows(x).T, gemm.rows(g), out=out, accumulate=accumulate, grid=grid)


def _transposed(a):
    """Whether a 2-D array is the transpose of a C-ordered one (F- but not C-contiguous)."""
    return a.flags.f_contiguous and not a.flags.c_contiguous


def bias_grad_to(g, destination=None):
    """bias_grad(g), written into `destination` (Context.destination) by the reduction itself, or
    added to it; without one, a new array."""
    if destination is None:
        return bias_grad(g)
    out, accumulate = destination
    if accumulate:
        out += bias_grad(g)
    elif get_array_module(g) is numpy:
        out[...] = bias_grad(g)
    else:
        gemm.rows(g).sum(axis=0, out=out)
    return out


class MatMul(Function):
    @staticmethod
    def forward(ctx, a, b):
        _check_matmul(a, b)
        ctx.save_for_backward(a, b)
        return gemm.matmul(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        na, nb = ctx.needs_input_grad
        ga = unbroadcast(gemm.matmul(g, _swap(b)), a.shape) if na else None
        if not nb:
            gb = None
        elif b.ndim == 2:
            gb = _weight_grad(a, g)
        else:
            gb = unbroadcast(gemm.matmul(_swap(a), g), b.shape)
        return ga, gb


class Linear(Function):
    """x @ w + b with w of shape (in, out): one GEMM each way, bias added in place. Under 16-bit
    storage its GEMMs assume x, w and the output's gradient lie on the 16-bit grid (gemm.py's
    `grid`): true of the model's Linears; a caller whose output has several consumers (their
    gradients' sum is not rounded) or whose operands were never rounded would be rounded by cuBLAS
    on a GPU, where NumPy computes in float32. The strict stand-in refuses such operands."""
    reads_16_bit = True     # 16-bit x into the 16-bit weights' GEMM as it is; widened for float32 weights
    reads_16_bit_grads = True       # a 16-bit output gradient into the GEMMs as it is

    writes_grad_destinations = True

    @staticmethod
    def forward(ctx, x, w, b=None):
        _check_matmul(x, w)
        # Under 16-bit storage x, w and the output's gradient are on the 16-bit grid (inputs and
        # parameters are rounded Function outputs; each Linear output has one consumer, whose
        # node rounds the gradient it returns), so cuBLAS may run 16-bit tensor cores exactly.
        ctx.grid = precision.active()
        fmt = precision.format_of(w.dtype)
        if fmt is None and precision.format_of(x.dtype):
            x = precision.to_float32(x)     # a 16-bit activation (fused attention's) into float32 weights
        if fmt is None:
            ctx.save_for_backward(x, w)
            ctx.on_grid(0)      # x: kept in 16 bits on a GPU (w is the parameter, kept anyway)
            out = gemm.matmul(x, w, grid=ctx.grid)
        else:
            # a GPU's 16-bit weights (--fp16/--bf16): x in 16 bits too (a 16-bit activation as it
            # is, else the copy its rounding made), the copy backward keeps; products summed in float32
            x = x if precision.format_of(x.dtype) == fmt else kept_16_bit_copy(x, fmt)
            ctx.save_for_backward(x, w)
            shape = x.shape[:-1] + w.shape[-1:]
            sixteen = ctx.grid == fmt       # a GPU's 16-bit activations: rounded as they are stored
            if sixteen and b is None:
                return gemm.matmul(x, w, out=get_array_module(x).empty(shape, w.dtype))
            out = epilogues.linear_bias(x, w, b) if sixteen and epilogues.takes(x, w, b, fmt) else None
            if out is not None:
                return out          # the bias added in the GEMM's epilogue
            out = gemm.matmul(x, w, out=_float32(x, shape))
            if sixteen and sixteen_bit_kernels.takes_bias_add(out, b, fmt):
                return sixteen_bit_kernels.bias_add(out, b, fmt)
        if b is not None:
            out += b
        return out

    @staticmethod
    def backward(ctx, g):
        return (Linear.input_grad(ctx, g),) + Linear.parameter_grads(ctx, g)

    # backward in two halves, so tensor parallelism can all-reduce the first during the second
    # The output's gradient g is float32, or 16-bit where the consumer computed it in 16 bits
    # (fused attention's, for the QKV projection): then the GEMMs take it as it is.
    @staticmethod
    def input_grad(ctx, g, sixteen_bit=True):
        """x's gradient; sixteen_bit=False: float32 even where 16-bit gradients flow (a gradient
        that is all-reduced next, summed in float32 as the CPU's emulation sums it)."""
        _, w = ctx.saved
        if not ctx.needs_input_grad[0]:
            return None
        if precision.format_of(w.dtype) is None:
            return gemm.matmul(Linear._wide(g), w.T, grid=ctx.grid)
        g16 = Linear.sixteen_bit_grad(ctx, g, w)
        shape = g.shape[:-1] + w.shape[:1]
        if sixteen_bit and ctx.grid == precision.format_of(w.dtype):    # a GPU's 16-bit gradients: rounded as stored
            return gemm.matmul(g16, w.T, out=get_array_module(g).empty(shape, w.dtype))
        return gemm.matmul(g16, w.T, out=_float32(g, shape))

    @staticmethod
    def parameter_grads(ctx, g):
        ctx.mark_fresh(1, 2)            # a GEMM's and a reduction's results (engine.py)
        x, w = ctx.saved
        need = ctx.needs_input_grad
        gw, gb = None, None
        if need[1] and precision.format_of(w.dtype) is None:
            gw = _weight_grad(x, Linear._wide(g), ctx.grid, ctx.destination(1), w)
        elif need[1]:
            # the same product as the float32 weights' (above), summed into float32
            gw = _weight_grad(x, Linear.sixteen_bit_grad(ctx, g, w), None, ctx.destination(1), w,
                              lambda shape: _float32(g, shape))
        if len(need) > 2 and need[2] and (ctx.grid is not None or precision.format_of(g.dtype)):
            # the GEMMs' 16-bit g under 16-bit weights (exact: g lies on the grid)
            sixteen = precision.format_of(w.dtype) is not None
            gb = bias_grad_by_gemv(Linear.sixteen_bit_grad(ctx, g, w) if sixteen else g, ctx.destination(2))
        elif len(need) > 2 and need[2]:
            gb = bias_grad_to(g, ctx.destination(2))
        return gw, gb

    @staticmethod
    def sixteen_bit_grad(ctx, g, w):
        """The output's gradient in w's 16-bit format (on its grid): the copy its rounding made
        (function.py), else one cast, for both GEMMs."""
        if precision.format_of(g.dtype):
            return g
        if getattr(ctx, "grad_16_bit", None) is None:
            ctx.grad_16_bit = kept_16_bit_copy(g, precision.format_of(w.dtype))
        return ctx.grad_16_bit

    @staticmethod
    def _wide(g):
        """A 16-bit gradient as float32, for a Linear whose weights are not 16-bit (a test's)."""
        return precision.to_float32(g) if precision.format_of(g.dtype) else g


#: (array module, device, length, dtype, value) -> a vector of that value: a bias gradient's GEMV's
#: row of ones, the zero bias of GeluMLP's GeLU-gradient kernel
_constants = {}


def constant_vector(like, n, dtype, value):
    """A vector of n `value`s of `dtype` on like's device, made once and kept (read-only use)."""
    xp = get_array_module(like)
    key = (id(xp), -1 if xp is numpy else xp.cuda.Device().id, n, numpy.dtype(dtype).str, value)
    if key not in _constants:
        _constants[key] = xp.full(n, value, dtype)
    return _constants[key]


def bias_grad_by_gemv(g, destination=None):
    """The bias gradient of g (its rows summed) as one GEMV of a ones row with g, summed in float32
    into `destination` (Context.destination) or a new float32 array. Under 16-bit storage every
    bias's gradient is this GEMV (Linear's, bias + GeLU's, bias + dropout + residual's): a GPU's
    16-bit g reaches cuBLAS as it is and is summed in float32, where an array reduction would be
    the array library's own 16-bit rule, and the CPU's emulation, on float32 g on the 16-bit grid,
    makes the same product, so the order of the sums is the same."""
    rows = gemm.rows(g)
    ones = constant_vector(g, rows.shape[0], g.dtype, 1).reshape(1, -1)
    out, accumulate = destination or (_float32(g, rows.shape[1:]), False)
    gemm.matmul(ones, rows, out=out.reshape(1, -1), accumulate=accumulate)
    return out


def _float32(like, shape):
    """An uninitialised float32 array of `shape` on like's device: a 16-bit product's output."""
    return get_array_module(like).empty(shape, numpy.float32)


def add(a, b):
    return Add.apply(a, _operand(b, a))


def sub(a, b):
    return Add.apply(a, neg(_operand(b, a)))


def mul(a, b):
    return Mul.apply(a, _operand(b, a))


def div(a, b):
    return Div.apply(a, _operand(b, a))


def neg(a):
    return Neg.apply(a) if isinstance(a, Tensor) else -a


def pow(a, b):
    return Pow.apply(a, _operand(b, a))


def matmul(a, b):
    return MatMul.apply(a, b)


def linear(x, w, b=None):
    return Linear.apply(x, w, b) if b is not None else Linear.apply(x, w)
