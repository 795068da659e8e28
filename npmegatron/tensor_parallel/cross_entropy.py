"""The fused vocabulary-parallel cross-entropy (Megatron's vocab_parallel_cross_entropy): each
rank holds a vocabulary shard of the logits; ranks exchange only the per-token maximum, sum of
exponentials and target logit (3 all-reduces of batch x seq numbers, whatever the vocabulary),
never the logits. Backward is softmax minus one-hot on the local shard, with no communication.
Padded vocabulary columns are excluded from the softmax, so every TP size is the same model."""
import numpy

from npmegatron import comm
from npmegatron.autograd import Function, InputError, Tensor
from npmegatron.autograd.backend import get_array_module
from npmegatron.autograd.ops.nn import check_ids


class _VocabParallelCrossEntropy(Function):
    float32_output = True       # the loss stays in float32 under --fp16/--bf16, as Megatron's
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, reduction):
        xp = get_array_module(logits)
        local_vocab = logits.shape[-1]
        flat = logits.reshape(-1, local_vocab)
        real = max(0, min(local_vocab, vocab_size - vocab_start))   # columns before the padding
        # Checked before the copy to the device: host targets cost no GPU synchronisation.
        check_ids(targets, vocab_size, "target id", "targets must be token ids of the model's vocabulary")
        t = xp.asarray(targets).reshape(-1)
        local_max = flat[:, :real].max(axis=-1) if real else xp.full(flat.shape[0], -xp.inf, flat.dtype)
        global_max = comm.all_reduce(local_max, group, "max")
        z = flat - global_max[:, None]
        if real < local_vocab:
            z[:, real:] = -xp.inf
        local_t = t - vocab_start
        mine = (local_t >= 0) & (local_t < real)
        local_t = xp.where(mine, local_t, 0)
        rows = xp.arange(t.size)
        target_z = comm.all_reduce(xp.where(mine, z[rows, local_t], 0), group)
        xp.exp(z, out=z)
        sum_exp = comm.all_reduce(z.sum(axis=-1), group)
        z /= sum_exp[:, None]                                        # local softmax shard
        losses = xp.log(sum_exp) - target_z
        ctx.save_for_backward(z, local_t, mine)
        ctx.shape, ctx.reduction = logits.shape, reduction
        if reduction == "none":
            return losses.reshape(targets.shape)
        return xp.asarray(losses.mean())

    @staticmethod
    def backward(ctx, g):
        probs, local_t, mine = ctx.saved
        xp = get_array_module(probs)
        # The saved softmax is ours alone and freed right after: reuse it as the gradient.
        probs[xp.arange(local_t.size), local_t] -= mine
        if ctx.reduction == "none":
            probs *= g.reshape(-1, 1)
        else:
            probs *= g / local_t.size
        return probs.reshape(ctx.shape), None


def vocab_parallel_cross_entropy(logits, targets, group, vocab_start=0, vocab_size=None,
                                 reduction="mean"):
    """Cross-entropy of vocabulary-sharded logits (..., local_vocab) against global target ids.

    vocab_start: the first vocabulary id of this rank's shard; vocab_size: the real vocabulary
    (columns at or past it are padding); reduction: 'mean' over tokens or 'none' per token."""
    if reduction not in ("mean", "none"):
        raise InputError(f"reduction {reduction!r} is not supported; use 'mean' or 'none'")
    if vocab_size is None:
        vocab_size = vocab_start + logits.shape[-1] * group.size
    targets = targets.data if isinstance(targets, Tensor) else targets
    targets = targets if hasattr(targets, "dtype") else numpy.asarray(targets)
    return _VocabParallelCrossEntropy.apply(logits, targets, group=group, vocab_start=vocab_start,
                                            vocab_size=vocab_size, reduction=reduction)
