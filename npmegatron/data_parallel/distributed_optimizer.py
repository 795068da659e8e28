"""The distributed optimizer (ZeRO stage 1, Rajbhandari et al. 2020; Megatron's
--use-distributed-optimizer): each data-parallel rank keeps AdamW's moments for 1/DP of the
parameters only.

- Gradient buckets (buckets.py) are reduce-scattered instead of all-reduced, as backward finishes
  them: DP rank r receives the average of block r of each bucket, half an all-reduce's traffic.
  Its block is written back into the bucket, so `param.grad` holds the averaged gradient on this
  rank's block of the parameter (the rest is this rank's own, unreduced gradient).
- The gradient finalisation over TP (sequence-parallel partial gradients) and over the pipeline
  ends (the tied word embedding) works unchanged on those blocks: TP ranks of a stage have the same
  buckets, and the word embedding has a bucket of its own, so its blocks match on both ends.
- Each rank updates its block of every bucket (AdamW's arithmetic, element by element the same as
  AdamW's), then the blocks are all-gathered into the parameters, which live in one flat buffer
  per bucket for this.

State saved in a checkpoint is gathered whole per parameter (state_dict, collective over DP), so
a checkpoint loads at any DP size, with or without this optimizer.
"""
import numpy

from .. import comm
from ..optim.adamw import AdamW, gradient_factor, publish_rounded, sum_of_squares
from .buckets import GradientBuckets


class ShardedGradientBuckets(GradientBuckets):
    """GradientBuckets whose buckets are reduce-scattered, with the parameters moved into flat
    buffers of the buckets' layout. `alone`: parameters that get a bucket of their own (the tied
    word embedding: its blocks must match between the first and the last pipeline stage)."""

    shards = True

    def __init__(self, params, group, bucket_size=2 ** 20, alone=()):
        super().__init__(params, group, bucket_size, alone)
        size, rank = group.size, group.rank
        for b in self.buckets:
            block = b.buffer.size // size
            b.block = slice(rank * block, (rank + 1) * block)
            b.param_buffer = b.buffer.copy()
            offset = 0
            for p in b.params:
                view = b.param_buffer[offset:offset + p.data.size].reshape(p.shape)
                view[...] = p.data
                p.data = view
                offset += p.data.size

    def _launch(self, bucket):
        return comm.reduce_scatter_async(bucket.buffer, self.group)

    def _finish(self, bucket, result):
        bucket.buffer[bucket.block] = result

    def segments(self):
        """(param, its flat slice inside this rank's block, the block's slice in the optimizer's
        flat state) for every parameter that overlaps this rank's blocks, in bucket order."""
        out, state_offset = [], 0
        for b in self.buckets:
            start, stop, offset = b.block.start, b.block.stop, 0
            for p in b.params:
                lo, hi = max(start, offset), min(stop, offset + p.data.size)
                if lo < hi:
                    out.append((p, slice(lo - offset, hi - offset),
                                slice(state_offset + lo - start, state_offset + hi - start)))
                offset += p.data.size
            state_offset += stop - start
        return out, state_offset

    def gather_parameters(self):
        """Every rank's updated block of each bucket into every rank's parameters."""
        for b in self.buckets:
            whole = comm.all_gather(b.param_buffer[b.block], self.group)
            if whole is not b.param_buffer:
                b.param_buffer[...] = whole


class DistributedAdamW(AdamW):
    """AdamW over this DP rank's blocks of a ShardedGradientBuckets: moments of 1/DP of the
    parameters; step() updates the blocks and all-gathers the parameters."""

    def __init__(self, buckets, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, storage=None):
        self.params, self.buckets = buckets.params, buckets
        self._settings(lr, betas, eps, weight_decay, storage)
        self.segments, size = buckets.segments()
        first = self.params[0]
        self.exp_avg = [first.xp.zeros(size, first.dtype)]
        self.exp_avg_sq = [first.xp.zeros(size, first.dtype)]
        self.master = None
        if storage:     # float32 master weights of this rank's blocks only (ZeRO-1 shards them too)
            self.master = [first.xp.zeros(size, first.dtype)]
            self._master_from_parameters()

    def _master_from_parameters(self):
        for p, mine, where in self.segments:
            self.master[0][where] = self._flat(p.data, mine)

    def _flat(self, array, where):
        return array.reshape(-1)[where]

    def step(self, lr=None):
        lr = self._advance(lr)
        m, v = self.exp_avg[0], self.exp_avg_sq[0]
        for p, mine, state in self.segments:
            if p.grad is None:
                continue
            data, grad = self._flat(p.data, mine), self._flat(p.grad, mine)
            if self.master is None:
                self._update(p, data, grad, m[state], v[state], lr)
            else:
                master = self.master[0][state]
                self._update(p, master, grad, m[state], v[state], lr)
                publish_rounded(data, master, self.storage)
        self.buckets.gather_parameters()

    def grad_norm_squared(self, grid, skip=()):
        """The squared global gradient norm from this rank's blocks: summed over the DP group,
        then over the model-parallel group (as optim.adamw.grad_norm_squared)."""
        xp = self.params[0].xp
        parts = [sum_of_squares(xp, self._flat(p.grad, mine)) for p, mine, _ in self.segments
                 if p.grad is not None and id(p) not in skip]
        total = (xp.stack(parts).astype(numpy.float64).sum() if parts else xp.zeros((), numpy.float64)).reshape(1)
        for group in (grid.dp_group, grid.mp_group):
            if group.size > 1:
                total = comm.all_reduce(total, group)
        return total

    def clip(self, norm, max_norm, loss_scale=1.0):
        """Unscale this rank's blocks of the gradients and clip them to max_norm (norm: unscaled)."""
        factor = gradient_factor(norm, max_norm, loss_scale)
        if factor is not None:
            for p, mine, _ in self.segments:
                if p.grad is not None:
                    self._flat(p.grad, mine)[...] *= p.dtype.type(factor)

    def state_dict(self):
        """Collective over DP: the moments gathered whole, one array per parameter in the order of
        `params` (AdamW's layout), so checkpoints do not depend on the DP size."""
        kinds = ("exp_avg", "exp_avg_sq") + (("master",) if self.master is not None else ())
        state = {"hyperparameters": self.hyperparameters()}
        for kind in kinds:
            whole, offset = {}, 0
            flat = getattr(self, kind)[0]
            for b in self.buckets.buckets:
                block = b.block.stop - b.block.start
                gathered = comm.all_gather(flat[offset:offset + block], self.buckets.group)
                start = 0
                for p in b.params:
                    whole[id(p)] = gathered[start:start + p.data.size].reshape(p.shape)
                    start += p.data.size
                offset += block
            state[kind] = [whole[id(p)] for p in self.params]
        return state

    def load_state_dict(self, state):
        """Whole per-parameter moments (any DP size's checkpoint): this rank's blocks kept."""
        self.step_count = state["hyperparameters"]["step"]
        index = {id(p): i for i, p in enumerate(self.params)}
        for kind in ("exp_avg", "exp_avg_sq"):
            flat = getattr(self, kind)[0]
            for p, mine, where in self.segments:
                saved = p.xp.asarray(state[kind][index[id(p)]])
                flat[where] = saved.reshape(-1)[mine]
        if self.master is not None:
            self._masters_from_loaded_weights()
