"""Tokens to their experts and back, on one rank (expert parallelism 1): Megatron-Core's
permute and unpermute. The k copies of the tokens are sorted by expert (a stable sort, so each
expert sees its tokens in order), each expert runs on its contiguous block, and each output row,
weighted by its router weight, is added back into its token's row.

The sort and the block sizes are computed on the host: the blocks' sizes are needed there to
lay out the grouped GEMMs (on a GPU that is the dispatcher's one synchronisation a layer,
Megatron's too)."""
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


def run_experts(x, weights, experts, run, num_experts, kept=None, pad_to=None):
    """sum over each token's k experts of weight x expert(token): x (tokens, hidden) Tensor,
    weights (tokens, k) Tensor, experts (tokens, k) int array; run(rows, blocks): the experts on
    their blocks of rows (GroupedExperts, with whatever the layer applies around them); kept:
    which choices the experts take (a capacity's), None: all; pad_to: the rows each expert runs
    on in a GPU's batched GEMMs (ag.RowBlocks)."""
    order, counts = sort_by_expert(experts, num_experts, kept)
    source = sources(x, order, experts.shape[1])
    y = run(x[source], ag.RowBlocks(counts, get_array_module(x.data), pad_to))
    return combine(y, weights, order, source, experts.shape[0])


def sources(x, order, k):
    """The token of each sorted (token, slot) pair, on x's device."""
    return get_array_module(x.data).asarray(order) // k


def combine(y, weights, order, source, tokens):
    """Each sorted pair's output row times its router weight, added into its token's row."""
    flat = ag.reshape(weights, (weights.shape[0] * weights.shape[1],))
    chosen = ag.reshape(flat[get_array_module(source).asarray(order)], (len(order), 1))
    return _AddRowsInto.apply(y * chosen, index=source, n=tokens)
