"""Reductions: sum, mean, max. Backward broadcasts the gradient back over the reduced axes."""
from ..backend import get_array_module
from ..function import Function


def _axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axis = axis if isinstance(axis, tuple) else (axis,)
    return tuple(a % ndim for a in axis)


def _expand(g, shape, axes):
    """Reinsert the reduced axes as size 1 so g broadcasts against the input."""
    kept = [1 if i in axes else n for i, n in enumerate(shape)]
    return g.reshape(kept)


class Sum(Function):
    @staticmethod
    def forward(ctx, x, axis, keepdims):
        ctx.shape, ctx.axes = x.shape, _axes(axis, x.ndim)
        return x.sum(axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        return xp.broadcast_to(_expand(g, ctx.shape, ctx.axes), ctx.shape)


class Max(Function):
    """Gradient shared equally among tied maxima (the subgradient numerical checks agree with)."""

    @staticmethod
    def forward(ctx, x, axis, keepdims):
        ctx.axes = _axes(axis, x.ndim)
        out = x.max(axis=ctx.axes, keepdims=True)
        ctx.save_for_backward(x, out)
        return out if keepdims else out.reshape([n for i, n in enumerate(out.shape) if i not in ctx.axes])

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved
        mask = x == out
        count = mask.sum(axis=ctx.axes, keepdims=True)
        return mask * (_expand(g, x.shape, ctx.axes) / count)


def sum(x, axis=None, keepdims=False):
    return Sum.apply(x, axis=axis, keepdims=keepdims)


def mean(x, axis=None, keepdims=False):
    count = 1
    for a in _axes(axis, x.ndim):
        count *= x.shape[a]
    return sum(x, axis, keepdims) * (1.0 / count)


def max(x, axis=None, keepdims=False):
    return Max.apply(x, axis=axis, keepdims=keepdims)
