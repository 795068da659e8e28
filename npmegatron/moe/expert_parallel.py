"""Expert parallelism's token dispatch (Megatron-Core's MoEAlltoAllTokenDispatcher): the experts
are split over the EP group's ranks, E / EP whole experts each, and a rank's tokens travel to the
ranks that hold their experts and back.

For one layer: the rank's k T (token, slot) pairs are sorted by expert (dispatch.py); the counts
per expert are exchanged (one all-to-all of E host integers: each rank learns how many rows each
rank sends each of its local experts); the rows travel (all_to_all_v), arriving grouped by source
rank, then by local expert; they are regrouped by local expert, the local experts run on their
blocks, the rows are put back in arrival order and travel home (all_to_all_v again), where each is
weighted and added into its token's row. Backward is the same two exchanges in reverse
(_AllToAll.backward), so a layer makes two all-to-alls of rows forward and two backward, on every
rank in the same order, even a rank that receives no rows.

An expert's weight gradient on its rank is then the sum over the EP group's tokens; summed over
the expert-data-parallel ranks and divided by the data-parallel size it is the data-parallel
average every other weight gets (Megatron-Core's expert gradient scaling)."""
import numpy

from .. import autograd as ag
from .. import comm
from ..autograd import Function
from ..autograd.backend import get_array_module
from .dispatch import combine, sort_by_expert, sources


class _AllToAll(Function):
    """Rows to the group's ranks by `send` counts, `recv` counts arriving; backward sends the
    gradient's rows home the same way reversed."""
    reads_16_bit = True     # moves values, adds none
    reads_16_bit_grads = True

    @staticmethod
    def forward(ctx, x, group, send, recv):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return comm.all_to_all_v(x, group, send, recv)

    @staticmethod
    def backward(ctx, g):
        return comm.all_to_all_v(g, ctx.group, ctx.recv, ctx.send)


def exchange_counts(counts, group):
    """(per rank, rows this rank sends it; per rank and local expert, rows it receives): counts is
    this rank's rows per global expert, the experts split in order over the group's ranks."""
    per_rank = numpy.asarray(counts, numpy.int64).reshape(group.size, -1)
    received = comm.all_to_all(per_rank, group)          # row j: what rank j sends my experts
    return per_rank.sum(axis=1), received


def expert_major(received):
    """The order that regroups rows arrived source-major ((rank, local expert) blocks, ranks
    first) into local-expert-major blocks, each expert's rows by source rank."""
    offsets = numpy.concatenate(([0], numpy.cumsum(received.reshape(-1))[:-1])).reshape(received.shape)
    ranks, experts = received.shape
    blocks = [numpy.arange(offsets[j, e], offsets[j, e] + received[j, e])
              for e in range(experts) for j in range(ranks)]
    return numpy.concatenate(blocks) if blocks else numpy.zeros(0, numpy.int64)


def run_experts_parallel(x, weights, experts, run, num_experts, group, kept=None, pad_to=None):
    """run_experts (dispatch.py) with the experts split over `group`: run(rows, blocks) runs this
    rank's E / group.size experts, the rank's place in the group naming which (rank r holds
    r L ... ); kept: which choices the experts take (a capacity's), None: all; pad_to: the rows
    each expert runs on in a GPU's batched GEMMs (ag.RowBlocks)."""
    order, counts = sort_by_expert(experts, num_experts, kept)
    send, received = exchange_counts(counts, group)
    source = sources(x, order, experts.shape[1])
    arrived = _AllToAll.apply(x[source], group=group, send=send, recv=received.sum(axis=1))
    xp = get_array_module(source)
    regroup = expert_major(received)
    y = run(arrived[xp.asarray(regroup)], ag.RowBlocks(received.sum(axis=0), xp, pad_to))
    arrival_order = y[xp.asarray(numpy.argsort(regroup))]
    home = _AllToAll.apply(arrival_order, group=group, send=received.sum(axis=1), recv=send)
    return combine(home, weights, order, source, experts.shape[0])
