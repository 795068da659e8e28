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

On a GPU, an enabled timer synchronises the device before reading the clock (start and stop);
on NumPy it never does. Disabled timers never synchronise.
"""
import time

import numpy

from . import comm

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
    """One named timer; start/stop pairs add up in `elapsed`. Also a context manager."""

    def __init__(self, name, owner, exclude_comm=False):
        self.name, self.owner, self.exclude_comm = name, owner, exclude_comm
        self.elapsed, self.count = 0.0, 0
        self._start = self._comm = None

    def start(self):
        if self._start is not None:
            raise RuntimeError(f"timer {self.name!r} started twice")
        self.owner.synchronize()
        if self.exclude_comm:
            self._comm = self.owner.comm_seconds()
        self._start = time.perf_counter()

    def stop(self):
        if self._start is None:
            raise RuntimeError(f"timer {self.name!r} stopped but not started")
        self.owner.synchronize()
        seconds = time.perf_counter() - self._start
        self._start = None
        if self.exclude_comm:
            inside = self.owner.comm_seconds() - self._comm
            seconds -= inside
            self.owner(TP_COMM).elapsed += inside
        self.elapsed += seconds
        self.count += 1

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


class Timers:
    """Named timers. `xp`: the array module (CuPy: synchronise the device around each reading).
    `comm_groups`: names of the groups whose collective seconds (comm.stats()) count as TP/SP
    communication inside timers made with exclude_comm=True (default: the "tp" group)."""

    enabled = True

    def __init__(self, xp=numpy, comm_groups=("tp",)):
        self.xp, self.comm_groups = xp, tuple(comm_groups)
        self.timers = {}

    def __call__(self, name, exclude_comm=False):
        timer = self.timers.get(name)
        if timer is None:
            timer = self.timers[name] = Timer(name, self, exclude_comm)
        return timer

    def synchronize(self):
        if self.xp is not numpy:
            self.xp.cuda.Device().synchronize()

    def comm_seconds(self):
        table = comm.stats().table
        return sum(entry["seconds"] for groups in table.values()
                   for group, entry in groups.items() if group in self.comm_groups)

    def elapsed(self, reset=False):
        """{name: seconds summed since the last reset}."""
        result = {name: t.elapsed for name, t in self.timers.items()}
        if reset:
            self.reset()
        return result

    def reset(self):
        for t in self.timers.values():
            t.elapsed, t.count = 0.0, 0
