"""Tokens to their experts and back, on one rank (expert parallelism 1): Megatron-Core's
permute and unpermute. The k copies of the tokens are sorted by expert (a stable sort, so each
expert sees its tokens in order), each expert runs on its contiguous block, and each output row,
weighted by its router weight, is added back into its token's row.

The sort and the block sizes are computed on the host: the blocks' sizes are needed there to
split the rows (on a GPU that is the dispatcher's one synchronisation a layer, Megatron's too)."""
import numpy

from .. import autograd as ag
from ..autograd import Function
from ..autograd.backend import get_array_module, scatter_add, to_numpy


class _AddRowsInto(Function):
    """out (n, h) = zeros, then out[index[i]] += rows[i]; backward gathers: g[index]."""

    @staticmethod
    def forward(ctx, rows, index, n):
        xp = get_array_module(rows)
        ctx.index = index
        out = xp.zeros((n,) + rows.shape[1:], rows.dtype)
        scatter_add(out, index, rows)
        return out

    @staticmethod
    def backward(ctx, g):
        return g[ctx.index]


def sort_by_expert(experts, num_experts, kept=None):
    """(order: the k T (token, slot) pairs, of those `kept` where given, sorted by expert, stably;
    each expert's count), on the host, from the router's (tokens, k) choice."""
    flat = to_numpy(experts).reshape(-1)
    if kept is None:
        return numpy.argsort(flat, kind="stable"), numpy.bincount(flat, minlength=num_experts)
    candidates = numpy.flatnonzero(kept.reshape(-1))
    order = candidates[numpy.argsort(flat[candidates], kind="stable")]
    return order, numpy.bincount(flat[candidates], minlength=num_experts)


def run_experts(x, weights, experts, mlps, kept=None, finish=None, pad_to=None):
    """sum over each token's k experts of weight x expert(token): x (tokens, hidden) Tensor,
    weights (tokens, k) Tensor, experts (tokens, k) int array, mlps one callable per expert;
    kept: which choices the experts take (a capacity's), None: all; finish: applied to the
    experts' output rows before they are weighted (the TP ranks' partial sums reduced); pad_to:
    the rows each expert runs on (run_blocks)."""
    order, counts = sort_by_expert(experts, len(mlps), kept)
    source = sources(x, order, experts.shape[1])
    y = run_blocks(x[source], counts, mlps, pad_to)
    return combine(finish(y) if finish else y, weights, order, source, experts.shape[0])


def sources(x, order, k):
    """The token of each sorted (token, slot) pair, on x's device."""
    return get_array_module(x.data).asarray(order) // k


def run_blocks(rows, sizes, mlps, pad_to=None):
    """Each mlp on its block of `rows` (consecutive blocks of these sizes), the outputs joined in
    order; an empty block is skipped (and all empty: the rows themselves, still on the tape).
    pad_to: each mlp runs on its block padded with zero rows to this many (every expert the same
    shape, --moe-pad-expert-input-to-capacity), the padding's outputs left out."""
    parts = ag.split(rows, [int(c) for c in numpy.cumsum(sizes)[:-1]], axis=0)
    if pad_to is not None:
        return _run_padded(rows, parts, sizes, mlps, pad_to)
    outputs = [mlp(part) for mlp, part, size in zip(mlps, parts, sizes) if size]
    return rows if not outputs else outputs[0] if len(outputs) == 1 else ag.concatenate(outputs, axis=0)


def _run_padded(rows, parts, sizes, mlps, pad_to):
    xp = get_array_module(rows.data)
    outputs = []
    for mlp, part, size in zip(mlps, parts, sizes):
        padding = ag.Tensor(xp.zeros((pad_to - int(size),) + rows.shape[1:], rows.dtype))
        outputs.append(mlp(ag.concatenate([part, padding], axis=0))[:int(size)])
    return ag.concatenate(outputs, axis=0)


def combine(y, weights, order, source, tokens):
    """Each sorted pair's output row times its router weight, added into its token's row."""
    flat = ag.reshape(weights, (weights.shape[0] * weights.shape[1],))
    chosen = ag.reshape(flat[get_array_module(source).asarray(order)], (len(order), 1))
    return _AddRowsInto.apply(y * chosen, index=source, n=tokens)
