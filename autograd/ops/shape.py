"""Shape ops: reshape, transpose, split, concatenate and indexing. Each backward is the inverse."""
from .. import precision
from ..backend import get_array_module, scatter_add
from ..errors import InputError
from ..function import Function
from ..tensor import Tensor


class Reshape(Function):
    reads_16_bit = True     # moves values, computes none (Function.reads_16_bit)
    reads_16_bit_grads = True
    passes_gradient_views = True    # backward's result is a view of its incoming gradient (engine.py)

    @staticmethod
    def forward(ctx, x, shape):
        ctx.in_shape = x.shape
        try:
            return x.reshape(shape)
        except ValueError:
            raise InputError(f"cannot reshape shape {tuple(x.shape)} ({x.size} elements) into "
                             f"{tuple(shape)}; the number of elements must stay the same") from None

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.in_shape)


class Transpose(Function):
    reads_16_bit = True     # moves values, computes none (Function.reads_16_bit)
    reads_16_bit_grads = True
    passes_gradient_views = True

    @staticmethod
    def forward(ctx, x, axes):
        ctx.axes = axes
        return x.transpose(axes)

    @staticmethod
    def backward(ctx, g):
        inverse = [0] * len(ctx.axes)
        for i, a in enumerate(ctx.axes):
            inverse[a] = i
        return g.transpose(inverse)


class Split(Function):
    """Several outputs (views); backward concatenates their gradients (zeros where none came)."""
    reads_16_bit = True     # moves values, computes none (Function.reads_16_bit)
    reads_16_bit_grads = True       # the same of the gradients (all 16-bit, or else all widened)

    @staticmethod
    def forward(ctx, x, sections, axis):
        xp = get_array_module(x)
        ctx.axis, ctx.shape, ctx.dtype = axis, x.shape, x.dtype
        parts = xp.split(x, sections, axis=axis)
        ctx.part_shapes = [p.shape for p in parts]
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        given = [g for g in grads if g is not None]
        xp = get_array_module(*given)
        dtypes = {g.dtype for g in given} | {ctx.dtype for g in grads if g is None}
        if len(dtypes) > 1:         # 16-bit and float32 gradients: concatenated in float32
            grads = [precision.to_float32(g) if g is not None and precision.format_of(g.dtype) else g for g in grads]
        dtype = ctx.dtype if len(dtypes) == 1 else precision.master_dtype(ctx.dtype)
        filled = [g if g is not None else xp.zeros(s, dtype) for g, s in zip(grads, ctx.part_shapes)]
        return xp.concatenate(filled, axis=ctx.axis)


class Concatenate(Function):
    reads_16_bit = True     # moves values, computes none (Function.reads_16_bit)
    reads_16_bit_grads = True
    # backward hands each input a part (a view) of its gradient: where every input is a
    # parameter (SwiGLU's gate and up weights) the gradient is theirs, not rounded (function.py)
    passes_gradient_parts = True
    @staticmethod
    def forward(ctx, *xs, axis):
        xp = get_array_module(*xs)
        ctx.axis = axis
        ctx.offsets = []
        total = 0
        for x in xs[:-1]:
            total += x.shape[axis]
            ctx.offsets.append(total)
        try:
            return xp.concatenate(xs, axis=axis)
        except ValueError:
            raise InputError(f"cannot concatenate shapes {[tuple(x.shape) for x in xs]} along axis "
                             f"{axis}; all other dimensions must match") from None

    @staticmethod
    def backward(ctx, g):
        parts = get_array_module(g).split(g, ctx.offsets, axis=ctx.axis)
        return tuple(p if need else None for p, need in zip(parts, ctx.needs_input_grad))


def _is_basic(index):
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


class GetItem(Function):
    reads_16_bit = True     # moves values, computes none (Function.reads_16_bit)
    @staticmethod
    def forward(ctx, x, index):
        ctx.index, ctx.shape, ctx.dtype = index, x.shape, x.dtype
        return x[index]

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        gx = xp.zeros(ctx.shape, precision.master_dtype(ctx.dtype))     # float32 for a 16-bit parameter
        if _is_basic(ctx.index):
            gx[ctx.index] = g
        else:           # advanced indexing may repeat an element: sum, do not overwrite
            scatter_add(gx, ctx.index, g)
        return gx


def reshape(x, *shape):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return Reshape.apply(x, shape=tuple(shape))


def transpose(x, *axes):
    axes = axes[0] if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], (tuple, list))) else axes
    axes = tuple(axes) if axes else tuple(reversed(range(x.ndim)))
    if sorted(a % x.ndim for a in axes) != list(range(x.ndim)):
        raise InputError(f"transpose axes {axes} are not a permutation of the {x.ndim} axes of "
                         f"shape {tuple(x.shape)}")
    return Transpose.apply(x, axes=tuple(a % x.ndim for a in axes))


def split(x, sections, axis=-1):
    """Split into `sections` equal parts (an int) or at the given indices (a list)."""
    axis = axis % x.ndim
    if isinstance(sections, int) and x.shape[axis] % sections:
        raise InputError(f"cannot split axis {axis} of length {x.shape[axis]} into {sections} equal "
                         "parts; pass split indices instead")
    return Split.apply(x, sections=sections, axis=axis)


def concatenate(xs, axis=0):
    return Concatenate.apply(*xs, axis=axis)


def getitem(x, index):
    if isinstance(index, Tensor):
        index = index.data
    elif isinstance(index, tuple):
        index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return GetItem.apply(x, index=index)


class RepeatHeads(Function):
    """Each of x's heads (axis 1 of (b, heads, t, d)) repeated `times` times in a row: the key
    and value heads of grouped-query attention, one per query head of their group (Hugging Face's
    repeat_kv). Backward sums each group's copies back into its head."""
    reads_16_bit = True     # moves values, computes none (Function.reads_16_bit)

    @staticmethod
    def forward(ctx, x, times):
        ctx.times = times
        return get_array_module(x).repeat(x, times, axis=1)

    @staticmethod
    def backward(ctx, g):
        b, heads, t, d = g.shape
        return g.reshape(b, heads // ctx.times, ctx.times, t, d).sum(axis=2)


def repeat_heads(x, times):
    """x (b, heads, t, d) with each head repeated `times` times in a row (grouped-query attention)."""
    if x.ndim != 4 or times < 1:
        raise InputError(f"repeat_heads needs x (b, heads, t, d) and a positive count, got "
                         f"{tuple(x.shape)} and {times}")
    return x if times == 1 else RepeatHeads.apply(x, times=times)
