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
  AdamW's: one kernel a bucket), then the blocks are all-gathered into the parameters, which are
  views of the buckets' flat parameter buffer (buckets.py).

State saved in a checkpoint is gathered whole per parameter (state_dict, collective over DP), so
a checkpoint loads at any DP size, with or without this optimizer.
"""
import numpy

from .. import comm
from ..optim.adamw import AdamW
from .buckets import GradientBuckets


class ShardedGradientBuckets(GradientBuckets):
    """GradientBuckets whose buckets are reduce-scattered, each bucket's `block` (a slice of the
    bucket) this rank's. `alone`: parameters that get a bucket of their own (the tied word
    embedding: its blocks must match between the first and the last pipeline stage)."""

    shards = True

    def __init__(self, params, group, bucket_size=2 ** 20, alone=(), storage=None, divisor=None):
        super().__init__(params, group, bucket_size, alone, storage, divisor)
        size, rank = group.size, group.rank
        for b in self.buckets:
            block = b.buffer.size // size
            b.block = slice(rank * block, (rank + 1) * block)

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

    def blocks(self):
        """(this rank's block of each bucket as a slice of the layout, the same block's slice of
        an array of all blocks end to end: the distributed optimizer's state)."""
        out, state_offset = [], 0
        for b in self.buckets:
            start = b.span.start + b.block.start
            size = b.block.stop - b.block.start
            out.append((slice(start, start + size), slice(state_offset, state_offset + size)))
            state_offset += size
        return out

    def gather_parameters(self):
        """Every rank's updated block of each bucket into every rank's parameters. A GPU's 16-bit
        parameters (--fp16/--bf16) travel as float16 whatever their format: the same bytes copied,
        in a dtype that NCCL and MPI both take (mpi4py refuses bfloat16 device buffers, and NCCL
        has no 16-bit integer type)."""
        for b in self.buckets:
            data = self.layout.data[b.span]
            bits = data.view(numpy.float16) if data.dtype.itemsize == 2 else data
            whole = comm.all_gather(bits[b.block], self.group)
            if whole is not bits:
                bits[...] = whole


class DistributedAdamW(AdamW):
    """AdamW over this DP rank's blocks of a ShardedGradientBuckets: moments of 1/DP of the
    parameters; step() updates the blocks and all-gathers the parameters."""

    def __init__(self, buckets, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, storage=None):
        self.params, self.buckets, self.layout = buckets.params, buckets, buckets.layout
        self._settings(lr, betas, eps, weight_decay, storage)
        self.segments, size = buckets.segments()
        self.regions = buckets.blocks()     # one update kernel and one norm reduction a bucket
        self.regions_are_parameters = False
        self._make_state(size)
        self.exp_avg, self.exp_avg_sq = [self._m], [self._v]
        if storage:     # float32 master weights of this rank's blocks only (ZeRO-1 shards them too)
            self.master = [self._master]
            self._master_from_parameters()

    def _master_from_parameters(self):
        for where, state in self.regions:
            self._master[state] = self.layout.data[where]

    def step(self, lr=None):
        super().step(lr)
        self.buckets.gather_parameters()

    def step_on_device(self, grad_scale):
        super().step_on_device(grad_scale)
        self.buckets.gather_parameters()

    def norm_groups(self, grid):
        """This rank's blocks: the rest of each bucket is on the other DP (and CP) ranks."""
        return [grid.dp_cp_group, grid.mp_group]

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
            self._masters_from_loaded_weights(state.get("weights"))
