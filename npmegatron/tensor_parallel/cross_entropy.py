"""The fused vocabulary-parallel cross-entropy (Megatron's vocab_parallel_cross_entropy): each
rank holds a vocabulary shard of the logits; ranks exchange only the per-token maximum, sum of
exponentials and target logit (3 all-reduces of batch x seq numbers, whatever the vocabulary),
never the logits. Backward is softmax minus one-hot on the local shard, with no communication.
Padded vocabulary columns are excluded from the softmax, so every TP size is the same model."""
import numpy

from npmegatron import comm
from npmegatron.autograd import Function, InputError, Tensor
from npmegatron.autograd import precision as ag_precision
from npmegatron.autograd.backend import get_array_module
from npmegatron.autograd.fusion import fused, fused_reduction
from npmegatron.autograd.ops.nn import check_ids

from . import _cross_entropy_gpu


@fused_reduction
def exp_sum(xp, logits, shift):
    """sum(exp(logits - shift)) per row, in one kernel: the logits are read, never copied."""
    return xp.sum(xp.exp(logits - shift), axis=-1)


@fused
def cross_entropy_grad_(xp, logits, shift, sum_exp, target, columns, scale, out):
    """out = scale * (softmax(logits) - one-hot(target)), the softmax recomputed from the logits
    instead of kept (so forward copies no logits) and the one-hot made in the kernel by comparing
    each column index with the row's target column (-1 where another rank holds the target)."""
    xp.subtract(logits, shift, out=out)
    xp.exp(out, out=out)
    out /= sum_exp
    out -= target == columns
    out *= scale


