"""Rank program for tests/test_multi_gpu_safety.py: one training step of a GPU run (PP = 2 x DP = 2,
the interleaved schedule with two virtual stages per rank) on the strict CuPy stand-in, NCCL over
MPI, with the phase timers on; rank 0 prints "FACTS <json>", each rank's facts in rank order:

    mpiexec -n 4 python tests/ranks/multi_gpu_safety.py     (stand-in first on PYTHONPATH)

- "missing": groups (and pipeline pairs) without an NCCL communicator right after set-up;
  "created_in_step": communicators made during the step; "order": the groups' names in the
  order this rank created their communicators;
- "device_syncs": device-wide synchronisations during the step (with the DP all-reduces, and the
  pipeline's messages, in flight on their streams);
- "dp_before_backward": DP all-reduces issued before each backward of the step, in order;
  "buckets": how many buckets there are;
- "timings": every NCCL call's and every timer's seconds are events' (get_elapsed_time, made to
  answer 2.5 ms here): comm.stats() seconds per op and group with their counts, and the
  dp-comm timer's seconds with its count."""
import json

import numpy

ELAPSED_MS = 2.5


def config():
    from npmegatron.training import TrainConfig
    return TrainConfig.from_flat(
        device="gpu", dtype="float64", num_layers=4, hidden_size=32, num_attention_heads=4,
        seq_length=16, micro_batch_size=1, global_batch_size=8, pipeline_model_parallel_size=2,
        num_layers_per_virtual_pipeline_stage=1, hidden_dropout=0.0, attention_dropout=0.0,
        ddp_bucket_size=3000, lr=1e-3, train_iters=1)


def communicator_names(grid):
    """{the stand-in's communicator label: the group (or pipeline pair) it serves}."""
    names = {}
    for group in (grid.tp_group, grid.dp_group, grid.pp_group, grid.mp_group, grid.embedding_group):
        if group is not None and group.nccl is not None:
            names[group.nccl._label] = group.name
    for (a, b), (pair, _) in (grid.pp_group.nccl_pairs or {}).items():
        names[pair._label] = f"pp {a}->{b}"
    return names


def missing_communicators(grid):
    groups = [grid.tp_group, grid.dp_group, grid.pp_group, grid.mp_group, grid.embedding_group]
    missing = [g.name for g in groups if g is not None and g.size > 1 and g.nccl is None]
    return missing + (["pp pairs"] if grid.pp_group.nccl_pairs is None else [])


def timed_by_events(cupy):
    """get_elapsed_time answers ELAPSED_MS for two events recorded on one stream."""
    def elapsed(start, stop):
        assert start.recorded_on is not None and start.recorded_on == stop.recorded_on, \
            "an interval's events were recorded on different streams"
        return ELAPSED_MS
    cupy.cuda.get_elapsed_time = elapsed


def watch_backwards(cupy, dp_group):
    """The number of DP all-reduces issued before each backward (ScheduleRun.backward_step)."""
    from npmegatron.pipeline import schedules
    seen, real = [], schedules.ScheduleRun.backward_step

    def backward_step(self, *args, **kwargs):
        label = dp_group.nccl._label if dp_group.nccl is not None else None     # None: none issued yet
        seen.append(sum(1 for e in cupy._strict.events("nccl.") if e.get("comm") == label
                        and e["what"] in ("nccl.allReduce", "nccl.reduceScatter")))
        return real(self, *args, **kwargs)
    schedules.ScheduleRun.backward_step = backward_step
    return seen


def batches(run, xp):
    cfg, mb, m = run.cfg, run.config.micro_batch_size, run.plan.micro_batches
    ids = numpy.random.default_rng(cfg.seed).integers(0, cfg.vocab_size, (8, 17))
    mine = ids[run.grid.dp_rank * m * mb:(run.grid.dp_rank + 1) * m * mb]
    return [(xp.asarray(mine[j:j + 1, :-1]), xp.asarray(mine[j:j + 1, 1:])) for j in range(m)]


def main():
    import cupy
    from npmegatron import comm
    from npmegatron.run import assemble
    from npmegatron.timers import DP_COMM, Timers
    from npmegatron.training.step import train_step
    assert "strict_cupy" in cupy.__file__, cupy.__file__
    comm.init()
    run = assemble(config())
    assert run.schedule == "interleaved" and run.model.virtual_size == 2
    facts = {"missing": missing_communicators(run.grid)}
    made = len(cupy._strict.events("nccl.init"))
    timed_by_events(cupy)
    seen = watch_backwards(cupy, run.grid.dp_group)
    timers = Timers(cupy, comm_groups=(run.grid.tp_group.name,))
    comm.reset_stats()
    syncs = len(cupy._strict.events("device.synchronize"))
    train_step(run.model, run.exchange, batches(run, cupy), run.buckets, run.schedule, timers)
    facts["device_syncs"] = len(cupy._strict.events("device.synchronize")) - syncs
    facts["created_in_step"] = len(cupy._strict.events("nccl.init")) - made
    names = communicator_names(run.grid)
    facts["order"] = [names.get(e["comm"], e["comm"]) for e in cupy._strict.events("nccl.init")]
    facts["dp_before_backward"], facts["buckets"] = seen, len(run.buckets.buckets)
    elapsed = timers.elapsed()
    table = comm.stats().table
    facts["timings"] = {"stats": {f"{op}[{g}]": [v["count"], v["seconds"]] for op, groups in table.items()
                                  for g, v in groups.items()},
                        "dp_comm": [timers(DP_COMM).count, elapsed.get(DP_COMM)]}
    everyone = run.grid.world.mpi.gather(facts, root=0)
    if run.grid.rank == 0:
        print("FACTS " + json.dumps(everyone), flush=True)


if __name__ == "__main__":
    main()
