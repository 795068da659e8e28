"""Whether a run fits the memory this rank can have, asked before anything is allocated, and the
one sentence for a run that does not (or for an allocation that fails later all the same).

Why before: NumPy reserves memory lazily, so a model too large for the machine ran 55 s (24
layers x 2560 wide on a 24 GiB machine) before an allocation failed with a 39-line traceback.
The estimate is memory.py's (what `npmegatron plan` prints); the memory is the GPU's free memory
or the node's available host memory, shared by the ranks that use it.
"""
import os
from dataclasses import replace

import numpy

from .. import comm
from ..autograd import InputError
from ..autograd.backend import array_module_for
from ..pipeline_layout import parse_layout
from .memory import ParallelShape, memory_plan

# What to change, in the order a user tries it: the model, the parallelism, then the batch.
ADVICE = ("use fewer --num-layers or a smaller --hidden-size, more ranks for --tp or --pp, "
          "--recompute-granularity full or a smaller --micro-batch-size")
SKIP_VARIABLE = "NPMEGATRON_MEMORY_CHECK"       # =0: skip the check (an estimate can be wrong)


def refuse_unless_fits(cfg, shape):
    """InputError in one sentence when memory.py's estimate of the busiest rank of `shape` exceeds
    the memory available to a rank here. Shapes the estimate does not model are let through
    (building the model reports what is wrong with them)."""
    if os.environ.get(SKIP_VARIABLE, "1") in ("", "0"):
        return
    # --fp16/--bf16 hold their 16-bit values in float32 arrays here: count the bytes allocated.
    shape = replace(shape, element_bytes=numpy.dtype(cfg.dtype).itemsize)
    try:
        peak = max(memory_plan(cfg, shape)["ranks"], key=lambda rank: rank["total"])
    except InputError:
        return
    available, where = available_per_rank(cfg.device)
    if available is None or peak["total"] <= available:
        return
    states = peak["total"] - peak["activations"]
    raise InputError(f"this run needs about {size(peak['total'])} of memory per rank ({size(states)} for "
                     f"the weights, gradients and AdamW state, {size(peak['activations'])} for activations), "
                     f"but {size(available)} is available to each ({where}); {ADVICE} "
                     f"({SKIP_VARIABLE}=0 skips this check)")


def run_shape(config, plan):
    """The ParallelShape of a TrainConfig on its RunPlan, as memory.py estimates it."""
    model, parallel = config.model, config.parallel
    return ParallelShape(tp=plan.tp, pp=plan.pp, dp=plan.dp, cp=plan.cp, virtual=max(1, len(parse_layout(plan.layout)) // plan.pp),
                         micro_batch=config.micro_batch_size, global_batch=plan.global_batch,
                         seq=config.seq_length, sequence_parallel=model.sequence_parallel,
                         recompute=model.recompute_granularity or "none",
                         recompute_method=model.recompute_method or "uniform",
                         recompute_num_layers=model.recompute_num_layers or 1,
                         distributed_optimizer=parallel.use_distributed_optimizer,
                         schedule=parallel.pipeline_schedule)


def out_of_memory(error):
    """The one sentence for an allocation that failed all the same (NumPy's or CuPy's
    MemoryError)."""
    return f"out of memory: {str(error).rstrip('.')}; {ADVICE}"


def available_per_rank(device):
    """(bytes a rank may use, where the figure comes from), or (None, None) when unknown: the
    GPU's free memory over the ranks bound to it, or the node's available host memory over its
    ranks."""
    ranks = comm.local_size() if comm.launched_by_mpi() else 1
    if device == "gpu":
        cupy = array_module_for("gpu")      # CuPy and a visible GPU, or the one sentence saying why not
        free = cupy.cuda.runtime.memGetInfo()[0]
        sharing = -(-ranks // max(1, cupy.cuda.runtime.getDeviceCount()))
        where = f"the free memory of GPU {cupy.cuda.Device().id}"
    else:
        free, sharing, where = host_memory_available(), ranks, "the node's available host memory"
    if free is None:
        return None, None
    return free // sharing, where if sharing == 1 else f"{size(free)} of {where} shared by {sharing} ranks"


def host_memory_available():
    """Bytes the kernel could give without swapping (MemAvailable), within this process's cgroup
    limit where it has one (a container's); None when neither can be read."""
    found = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024
    except OSError:
        pass
    limit = _cgroup_room()
    return limit if found is None else found if limit is None else min(found, limit)


def _cgroup_room():
    """memory.max - memory.current of this process's cgroup (v2), or None."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(line.strip()[3:] for line in f if line.startswith("0::"))
        folder = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(folder, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(folder, "memory.current")) as f:
            used = int(f.read())
    except (OSError, StopIteration, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def size(nbytes):
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2 ** 10:.1f} KiB"
