"""Data parallelism: gradients averaged over the data-parallel group by bucketed all-reduces
that start while backward is still running (PyTorch DDP's and Megatron's design).

Every parameter's gradient lives in a flat bucket buffer (params in reverse order, since
backward reaches the last layers first). Backward accumulates straight into those views; on the
last micro-batch, a hook on each parameter's AccumulateGrad node counts it done, and a bucket
whose parameters are all done is pre-divided by the DP size and handed to a non-blocking MPI
all-reduce. Buckets are launched in a fixed order so every rank issues the same sequence of
collectives. Earlier micro-batches only accumulate: one DP sync per optimizer step.
"""
from .. import comm
from ..autograd import grad_accumulator


class Bucket:
    def __init__(self, params, xp, dtype):
        self.params = params
        self.buffer = xp.zeros(sum(p.data.size for p in params), dtype)
        self.views, offset = {}, 0
        for p in params:
            self.views[id(p)] = self.buffer[offset:offset + p.data.size].reshape(p.shape)
            offset += p.data.size
        self.remaining = len(params)
        self.request = None


class GradientBuckets:
    def __init__(self, params, group, bucket_size=2 ** 20):
        """bucket_size: parameters (elements) per bucket, Megatron's --ddp-bucket-size."""
        self.group, self.params = group, list(params)
        self.active = False
        self.buckets = []
        if group.size == 1:
            return
        current, count = [], 0
        for p in reversed(self.params):
            current.append(p)
            count += p.data.size
            if count >= bucket_size:
                self.buckets.append(current)
                current, count = [], 0
        if current:
            self.buckets.append(current)
        first = self.params[0]
        self.buckets = [Bucket(ps, first.xp, first.dtype) for ps in self.buckets]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for p in self.params:
            grad_accumulator(p).hooks.append(self._on_grad_ready)

    def zero_grad(self):
        """Before the first micro-batch: each parameter's grad is its zeroed bucket view."""
        for p in self.params:
            p.grad = None
        for b in self.buckets:
            b.buffer.fill(0)
            for p in b.params:
                p.grad = b.views[id(p)]

    def start_sync(self):
        """Call before the backward of the last micro-batch: its finished gradients are reduced."""
        self.active = bool(self.buckets)
        self.next_launch = 0
        for b in self.buckets:
            b.remaining, b.request = len(b.params), None

    def _on_grad_ready(self, leaf):
        if not self.active:
            return
        bucket = self.bucket_of[id(leaf)]
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
            b.buffer *= b.buffer.dtype.type(1.0 / self.group.size)
            b.request = comm.all_reduce_async(b.buffer, self.group)
            self.next_launch += 1

    def finish_sync(self, timers=None):
        """After the last backward: launch what is left (parameters that got no gradient
        contribute zeros) and wait; every parameter's grad is then the DP average. `timers`
        (training/timers.py) counts this wait, the all-reduce backward did not hide, as dp-comm."""
        if not self.active:
            return
        timer = timers("dp-comm") if timers is not None else None
        if timer is not None:
            timer.start()
        self._launch_ready(force=True)
        for b in self.buckets:
            result = b.request.wait()
            if result is not b.buffer:            # GPU arrays staged through the host come back new
                b.buffer[...] = result
        if timer is not None:
            timer.stop()
        for b in self.buckets:
            for p in b.params:
                p.grad = b.views[id(p)]
        self.active = False
