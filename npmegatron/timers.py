"""Megatron-style named timers: `timers("forward-compute").start()` ... `.stop()`, elapsed sums
per name, reset. Passed explicitly (train_step, run_schedule, GradientBuckets.finish_sync, the
trainer); never global. `NO_TIMERS` (the default everywhere) is a no-op object, so the normal
training path pays one attribute lookup and an empty call per phase.

Phases of one training step (the names below), each a share of the step's wall time:
  forward-compute, backward-compute   the model's forward / backward on this rank, LESS the time
                                      spent inside tensor-parallel collectives during them
  tp-comm                             seconds inside TP/SP collectives (comm.stats() of the TP
                                      group, measured within the compute timers and moved here)
  dp-comm                             DP gradient all-reduce not hidden by backward: the wait
                                      in GradientBuckets.finish_sync after the last backward
  pipeline-wait                       time in the pipeline exchange: blocked in receives,
                                      posting sends/receives, and the final wait for sends
  finalize-grads                      sequence parallelism's sums of replicated-parameter
                                      gradients over TP, the tied embedding's over the pipeline ends
  optimizer                           loss and gradient-norm reductions, clip, AdamW step
Timers that name `exclude_comm=True` move the TP-group communication they contain to tp-comm.

On a GPU an enabled timer records CUDA events on the compute stream and reads them when
elapsed() is called, and the communication seconds are those of events around each NCCL call
(comm.stats): no timer synchronises the device, which would wait for NCCL calls still waiting for
their peers (the DP all-reduce of a rank that reaches it first). On NumPy they read the host's
clock. Disabled timers measure nothing.
"""
import time

import numpy

from . import comm
from .autograd import Function, Tensor

FORWARD, BACKWARD, TP_COMM, DP_COMM, PIPELINE_WAIT, FINALIZE_GRADS, OPTIMIZER = (
    "forward-compute", "backward-compute", "tp-comm", "dp-comm", "pipeline-wait", "finalize-grads",
    "optimizer")
PHASES = (FORWARD, BACKWARD, TP_COMM, DP_COMM, PIPELINE_WAIT, FINALIZE_GRADS, OPTIMIZER)


class _NullTimer:
    def start(self):
        pass

    def stop(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class NullTimers:
    """Timers switched off: every call is a no-op, elapsed() is empty."""

    enabled = False
    _timer = _NullTimer()

    def __call__(self, name, exclude_comm=False):
        return self._timer

    def elapsed(self, reset=False):
        return {}

    def reset(self):
        pass


NO_TIMERS = NullTimers()


class Timer:
    """One named timer; start/stop pairs add up in `elapsed` (read through Timers.elapsed on a
    GPU, where the intervals are events until then). Also a context manager."""

    def __init__(self, name, owner, exclude_comm=False):
        self.name, self.owner, self.exclude_comm = name, owner, exclude_comm
        self.elapsed, self.count = 0.0, 0
        self._start = None
        self.intervals = []     # (start, stop, comm mark at start, at stop): measured, not yet read

    def _mark(self):
        return self.owner.comm.mark() if self.exclude_comm else None

    def start(self):
        if self._start is not None:
            raise RuntimeError(f"timer {self.name!r} started twice")
        self._start = (self.owner.now(), self._mark())

    def stop(self):
        if self._start is None:
            raise RuntimeError(f"timer {self.name!r} stopped but not started")
        (start, comm_start), self._start = self._start, None
        self.intervals.append((start, self.owner.now(), comm_start, self._mark()))
        self.count += 1
        if not self.owner.on_gpu:       # the host's clock: nothing to wait for, read it now
            self.owner.read()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


class Timers:
    """Named timers. `xp`: the array module (CuPy: events on the compute stream, read by elapsed()).
    `comm_groups`: names of the groups whose collective seconds (comm.stats()) count as TP/SP
    communication inside timers made with exclude_comm=True (default: the "tp" group)."""

    enabled = True

    def __init__(self, xp=numpy, comm_groups=("tp",)):
        self.xp, self.comm_groups = xp, tuple(comm_groups)
        self.on_gpu = xp is not numpy
        self.comm = comm.watch(self.comm_groups)     # their calls' seconds, in call order
        self.timers = {}

    def __call__(self, name, exclude_comm=False):
        timer = self.timers.get(name)
        if timer is None:
            timer = self.timers[name] = Timer(name, self, exclude_comm)
        return timer

    def now(self):
        """The host's clock, or an event recorded on the GPU's current (compute) stream."""
        if not self.on_gpu:
            return time.perf_counter()
        event = self.xp.cuda.Event()
        event.record()
        return event

    def seconds(self, start, stop):
        """Seconds between two readings of now(); on a GPU this waits for `stop`'s event, which
        only the compute stream's work so far comes before."""
        if not self.on_gpu:
            return stop - start
        stop.synchronize()
        return self.xp.cuda.get_elapsed_time(start, stop) / 1000

    def synchronize(self):
        """Wait for the compute stream's work so far (a benchmark's step boundary); never for the
        whole device, whose communication streams may hold NCCL calls waiting for peers."""
        if self.on_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    def read(self):
        """Add the measured intervals to each timer's elapsed seconds, the communication seconds
        inside those made with exclude_comm=True moved to tp-comm."""
        for timer in list(self.timers.values()):
            for start, stop, comm_start, comm_stop in timer.intervals:
                seconds = self.seconds(start, stop)
                if comm_start is not None:
                    inside = self.comm.seconds(comm_start, comm_stop)
                    seconds -= inside
                    self(TP_COMM).elapsed += inside
                timer.elapsed += seconds
            timer.intervals = []
        running = [t._start[1] for t in self.timers.values() if t._start is not None and t._start[1] is not None]
        self.comm.forget(min(running, default=self.comm.mark()))

    def elapsed(self, reset=False):
        """{name: seconds summed since the last reset}."""
        self.read()
        result = {name: t.elapsed for name, t in self.timers.items()}
        if reset:
            self.reset()
        return result

    def reset(self):
        for t in self.timers.values():
            t.elapsed, t.count, t.intervals = 0.0, 0, []


class _BackwardMark(Function):
    """The identity, whose backward starts or stops a timer: at a layer's output it starts when the
    gradient arrives there, at its input it stops once the layer's backward is done."""
    float32_output = True       # the values pass through as they are

    @staticmethod
    def forward(ctx, x, timer=None, action=None):
        ctx.timer, ctx.action = timer, action
        return x

    @staticmethod
    def backward(ctx, g):
        getattr(ctx.timer, ctx.action)()
        return g


def timed_layer(timers, number, run, x):
    """run(x), layer `number`'s forward, timed as "layer N forward", and its backward as "layer N
    backward" (--timing-log-level 2). Under recomputation a recomputed forward runs inside the
    backward and is timed as both."""
    backward = timers(f"layer {number} backward")
    if isinstance(x, Tensor) and x.requires_grad:
        x = _BackwardMark.apply(x, timer=backward, action="stop")
    with timers(f"layer {number} forward"):
        y = run(x)
    if isinstance(y, Tensor) and y.requires_grad:
        y = _BackwardMark.apply(y, timer=backward, action="start")
    return y
