"""Pipeline measurements: the memory each schedule holds on a stage (bytes of arrays kept by
the autograd tape plus live stage inputs and outputs), and the step time with and without
posting receives ahead of compute (overlap). Run under mpirun with PP ranks."""
import time

import numpy

from .. import comm
from ..config import ParallelConfig, TrainConfig
from ..pipeline import MemoryProbe, run_schedule
from ..run import assemble
from ..training import train_step


def _setup(cfg, pp, virtual, micro_batches, micro_batch_size, seq_length):
    """The run of `cfg` over `pp` stages (`virtual` model chunks each), assembled as the Trainer
    assembles it, and its micro-batches of random tokens."""
    parallel = ParallelConfig(pipeline_model_parallel_size=pp, num_micro_batches=micro_batches,
                              num_layers_per_virtual_pipeline_stage=cfg.num_layers // (pp * virtual) if virtual > 1 else None)
    run = assemble(TrainConfig(model=cfg, parallel=parallel, seq_length=seq_length,
                               micro_batch_size=micro_batch_size, lr=1e-4, min_lr=0.0))
    rng = numpy.random.default_rng(0)
    batches = []
    for _ in range(micro_batches):
        ids = rng.integers(0, cfg.vocab_size, (micro_batch_size, seq_length + 1))
        batches.append((ids[:, :-1], ids[:, 1:]))
    return run, batches


def memory_table(cfg, pp, micro_batches, micro_batch_size, seq_length):
    """{(schedule, deallocate): peak bytes on each pipeline rank}, gathered on every rank."""
    table = {}
    for schedule, virtual, deallocate in [("afab", 1, False), ("afab", 1, True), ("1f1b", 1, False),
                                          ("1f1b", 1, True), ("interleaved", 2, True)]:
        if cfg.num_layers % (pp * virtual) or micro_batches % pp and virtual > 1:
            continue
        run, batches = _setup(cfg, pp, virtual, micro_batches, micro_batch_size, seq_length)
        probe = MemoryProbe()
        run_schedule(run.model, run.exchange, batches, schedule, deallocate_outputs=deallocate, memory=probe)
        peaks = comm.all_gather(numpy.array([probe.peak], numpy.int64), run.grid.world)
        table[schedule + (", V=2" if virtual > 1 else ""), deallocate] = [int(p) for p in peaks]
    return table


def overlap_timing(cfg, pp, micro_batches, micro_batch_size, seq_length, iters=5):
    """Median step seconds of 1F1B with and without receives posted ahead of compute."""
    result = {}
    run, batches = _setup(cfg, pp, 1, micro_batches, micro_batch_size, seq_length)
    for overlap in (False, True, False, True):
        times = []
        for _ in range(iters + 1):
            comm.barrier(run.grid.world)
            start = time.perf_counter()
            train_step(run.model, run.exchange, batches, run.buckets, "1f1b", overlap=overlap)
            comm.barrier(run.grid.world)
            times.append(time.perf_counter() - start)
        result.setdefault(overlap, []).append(float(numpy.median(times[1:])))
    return {k: min(v) for k, v in result.items()}


def format_memory(table):
    pp = len(next(iter(table.values())))
    lines = ["| schedule | deallocate | " + " | ".join(f"stage {r} MB" for r in range(pp)) + " |",
             "|---|---|" + "---|" * pp]
    for (schedule, deallocate), peaks in table.items():
        lines.append(f"| {schedule} | {'yes' if deallocate else 'no'} | "
                     + " | ".join(f"{p / 2 ** 20:.2f}" for p in peaks) + " |")
    return "\n".join(lines)
