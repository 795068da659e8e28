"""The child of `npmegatron bench scaling` (scaling.py): one layout's training steps on the ranks
`mpiexec -n TP*PP*DP python -m npmegatron.bench.scaling_child '<spec JSON>'` started, timed by
phase; rank 0 prints one JSON record on a line starting with RECORD_PREFIX."""
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy

from .. import comm
from ..autograd import InputError
from ..autograd.backend import to_numpy
from ..config import GPTConfig, ParallelConfig, TrainConfig
from ..model import model_flops
from ..run import assemble
from ..timers import OPTIMIZER, PHASES, Timers
from ..training.step import clip_after_step, setup_objects_frozen, train_step

RECORD_PREFIX = "SCALING-RECORD "


def cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def git_commit():
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device, threads):
    from mpi4py import MPI
    import mpi4py
    from threadpoolctl import threadpool_info
    blas = [{k: i.get(k) for k in ("internal_api", "version", "num_threads", "threading_layer")}
            for i in threadpool_info() if i.get("user_api") == "blas"]
    return {"git_commit": git_commit(), "python": platform.python_version(), "numpy": numpy.__version__,
            "mpi4py": mpi4py.__version__, "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
            "blas": blas, "cores": cores(), "threads_per_rank": threads,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "device": device, "machine": platform.machine(), "node": platform.node()}


class ChildRun:
    """One layout's training step on the ranks mpiexec started: the run assembled as the Trainer
    assembles it (run.py), fed micro-batches of synthetic tokens."""

    def __init__(self, spec):
        world = comm.init()
        if world.size != spec["ranks"]:
            raise InputError(f"layout {spec['layout']} needs {spec['ranks']} ranks, mpiexec started {world.size}")
        parallel = ParallelConfig(tensor_model_parallel_size=spec["tp"], pipeline_model_parallel_size=spec["pp"])
        config = TrainConfig(model=GPTConfig(**spec["cfg"]), parallel=parallel, seq_length=spec["seq"],
                             micro_batch_size=spec["micro_batch"], global_batch_size=spec["global_batch"],
                             lr=1e-4, min_lr=0.0)
        self.spec, self.run = spec, assemble(config)
        self.grid, self.cfg, xp = self.run.grid, self.run.cfg, self.run.model.xp
        mb, m = spec["micro_batch"], spec["micro_batches"]
        ids = numpy.random.default_rng(self.cfg.seed).integers(0, self.cfg.vocab_size,
                                                              (spec["global_batch"], spec["seq"] + 1))
        mine = ids[self.grid.dp_rank * m * mb:(self.grid.dp_rank + 1) * m * mb]
        self.batches = [(xp.asarray(mine[j * mb:(j + 1) * mb, :-1]), xp.asarray(mine[j * mb:(j + 1) * mb, 1:]))
                        for j in range(m)]
        self.timers = Timers(xp, comm_groups=(self.grid.tp_group.name,))

    def step(self):
        """One training step, as Trainer.train_step and step() make it."""
        run = self.run
        loss_sum = train_step(run.model, run.exchange, self.batches, run.buckets, run.schedule, self.timers)
        with self.timers(OPTIMIZER):
            clip_after_step(run.model, run.params, loss_sum, run.norm_skip, 1.0)
            run.optimizer.step(1e-4)

    def measure(self):
        """(this rank's step times, its mean seconds per phase) over the timed steps."""
        times, phase_sums = [], {p: 0.0 for p in PHASES}
        for i in range(self.spec["warmup"] + self.spec["iters"]):
            comm.barrier(self.grid.world)
            self.timers.synchronize()
            self.timers.reset()
            start = time.perf_counter()
            self.step()
            self.timers.synchronize()
            seconds = time.perf_counter() - start
            if i >= self.spec["warmup"]:
                times.append(seconds)
                for name, value in self.timers.elapsed().items():
                    phase_sums[name] = phase_sums.get(name, 0.0) + value
        phases = {name: total / len(times) for name, total in phase_sums.items()}
        phases["other"] = statistics.fmean(times) - sum(phases.values())
        return times, phases


def run_child(spec):
    """One layout on the ranks mpiexec started; rank 0 returns the record (others None)."""
    run = ChildRun(spec)
    grid, cfg, seq = run.grid, run.cfg, spec["seq"]
    with setup_objects_frozen():
        times, phases = run.measure()
    # The slowest rank's step times (each step ends with collectives, so they are close).
    slowest = to_numpy(comm.all_reduce(numpy.asarray(times), grid.world, "max"))
    rank0_mean = statistics.fmean(times)
    peak = to_numpy(comm.all_reduce(numpy.asarray([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss],
                                                  numpy.float64), grid.world, "max"))[0]
    if grid.rank != 0:
        return None
    step_s = statistics.median(slowest)
    flops = model_flops(cfg, spec["parameters"], spec["global_batch"], seq)
    record = {k: spec[k] for k in ("layout", "tp", "pp", "dp", "ranks", "global_batch", "micro_batch",
                                   "micro_batches", "seq", "parameters", "threads_per_rank")}
    record.update({
        "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads, "vocab_size": cfg.vocab_size, "dtype": cfg.dtype,
        "sequence_parallel": cfg.sequence_parallel, "hidden_dropout": cfg.hidden_dropout,
        "attention_dropout": cfg.attention_dropout, "device": cfg.device, "schedule": "1f1b", "warmup": spec["warmup"], "iters": spec["iters"],
        "step_s": step_s, "step_min_s": float(min(slowest)), "step_max_s": float(max(slowest)),
        "step_times_s": [float(t) for t in slowest],
        "tokens_per_s": spec["global_batch"] * seq / step_s,
        "model_flops_per_step": flops, "model_flops_per_s": flops / step_s,
        "model_flops_per_s_per_rank": flops / step_s / spec["ranks"],
        "phases_s": phases, "phases_of": "rank 0, mean seconds per measured step",
        "rank0_step_mean_s": rank0_mean,
        "phases_sum_ratio": sum(v for k, v in phases.items() if k != "other") / rank0_mean,
        "peak_rss_MiB_max_over_ranks": float(peak) / 1024,
        "environment": environment(cfg.device, spec["threads_per_rank"]),
    })
    return record


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    record = run_child(json.loads(argv[0]))
    if record is not None:
        print(RECORD_PREFIX + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
