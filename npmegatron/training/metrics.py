"""What a training run measures besides its loss: the step's phases (--timing-log-level 1, the
timers of timers.py, max and min over ranks), throughput per rank and model-FLOP utilisation
against a peak (--peak-tflops; by default a matrix product's speed measured when the run starts on
the CPU, the card's datasheet figure on a GPU), and measured peak memory beside the plan's
prediction (--log-memory). Collective where it says so: every rank calls it at each interval."""
import resource
import tracemalloc

import numpy

from .. import comm
from ..autograd import InputError
from ..autograd.backend import to_numpy
from ..autograd.memory import distinct_bytes
from ..perf.fit import run_shape
from ..perf.memory import memory_plan
from ..perf.peaks import device_name, measured_gemm_flops, peak_flops, precision_of
from ..timers import PHASES, Timers

MIB = 2 ** 20


def run_timers(trainer):
    """Timers for --timing-log-level 1 and 2 (None for 0): TP/SP communication counted apart; at 2
    each layer's forward and backward too (model.Block.layer_timers)."""
    level = trainer.config.timing_log_level
    if level > 2:
        raise InputError(f"--timing-log-level {level} is not a level; use 0 (off), 1 (the step's phases) or 2 "
                         "(also each layer)")
    if level == 0:
        return None
    timers = Timers(trainer.model.xp, comm_groups=(trainer.grid.tp_group.name,))
    if level == 2:
        for chunk in trainer.model.chunks:
            for block in chunk.blocks.values():
                block.layer_timers = timers
    return timers


def layer_times(timers, steps, world, num_layers):
    """Collective: {layer: (forward, backward)} seconds per step since the last reset, max over
    ranks (a layer lives on one pipeline stage; the others hold 0 for it). Read before phases(),
    which resets the timers."""
    elapsed = timers.elapsed()
    values = numpy.array([elapsed.get(f"layer {i} {way}", 0.0) / steps
                          for i in range(num_layers) for way in ("forward", "backward")])
    high = to_numpy(comm.all_reduce(values, world, "max"))
    return {str(i): (float(high[2 * i]), float(high[2 * i + 1])) for i in range(num_layers)}


def format_layers(record):
    parts = [f"{i} {forward * 1e3:.1f}/{backward * 1e3:.1f}" for i, (forward, backward) in record["layers_s"].items()]
    return "layers ms/step, forward/backward (max over ranks): " + ", ".join(parts)


def peak_flops_per_rank(trainer):
    """(FLOP/s a rank's MFU is taken against, where it comes from), or (None, why)."""
    config, xp = trainer.config, trainer.model.xp
    if config.peak_tflops is not None:
        return config.peak_tflops * 1e12, "--peak-tflops"
    if xp is numpy:
        return measured_gemm_flops(xp, numpy.dtype(trainer.cfg.dtype)), "a 1024^3 matrix product measured at start"
    name = device_name(xp)
    peak = peak_flops(name, precision_of(trainer.cfg))
    return (peak, f"the {name} datasheet") if peak else (None, f"no peak listed for {name}; give --peak-tflops")


def phases(timers, steps, world):
    """Collective: {phase: (max, min) over ranks of its seconds per step} since the last call."""
    elapsed = timers.elapsed(reset=True)
    values = numpy.array([elapsed.get(name, 0.0) / steps for name in PHASES])
    high = to_numpy(comm.all_reduce(values, world, "max"))
    low = to_numpy(comm.all_reduce(values, world, "min"))
    return {name: (float(h), float(l)) for name, h, l in zip(PHASES, high, low)}