class _VocabParallelCrossEntropy(Function):
    """On a GPU the logits (batch x seq x vocabulary, the largest activation) are never copied:
    forward reads them once, in one kernel (each row's maximum, sum of exponentials and target
    logit), and backward recomputes the softmax from them in another, which writes the gradient
    (they stay alive as the head's output anyway). Under --fp16/--bf16 both read the 16-bit logits
    as they are and the gradient is written in 16 bits (_cross_entropy_gpu.py). On the CPU the exponentials are made in one
    copy and kept, and backward turns them into the gradient in place (one exp pass instead of
    two): for large logits by threads in one read of them (_cross_entropy_cpu.py), at once for
    small ones."""
    float32_output = True       # the loss stays in float32 under --fp16/--bf16, as Megatron's
    reads_16_bit = True         # a GPU's kernels read 16-bit logits (_cross_entropy_gpu.py)

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, reduction):
        xp = get_array_module(logits)
        local_vocab = logits.shape[-1]
        flat = logits.reshape(-1, local_vocab)
        real = max(0, min(local_vocab, vocab_size - vocab_start))   # columns before the padding
        # Checked before the copy to the device: host targets cost no GPU synchronisation.
        check_ids(targets, vocab_size, "target id", "targets must be token ids of the model's vocabulary")
        local_t, mine = _local_targets(xp, xp.asarray(targets).reshape(-1), vocab_start, real, group)
        ctx.compiled = _compiled(flat, real)
        ctx.kernels = xp is not numpy and real > 0 and _cross_entropy_gpu.takes(flat)
        if not ctx.kernels and ag_precision.format_of(flat.dtype):
            flat = ag_precision.to_float32(flat)      # 16-bit logits the kernels do not take: widened
        if ctx.compiled:        # the exponentials made with the shard's own maxima (see below)
            from . import _cross_entropy_cpu
            local_max, kept, sums = _cross_entropy_cpu.shifted_exponentials(flat, real)
        elif ctx.kernels:       # one read of the logits (float32 or 16-bit): the same statistics
            local_max, sums, target_logit = _cross_entropy_gpu.row_statistics(flat, real, local_t.astype(numpy.int64, copy=False))
        else:
            local_max = flat[:, :real].max(axis=-1) if real else xp.full(flat.shape[0], -xp.inf, flat.dtype)
        global_max = comm.all_reduce(local_max, group, "max")[:, None]
        target_z = (target_logit[:, None] if ctx.kernels else xp.take_along_axis(flat, local_t[:, None], axis=1)) \
            - global_max
        if mine is not None:
            target_z = xp.where(mine[:, None], target_z, 0)
        target_z = comm.all_reduce(target_z, group)
        if ctx.kernels:         # the shard's sums rescaled to the global maximum, as below
            sum_exp = sums[:, None] if group.size == 1 else \
                comm.all_reduce(sums[:, None] * xp.exp(local_max[:, None] - global_max), group)
            kept = flat
        elif ctx.compiled:
            # exp(z - local max) = exp(z - global max) / rescale: the shard's sums are rescaled
            # before they are added, and backward multiplies the kept exponentials by
            # rescale / sum_exp (which cannot overflow: rescale <= 1 <= sum_exp). So the logits
            # are read once, not once for the maximum and again after its all-reduce (they are
            # the largest activation: 206 MB at GPT-2 124M's shape). A shard whose row is all
            # -inf kept zeros (shifted by 0), and its rescale is exp(-inf) = 0.
            rescale = xp.exp(local_max[:, None] - global_max)
            sum_exp = comm.all_reduce(sums[:, None] * rescale, group)
            normaliser = rescale / sum_exp
        elif xp is numpy:
            kept = flat[:, :real] - global_max
            xp.exp(kept, out=kept)
            sum_exp = comm.all_reduce(kept.sum(axis=-1, keepdims=True), group)
            kept /= sum_exp                                          # the local softmax shard
        else:
            kept = flat
            sum_exp = comm.all_reduce(exp_sum(flat[:, :real], global_max)[:, None], group)
        losses = (xp.log(sum_exp) - target_z)[:, 0]
        ctx.save_for_backward(kept, global_max, normaliser if ctx.compiled else sum_exp, local_t, mine)
        if xp is not numpy:
            ctx.on_grid(0)      # the logits (the CPU keeps the softmax): in 16 bits under --fp16/--bf16
        ctx.shape, ctx.reduction, ctx.real = logits.shape, reduction, real
        if reduction == "none":
            return losses.reshape(targets.shape)
        return xp.asarray(losses.mean())

    @staticmethod
    def backward(ctx, g):
        # per_row: the sum of exponentials; on the compiled path rescale / sum_exp (forward)
        kept, global_max, per_row, local_t, mine = ctx.saved
        xp, real, width = get_array_module(kept), ctx.real, ctx.shape[-1]
        scale = g.reshape(-1, 1) if ctx.reduction == "none" else g / local_t.size
        if ctx.kernels:        # one kernel: the logits read once, the gradient written in their dtype
            target = local_t if mine is None else xp.where(mine, local_t, -1)
            scale = xp.ascontiguousarray(xp.asarray(scale, numpy.float32).reshape(-1))
            grad = _cross_entropy_gpu.softmax_minus_one_hot(kept, global_max.reshape(-1), per_row.reshape(-1),
                                                            target.astype(numpy.int64, copy=False), scale, real,
                                                            kept.dtype)
        elif ctx.compiled:     # the kept exponentials become the gradient in one pass
            from . import _cross_entropy_cpu
            rows = numpy.ascontiguousarray(numpy.broadcast_to(scale, (local_t.size, 1))[:, 0], kept.dtype)
            owned = numpy.ones(local_t.size, bool) if mine is None else mine
            _cross_entropy_cpu.softmax_minus_one_hot_(kept, per_row[:, 0], local_t, owned, rows)
            grad = kept if real == width else xp.zeros((local_t.size, width), kept.dtype)
            if grad is not kept:
                grad[:, :real] = kept
        elif xp is numpy:      # the kept softmax is ours alone and freed right after: reuse it
            grad = kept if real == width else xp.zeros((local_t.size, width), kept.dtype)
            if grad is not kept:
                grad[:, :real] = kept
            grad[xp.arange(local_t.size), local_t] -= 1 if mine is None else mine
            grad *= scale
        else:
            grad = xp.empty((local_t.size, width), kept.dtype)
            if real < width:
                grad[:, real:] = 0                     # padded vocabulary columns
            target = local_t if mine is None else xp.where(mine, local_t, -1)
            cross_entropy_grad_(kept[:, :real], global_max, per_row, target[:, None],
                                xp.arange(real)[None, :], scale, grad[:, :real])
        return grad.reshape(ctx.shape), None


#: Logits with at least this many elements take the threaded CPU passes (_cross_entropy_cpu.py);
#: below that, handing blocks to threads costs more than it saves.
COMPILED_CROSS_ENTROPY_SIZE = 1 << 18


def _compiled(flat, real):
    """Whether the loss's passes over these logits run in threads (_cross_entropy_cpu.py: a numba
    kernel for float32, NumPy on blocks of rows for float64): large C-ordered host logits with a
    real column."""
    return (get_array_module(flat) is numpy and flat.size >= COMPILED_CROSS_ENTROPY_SIZE and real > 0
            and flat.flags.c_contiguous and flat.dtype in (numpy.float32, numpy.float64))


def _local_targets(xp, t, vocab_start, real, group):
    """(target column in this rank's shard, which rows' targets it holds, or None for all)."""
    if group.size == 1 and vocab_start == 0:
        return t, None         # one shard holds every target (ids are checked below the vocabulary)
    local_t = t - vocab_start
    mine = (local_t >= 0) & (local_t < real)
    return xp.where(mine, local_t, 0), mine


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
