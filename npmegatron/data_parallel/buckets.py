"""Data parallelism: gradients averaged over the data-parallel group by bucketed all-reduces
that start while backward is still running (PyTorch DDP's and Megatron's design).

Every parameter's gradient lives in a flat bucket buffer (params in reverse order, since
backward reaches the last layers first). Backward accumulates straight into those views; in the
last backward of each parameter's virtual stage (the last micro-batch's, under 1F1B), a hook on
its AccumulateGrad node counts it done, and a bucket whose parameters are all done is
pre-divided by the DP size and handed to comm.all_reduce_async
(MPI, node shared memory or NCCL, as comm chooses for the array). Buckets are launched in a fixed
order so every rank issues the same sequence of collectives. Earlier micro-batches only
accumulate: one DP sync per optimizer step.

The buckets are slices of one flat gradient buffer, and the parameters views of one flat buffer
of the same layout (optim/flat.py, Megatron's ParamAndGradBuffer), so that on a GPU the optimizer
updates them all in one kernel. There, each parameter's view is also its `main_grad`: backward's
GEMMs, reductions and LayerNorm kernels write the gradient straight into it (engine.py), so
filling the buffer costs no kernel a parameter. At DP = 1 nothing is communicated (there are no
buckets); the GPU keeps the flat buffers all the same. On the CPU, DP = 1 keeps the gradients
backward makes (no buffers), and the optimizer updates parameter by parameter either way.
"""
import numpy

from .. import comm
from ..autograd import grad_accumulator, precision
from ..optim.flat import FlatLayout


class Bucket:
    def __init__(self, params, layout, span):
        """span: the bucket's slice of the layout (padded, under the distributed optimizer, to a
        multiple of the DP size, which its reduce-scatter splits evenly)."""
        self.params, self.span = params, span
        self.buffer = layout.grad[span]
        self.views = {id(p): layout.grad_views[id(p)] for p in params}
        self.remaining = len(params)
        self.request = None
        self.reducing = False       # launched and not yet waited on: no writes (BucketWrittenError)


def group_params(params, bucket_size, alone=()):
    """Parameters in reverse order, cut into buckets of at least bucket_size elements; each
    parameter in `alone` gets a bucket of its own."""
    groups, current, count = [], [], 0
    alone = {id(p) for p in alone}
    for p in reversed(params):
        if id(p) in alone:
            groups.append([p])
            continue
        current.append(p)
        count += p.data.size
        if count >= bucket_size:
            groups.append(current)
            current, count = [], 0
    return groups + ([current] if current else [])


class BucketWrittenError(RuntimeError):
    """A gradient reached a bucket that is being reduced: the all-reduce (on a GPU, on a stream
    of its own) may have read the bucket before the write, so ranks would average different
    numbers. Raised by the hook that sees it; a scheduling bug, never a user's."""


