"""Grouped matrix products: rows in consecutive blocks, block i multiplied by its own matrix w[i]
(Megatron-Core's grouped GEMM, which runs a mixture-of-experts layer's experts on their tokens).

On NumPy each non-empty block is one GEMM. On a GPU the blocks are laid into a zero-padded
(groups, width, k) array, width the longest block, and multiplied by one strided-batched cuBLAS
GEMM; one gather takes the real rows back. The launches are the same for 2 groups or 64. The padding
rows cost FLOPs, the longest block over the mean. They hold zeros and their outputs are dropped, so the
numbers are those of the blocks alone."""
import numpy

from .. import gemm, precision
from ..backend import get_array_module
from ..errors import InputError
from ..function import Function, kept_16_bit_copy
from .arithmetic import constant_vector


class RowBlocks:
    """Consecutive blocks of rows, block i holding sizes[i] rows (host integers): the layout
    grouped_matmul and grouped_bias read. width: the rows each block is padded to on a GPU (the
    longest block, or `padded_rows` where that is more)."""

    def __init__(self, sizes, xp, padded_rows=None):
        self.sizes = numpy.asarray(sizes, numpy.int64).reshape(-1)
        self.groups, self.rows = len(self.sizes), int(self.sizes.sum())
        self.starts = numpy.concatenate(([0], numpy.cumsum(self.sizes)[:-1])).astype(numpy.int64)
        self.width = max(int(self.sizes.max(initial=0)), padded_rows or 0)
        self.xp = xp
        self._device = {}

    def spans(self):
        """(block, first row, end row) of each non-empty block."""
        return [(i, int(s), int(s + n)) for i, (s, n) in enumerate(zip(self.starts, self.sizes)) if n]

    def _on_device(self, name, host):
        """An index array made on the host once and uploaded once (one copy, no launch)."""
        if name not in self._device:
            self._device[name] = self.xp.asarray(host)
        return self._device[name]

    def places(self):
        """Each row's row in the padded (groups x width) layout, on the device."""
        within = numpy.arange(self.rows, dtype=numpy.int64) - numpy.repeat(self.starts, self.sizes)
        return self._on_device("places", numpy.repeat(numpy.arange(self.groups) * self.width, self.sizes) + within)

    def block_of_rows(self):
        """Each row's block number, on the device."""
        return self._on_device("blocks", numpy.repeat(numpy.arange(self.groups, dtype=numpy.int64), self.sizes))

    def pad(self, a):
        """a (rows, k) as (groups, width, k): each block's rows first, zeros after (two launches)."""
        out = self.xp.zeros((self.groups * self.width, a.shape[1]), a.dtype)
        out[self.places()] = a
        return out.reshape(self.groups, self.width, a.shape[1])

    def unpad(self, padded):
        """The real rows of a (groups, width, m) array, in order (one gather)."""
        return padded.reshape(self.groups * self.width, padded.shape[-1])[self.places()]


def _batched(blocks, a):
    """Whether the blocks run as one padded batch (a GPU's rows), not one GEMM a block (NumPy's)."""
    return get_array_module(a) is not numpy and blocks.rows > 0


def _products(a, b, blocks, dtype, grid, padded=None):
    """(rows, m): each block of a (rows, k) times its b[i] (k, m), written in `dtype`; padded: a
    already padded (blocks.pad), where the caller has it."""
    xp = get_array_module(a)
    if not _batched(blocks, a):
        out = xp.empty((blocks.rows, b.shape[-1]), dtype)
        for i, start, stop in blocks.spans():
            gemm.matmul(a[start:stop], b[i], out=out[start:stop], grid=grid)
        return out
    out = xp.empty((blocks.groups, blocks.width, b.shape[-1]), dtype)
    return blocks.unpad(gemm.matmul(blocks.pad(a) if padded is None else padded, b, out=out, grid=grid))


def _weight_products(x, g, blocks, destination, shape, dtype, grid, padded_g=None):
    """(groups, k, m): block i's x^T g, written into or added to `destination` (Context.destination)
    by the GEMMs themselves when given, else a new array; a block without rows gets zeros."""
    xp = get_array_module(x)
    out, accumulate = destination or (xp.empty(shape, dtype), False)
    if _batched(blocks, x):
        padded_g = blocks.pad(g) if padded_g is None else padded_g
        return gemm.matmul(blocks.pad(x).transpose(0, 2, 1), padded_g, out=out, accumulate=accumulate, grid=grid)
    if not accumulate:
        out[...] = 0
    for i, start, stop in blocks.spans():
        gemm.matmul(x[start:stop].T, g[start:stop], out=out[i], accumulate=True, grid=grid)
    return out


