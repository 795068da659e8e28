"""Pipeline measurements: the memory each schedule holds on a stage (bytes of arrays kept by
the autograd tape plus live stage inputs and outputs), and the step time with and without
posting receives ahead of compute (overlap). Run under mpirun with PP ranks."""
import time

import numpy

from .. import comm
from ..run import build_model
from ..data_parallel import GradientBuckets
from ..pipeline import MemoryProbe, StageExchange, default_layout, run_schedule
from ..training import train_step


def _setup(cfg, pp, virtual, micro_batches, micro_batch_size, seq_length):
    grid = comm.ProcessGrid(tp=1, pp=pp)
    model = build_model(cfg, grid, default_layout(cfg.num_layers, pp, virtual))
    rng = numpy.random.default_rng(0)
    batches = []
    for _ in range(micro_batches):
        ids = rng.integers(0, cfg.vocab_size, (micro_batch_size, seq_length + 1))
        batches.append((ids[:, :-1], ids[:, 1:]))
    return grid, model, batches


def memory_table(cfg, pp, micro_batches, micro_batch_size, seq_length):
    """{(schedule, deallocate): peak bytes on each pipeline rank}, gathered on every rank."""
    table = {}
    for schedule, virtual, deallocate in [("afab", 1, False), ("afab", 1, True), ("1f1b", 1, False),
                                          ("1f1b", 1, True), ("interleaved", 2, True)]:
        if cfg.num_layers % (pp * virtual) or micro_batches % pp and virtual > 1:
            continue
        grid, model, batches = _setup(cfg, pp, virtual, micro_batches, micro_batch_size, seq_length)
        exchange = StageExchange(grid, cfg.dtype, model.xp, micro_batches)
        probe = MemoryProbe()
        run_schedule(model, exchange, batches, schedule, deallocate_outputs=deallocate, memory=probe)
        peaks = comm.all_gather(numpy.array([probe.peak], numpy.int64), grid.world)
        table[schedule + (", V=2" if virtual > 1 else ""), deallocate] = [int(p) for p in peaks]
    return table


def overlap_timing(cfg, pp, micro_batches, micro_batch_size, seq_length, iters=5):
    """Median step seconds of 1F1B with and without receives posted ahead of compute."""
    result = {}
    grid, model, batches = _setup(cfg, pp, 1, micro_batches, micro_batch_size, seq_length)
    exchange = StageExchange(grid, cfg.dtype, model.xp, micro_batches)
    buckets = GradientBuckets(model.parameters(), grid.dp_group)
    for overlap in (False, True, False, True):
        times = []
        for _ in range(iters + 1):
            comm.barrier(grid.world)
            start = time.perf_counter()
            train_step(model, exchange, batches, buckets, "1f1b", overlap=overlap)
            comm.barrier(grid.world)
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