class GradientBuckets:
    #: The distributed optimizer's subclass sets it: gradients are reduce-scattered, so every
    #: bucket is padded to a multiple of the DP size, and buckets exist even at DP = 1.
    shards = False

    def __init__(self, params, group, bucket_size=2 ** 20, alone=(), storage=None, divisor=None):
        """bucket_size: parameters (elements) per bucket, Megatron's --ddp-bucket-size; storage:
        --fp16/--bf16's format, in which a GPU holds the parameters (FlatLayout.hold_parameters);
        divisor: what the sum over the group is divided by (default its size: the average)."""
        self.group, self.params = group, list(params)
        self.divisor = divisor or group.size
        self.active, self.final = False, set()
        groups = group_params(self.params, bucket_size, alone)
        self.layout = FlatLayout(groups, group.size if self.shards else 1)
        self.buckets = []
        communicates = group.size > 1 or self.shards
        if communicates or self.layout.xp is not numpy:     # flat buffers (module docstring)
            sixteen = precision.holds_16_bit_arrays(self.layout.xp, storage)
            self.layout.hold_parameters(precision.sixteen_bit_dtype(storage) if sixteen else None)
        if not communicates:
            return
        self.buckets = [Bucket(ps, self.layout, span) for ps, span in zip(groups, self.layout.spans)]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for p in self.params:
            grad_accumulator(p).hooks.append(self._on_grad_ready)

    def zero_grad(self):
        """Before the first micro-batch: each parameter's grad is its zeroed view of the flat
        gradient buffer (one fill for all), or None where there is none (backward makes it)."""
        self._refuse_writes("zero_grad")
        for p in self.params:
            p.grad = None
        if self.layout.grad is None:
            return
        if self.layout.xp is not numpy:     # backward writes gradients there itself (engine.py)
            for p in self.params:
                p.main_grad = self.layout.grad_views[id(p)]
        if self.buckets:
            self.layout.grad.fill(0)
            for p in self.params:
                p.grad = self.layout.grad_views[id(p)]

    def start_sync(self, params=None):
        """Call before the backward that gives `params` (default: all) their last gradient
        contribution of the step: their buckets are reduced as soon as they are complete. The
        interleaved schedule calls it before each virtual stage's last backward, so the buckets
        of the stages that finish early travel while the others compute."""
        if not self.active:
            self.active = bool(self.buckets)
            self.next_launch = 0
            self.final = set()
            for b in self.buckets:
                b.remaining, b.request = len(b.params), None
        self.final.update(map(id, self.params if params is None else params))

    def _refuse_writes(self, what, bucket=None):
        """Raise BucketWrittenError when a bucket being reduced was written (one flag per bucket,
        so it stays on: the tests of every schedule then prove no write comes late)."""
        for b in self.buckets if bucket is None else [bucket]:
            if b.reducing:
                raise BucketWrittenError(
                    f"{what} wrote gradient bucket {self.buckets.index(b)} ({len(b.params)} parameters) "
                    "while its all-reduce is in flight; a bucket may be launched only after the "
                    "last backward that writes any of its parameters")

    def _on_grad_ready(self, leaf):
        bucket = self.bucket_of[id(leaf)]
        self._refuse_writes("backward", bucket)
        if not self.active or id(leaf) not in self.final:
            return
        if leaf.grad is not bucket.views[id(leaf)]:     # replaced (e.g. grads set by hand)
            bucket.views[id(leaf)][...] = leaf.grad
            leaf.grad = bucket.views[id(leaf)]
        bucket.remaining -= 1
        self._launch_ready()
        for b in self.buckets[:self.next_launch]:
            b.request.test()        # MPI progresses only inside MPI calls: nudge it

    def _launch_ready(self, force=False):
        while self.next_launch < len(self.buckets):
            b = self.buckets[self.next_launch]
            if b.remaining and not force:
                return
            b.buffer *= b.buffer.dtype.type(1.0 / self.divisor)
            b.request = self._launch(b)
            b.reducing = True
            self.next_launch += 1

    def _launch(self, bucket):
        return comm.all_reduce_async(bucket.buffer, self.group)

    def _finish(self, bucket, result):
        if result is not bucket.buffer:            # GPU arrays staged through the host come back new
            bucket.buffer[...] = result

    def finish_sync(self, timers=None):
        """After the last backward: launch what is left (parameters that got no gradient
        contribute zeros) and wait; every parameter's grad is then the DP average. `timers`
        (npmegatron/timers.py) counts this wait, the all-reduce backward did not hide, as dp-comm."""
        if not self.active:
            return
        timer = timers("dp-comm") if timers is not None else None
        if timer is not None:
            timer.start()
        self._launch_ready(force=True)
        for b in self.buckets:
            result = b.request.wait()
            b.reducing = False
            self._finish(b, result)
        if timer is not None:
            timer.stop()
        for b in self.buckets:
            for p in b.params:
                p.grad = b.views[id(p)]
        self.active = False