class GroupedMatmul(Function):
    """x (rows, k) in blocks, w (groups, k, m) -> (rows, m), block i times w[i]: one GEMM each way
    and one for w's gradient on a GPU (module docstring). Its 16-bit handling is Linear's: under
    --fp16/--bf16 on a GPU x, w and the output's gradient go into the GEMMs as 16-bit arrays, the
    output is 16-bit and w's gradient float32."""
    reads_16_bit = True
    reads_16_bit_grads = True
    writes_grad_destinations = True

    @staticmethod
    def forward(ctx, x, w, blocks):
        if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or x.shape[0] != blocks.rows \
                or w.shape[0] != blocks.groups:
            raise InputError(f"grouped_matmul takes rows (n, k) and weights (groups, k, m) for {blocks.groups} "
                             f"blocks of {blocks.rows} rows in all, not shapes {tuple(x.shape)} and {tuple(w.shape)}")
        ctx.blocks, ctx.grid = blocks, precision.active()
        fmt = precision.format_of(w.dtype)
        if fmt is None and precision.format_of(x.dtype):
            x = precision.to_float32(x)
        elif fmt is not None and precision.format_of(x.dtype) != fmt:
            x = kept_16_bit_copy(x, fmt)
        ctx.save_for_backward(x, w)
        if fmt is None:
            ctx.on_grid(0)
        return _products(x, w, blocks, GroupedMatmul._written_dtype(ctx, w), ctx.grid if fmt is None else None)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved
        fmt = precision.format_of(w.dtype)
        if fmt is None:
            g = precision.to_float32(g) if precision.format_of(g.dtype) else g
        elif precision.format_of(g.dtype) != fmt:
            g = kept_16_bit_copy(g, fmt)
        grid, blocks = ctx.grid if fmt is None else None, ctx.blocks
        padded_g = blocks.pad(g) if _batched(blocks, g) else None     # read by both GEMMs
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = _products(g, w.transpose(0, 2, 1), blocks, GroupedMatmul._written_dtype(ctx, w), grid, padded_g)
        if ctx.needs_input_grad[1]:
            ctx.mark_fresh(1)
            gw = _weight_products(x, g, blocks, ctx.destination(1), w.shape, precision.master_dtype(w.dtype), grid,
                                  padded_g)
        return gx, gw

    @staticmethod
    def _written_dtype(ctx, w):
        """16-bit products where a GPU's activations are 16-bit arrays, float32 for other 16-bit
        weights, else the weights' dtype."""
        fmt = precision.format_of(w.dtype)
        return w.dtype if fmt is None or ctx.grid == fmt else numpy.float32


class GroupedBias(Function):
    """x (rows, m) in blocks + b (groups, m): block i's rows get b[i]. b's gradient sums each
    block's rows as a row of ones times the block (bias_grad_by_gemv's product, in a fixed order:
    one GEMV a block on NumPy, one batched over the padded blocks on a GPU)."""

    @staticmethod
    def forward(ctx, x, b, blocks):
        ctx.blocks, ctx.bias_shape = blocks, b.shape
        return x + b[blocks.block_of_rows()] if blocks.rows else x.copy()

    @staticmethod
    def backward(ctx, g):
        ctx.mark_fresh(1)
        blocks = ctx.blocks
        gb = get_array_module(g).zeros(ctx.bias_shape, g.dtype)
        if _batched(blocks, g):
            ones = constant_vector(g, blocks.width, g.dtype, 1).reshape(1, 1, -1)
            gemm.matmul(ones, blocks.pad(g), out=gb.reshape(blocks.groups, 1, -1))
            return g, gb
        for i, start, stop in blocks.spans():
            gemm.matmul(constant_vector(g, stop - start, g.dtype, 1).reshape(1, -1), g[start:stop], out=gb[i:i + 1])
        return g, gb


def grouped_matmul(x, w, blocks):
    return GroupedMatmul.apply(x, w, blocks=blocks)


def grouped_bias(x, b, blocks):
    return GroupedBias.apply(x, b, blocks=blocks)