class MemoryLog:
    """--log-memory: this rank's measured peak beside the plan's prediction for it (perf/memory.py:
    weights, gradients, optimizer state and activations), reported when it grows. On a GPU the
    memory pools'. On the CPU the plan's terms, measured: the bytes of the arrays the run holds
    (parameters, gradients, optimizer state, counted from the arrays themselves) and the peak of
    what the steps allocate on top (tracemalloc, which NumPy reports its arrays to: activations,
    temporaries, the autograd's objects), traced from the end of the first step, whose kernels'
    compilation is not the steps' memory. The peak resident set above the process's before the
    model, which also counts the libraries' and compiled kernels' memory, is reported beside it."""

    def __init__(self, trainer, baseline):
        self.trainer, self.baseline, self.shown = trainer, baseline, -1     # the first report is always made
        self.settled = False
        reset_peak_resident()
        config = trainer.config
        try:
            ranks = memory_plan(config.model, run_shape(config, trainer.plan))["ranks"]
            self.predicted = next(r["total"] for r in ranks if r["pp_rank"] == trainer.grid.pp_rank)
        except InputError:
            self.predicted = None

    def settle(self):
        """After the first step: trace what the later steps allocate (on the CPU)."""
        self.settled = True
        if self.trainer.model.xp is numpy:
            if tracemalloc.is_tracing():
                tracemalloc.stop()
            tracemalloc.start(1)        # one frame a trace: the cheapest

    def measured(self):
        xp = self.trainer.model.xp
        if xp is numpy:
            traced = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0
            return held_bytes(self.trainer) + traced
        return device_pool_bytes(xp, self.trainer.graphed)

    def resident(self):
        """The peak resident set above the process's before the model (freed memory the process
        reuses does not grow it: at least 0)."""
        return max(0, peak_resident_bytes() - self.baseline)

    def report(self):
        """Collective: {"memory_bytes": this rank's, max over ranks, "predicted_bytes"} (and on the
        CPU "resident_bytes") when the peak grew since the last report, else None."""
        mine = self.measured()
        largest = int(to_numpy(comm.all_reduce(numpy.array([mine]), self.trainer.grid.world, "max"))[0])
        if largest <= self.shown:
            return None
        self.shown = largest
        record = {"memory_bytes": int(mine), "memory_bytes_max": largest, "predicted_bytes": self.predicted}
        if self.trainer.model.xp is numpy:
            record["resident_bytes"] = self.resident()
        return record

    def close(self):
        if self.settled and tracemalloc.is_tracing():
            tracemalloc.stop()


def held_bytes(trainer):
    """The bytes of the arrays a run holds between steps, each buffer once: parameters, their
    gradients and the optimizer's state (moments, master weights)."""
    arrays = [p.data for p in trainer.params] + [p.grad for p in trainer.params if p.grad is not None]
    for value in trainer.optimizer.state_dict().values():
        if isinstance(value, (list, tuple)):
            arrays.extend(a for a in value if hasattr(a, "nbytes"))
    return distinct_bytes(arrays)


def device_pool_bytes(xp, graphed=None):
    """The bytes CuPy's memory pool holds (it keeps what was freed: after a run, its peak), and
    under --cuda-graph the graph's own pool too."""
    return xp.get_default_memory_pool().total_bytes() + (graphed.pool.total_bytes() if graphed else 0)


def reset_peak_resident():
    """Start the process's peak resident set afresh (Linux: /proc/self/clear_refs, "5"), so that
    what an earlier part of the process used (a test run before, the data loaded) is not its peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_resident_bytes():
    """The process's peak resident set since reset_peak_resident (/proc/self/status VmHWM), or
    over its life where that is not readable (getrusage; Linux reports KiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_resident_bytes():
    """The process's resident set now (/proc/self/statm), or its peak where that is unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return peak_resident_bytes()


def format_phases(record):
    """The phases of a record, in ms per step, max/min over ranks, and what is left of the step."""
    parts = [f"{name} {high * 1e3:.1f}/{low * 1e3:.1f}" for name, (high, low) in record["phases_s"].items()
             if high > 0]
    return "phases ms/step (max/min over ranks): " + ", ".join(parts) + f", other {record['other_s'] * 1e3:.1f}"


def format_memory(record, on_gpu):
    predicted = record["predicted_bytes"]
    plan = "" if predicted is None else f"; the plan predicts {predicted / MIB:,.1f} MiB of states and activations"
    what = "the memory pools' peak" if on_gpu else "the arrays held and the steps' traced peak on top"
    resident = ("" if on_gpu else f"; resident set {record['resident_bytes'] / MIB:,.1f} MiB above the process "
                "before the model (libraries' and compiled kernels' memory included)")
    return (f"memory ({what}): {record['memory_bytes'] / MIB:,.1f} MiB on rank 0, "
            f"{record['memory_bytes_max'] / MIB:,.1f} MiB on the largest rank{plan}{resident}")
