"""What ranks that meet often lose on this machine when their work takes a little longer on one
rank than on the other: the ceiling of TP and DP efficiency for ranks that wait at every meeting.
(Only work done while a meeting is under way gets past it: TP's backward computes its weight
gradients while f's all-reduce is posted, see tensor_parallel/layers.py.)

Every rank does the same work, segments of float32 GEMMs of one shape (about --segment-ms each),
and after each segment all ranks meet in a small all-reduce, as TP's all-reduces do (TP = 2 on
the reference model meets about every 60 ms on one core, DP once a step). The time a rank spends
in the all-reduce is almost all waiting for the slower rank, so

    ceiling = (mean segment time) / (mean segment time + mean time in the all-reduce)

is the efficiency of perfectly balanced work with free communication. Run it like the scaling
benchmark's layouts, one BLAS thread per rank:

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python scripts/bench_sync_jitter.py

Rank 0 prints one JSON line: each rank's segment and all-reduce times (median, p90, max, in ms)
and ceiling, and their mean ceiling (the ranks' mean speed against their speed in step).
"""
import argparse
import json
import statistics
import time

import numpy

from npmegatron import comm


def calibrated_gemms(a, b, segment_s):
    """How many a @ b make about segment_s seconds (at least 1), timed on this rank."""
    a @ b
    start = time.perf_counter()
    for _ in range(3):
        a @ b
    return max(1, round(segment_s / ((time.perf_counter() - start) / 3)))


def measure(world, segments, gemms, a, b):
    """(segment seconds, all-reduce seconds) for each segment on this rank."""
    token = numpy.ones(1, numpy.float64)
    work, waits = [], []
    comm.barrier(world)
    for _ in range(segments):
        start = time.perf_counter()
        for _ in range(gemms):
            a @ b
        met = time.perf_counter()
        comm.all_reduce(token, world)
        work.append(met - start)
        waits.append(time.perf_counter() - met)
    return work, waits


def summary_of(values):
    """(median, p90, max) seconds as milliseconds, by name."""
    return dict(zip(("median_ms", "p90_ms", "max_ms"), (1e3 * float(v) for v in values)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segment-ms", type=float, default=60.0, help="Work between two meetings.")
    parser.add_argument("--segments", type=int, default=200, help="Meetings measured.")
    parser.add_argument("--rows", type=int, default=2048,
                        help="GEMM shape, rows x inner @ inner x columns; by default a TP = 2 rank's QKV GEMM "
                             "on the reference model (micro-batch 8 x 256 tokens, hidden 512).")
    parser.add_argument("--inner", type=int, default=512)
    parser.add_argument("--columns", type=int, default=768)
    args = parser.parse_args()
    world = comm.init()
    rng = numpy.random.default_rng(world.rank)
    a = rng.standard_normal((args.rows, args.inner)).astype(numpy.float32)
    b = rng.standard_normal((args.inner, args.columns)).astype(numpy.float32)
    # Every rank runs the same number of GEMMs: rank 0's calibration, so the work is equal.
    gemms = int(comm.broadcast(numpy.asarray([calibrated_gemms(a, b, args.segment_ms / 1e3)]), world)[0])
    work, waits = measure(world, args.segments, gemms, a, b)
    ceiling = statistics.fmean(work) / (statistics.fmean(work) + statistics.fmean(waits))
    mine = [ceiling] + [f(s) for s in (work, waits) for f in (statistics.median, lambda s: numpy.percentile(s, 90), max)]
    every = numpy.asarray(comm.all_gather(numpy.asarray(mine), world)).reshape(world.size, len(mine))
    if world.rank == 0:
        rows = [{"rank": r, "ceiling": float(v[0]), "segment": summary_of(v[1:4]), "all_reduce": summary_of(v[4:7])}
                for r, v in enumerate(every)]
        print(json.dumps({"ranks": world.size, "gemms_per_segment": gemms, "segments": args.segments,
                          "gemm_shape": [args.rows, args.inner, args.columns],
                          "ceiling": statistics.fmean(r["ceiling"] for r in rows), "per_rank": rows}))


if __name__ == "__main__":
    main()
