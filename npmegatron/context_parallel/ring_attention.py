"""Ring attention (Liu et al., 2023; Megatron-LM's context parallelism, cp_comm_type "p2p"): each
rank keeps its queries, and the key/value block of every rank of the CP group travels once round
the ring, the next block in flight while this one is used. Each block's part of the softmax is
folded in with running row maxima and sums (online softmax), so the result is causal attention
over the whole sequence, and the log-sum-exp per query is kept for backward. Backward sends the
blocks round again, each carrying the gradient of its keys and values as the ranks add to it; one
last step brings every block's gradient home.

Grouped-query attention costs nothing extra here: blocks travel with their key/value heads only,
and each group's query heads meet their one key/value head by broadcasting.

Every rank posts the same sequence of sends to its next rank and receives from its previous one,
so the messages of each pair match in posting order, as NCCL (which has no tags) requires.
"""
import functools

from .. import comm
from ..autograd import Function, InputError
from ..autograd.backend import get_array_module
from .split import local_positions


class RingAttention(Function):
    """q (b, heads, t, d) and k, v (b, groups, t, d) of this rank's tokens -> attention output
    (b, heads, t, d); the tokens are the balanced causal split's (split.py)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, group, seq_length):
        xp = get_array_module(q)
        q5 = _grouped(q, k.shape[1])
        ctx.visible = _visibility(xp, group, seq_length)
        row_max = row_sum = total = None
        own = xp.stack([k, v])              # one message per step: k and v, kept for backward too
        blocks = _Ring(own, group)
        for keys, values, mask in blocks.each(ctx.visible):
            scores = _scores(xp, q5, keys, scale, mask)
            block_max = scores.max(axis=-1, keepdims=True)
            new_max = block_max if row_max is None else xp.maximum(row_max, block_max)
            probabilities = xp.exp(scores - new_max)     # a row's own block holds its diagonal: finite
            part = xp.matmul(probabilities, values[:, :, None])
            if row_max is None:
                row_sum, total = probabilities.sum(axis=-1, keepdims=True), part
            else:
                correction = xp.exp(row_max - new_max)
                row_sum = row_sum * correction + probabilities.sum(axis=-1, keepdims=True)
                total = total * correction + part
            row_max = new_max
        out = total / row_sum
        ctx.scale, ctx.group = scale, group
        ctx.save_for_backward(q5, own, out, row_max + xp.log(row_sum))
        return out.reshape(q.shape)

    @staticmethod
    def backward(ctx, g):
        q5, own, out, lse = ctx.saved
        xp = get_array_module(g)
        g5 = g.reshape(q5.shape)
        row_dot = (g5 * out).sum(axis=-1, keepdims=True)        # <dO, O> = <dP, P> per query
        dq = xp.zeros_like(q5)
        blocks = _Ring(own, ctx.group, carried=xp.zeros_like(own))
        for keys, values, mask in blocks.each(ctx.visible):
            probabilities = xp.exp(_scores(xp, q5, keys, ctx.scale, mask) - lse)      # masked: 0
            d_values = xp.matmul(probabilities.swapaxes(-1, -2), g5).sum(axis=2)
            d_scores = xp.matmul(g5, values[:, :, None].swapaxes(-1, -2))
            d_scores -= row_dot
            d_scores *= probabilities
            dq += xp.matmul(d_scores, keys[:, :, None]) * ctx.scale
            d_keys = xp.matmul(d_scores.swapaxes(-1, -2), q5).sum(axis=2) * ctx.scale
            blocks.carried[0] += d_keys
            blocks.carried[1] += d_values
        d_kv = blocks.bring_home()
        return dq.reshape(g.shape), d_kv[0], d_kv[1]


class _Ring:
    """The key/value blocks as they pass round the CP group: `each` yields this rank's block, then
    each earlier rank's, posting the next exchange before the block is used. `carried` (backward:
    the block's key/value gradient) travels with its block, one step behind it."""

    def __init__(self, block, group, carried=None):
        self.block, self.group, self.carried = block, group, carried
        self.next, self.prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size

    def each(self, visible):
        size = self.group.size
        for step in range(size):
            incoming = self._post(self.block) if step < size - 1 else None
            yield self.block[0], self.block[1], visible[(self.group.rank - step) % size]
            if self.carried is not None:
                self.carried = self._finish(self._post(self.carried))
            if incoming is not None:
                self.block = self._finish(incoming)

    def bring_home(self):
        """The carried gradient of this rank's own block: after the last step it is one rank ahead
        of the block and its owner, and every step already sent it on, so it is here."""
        return self.carried

    def _post(self, array):
        if self.group.size == 1:
            return [None, array]
        ops = [comm.P2POp("send", self.next, array=array),
               comm.P2POp("recv", self.prev, shape=array.shape, dtype=array.dtype, xp=get_array_module(array))]
        return comm.batch_isend_irecv(ops, self.group)

    @staticmethod
    def _finish(requests):
        send, receive = requests
        if send is None:
            return receive
        send.wait()
        return receive.wait()


def _grouped(q, groups):
    """(b, heads, t, d) -> (b, groups, heads per group, t, d): a group's query heads together."""
    b, heads, t, d = q.shape
    return q.reshape(b, groups, heads // groups, t, d)


def _visibility(xp, group, seq_length):
    """[rank r's mask]: which of rank r's key positions each of this rank's queries may see."""
    return _masks(xp, seq_length, group.rank, group.size)


@functools.lru_cache(maxsize=8)
def _masks(xp, seq_length, rank, size):
    """The masks of one (sequence length, CP rank, CP size), made once on the host and copied to
    the device once: every layer and micro-batch shares them (C masks of (seq/C)^2 bytes)."""
    mine = local_positions(seq_length, rank, size)
    return tuple(xp.asarray(mine[:, None] >= local_positions(seq_length, r, size)[None, :]) for r in range(size))


def _scores(xp, q5, keys, scale, mask):
    """scale q k^T of one block (b, groups, per group, t, t_block), -inf where causality hides it."""
    scores = xp.matmul(q5, keys[:, :, None].swapaxes(-1, -2))
    scores *= scale
    return xp.where(mask, scores, -xp.inf)


def ring_attention(q, k, v, scale, group, seq_length):
    """Causal attention of this CP rank's queries q (b, heads, t, d) over the whole sequence of
    `seq_length` tokens, whose keys and values k, v (b, groups, t, d) are split over `group` as
    split.local_positions says; groups divides heads (grouped-query attention)."""
    if q.ndim != 4 or k.shape != v.shape or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise InputError(f"ring attention needs q (b, heads, t, d) and k, v (b, groups, t, d) with groups "
                         f"dividing heads, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] * group.size != seq_length:
        raise InputError(f"{q.shape[2]} local tokens on each of {group.size} context-parallel ranks do not "
                         f"make a sequence of {seq_length}")
    return RingAttention.apply(q, k, v, scale=scale, group=group, seq_length=seq_length)
