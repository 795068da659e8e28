"""Rank program for tests/npmegatron/test_recompute.py: activation recomputation at TP = 2 x
PP = 2 (4 ranks) with sequence parallelism and dropout on, against the same model without it.

    mpiexec -n 4 python tests/ranks/recompute.py '<JSON list of cases>'

A case is {"schedule", "dtype", "recompute": {GPTConfig's recompute_* fields}} with optional
"virtual". Two training steps (iterations 0 and 1, M = 4 micro-batches) of two models built alike,
one recomputing: every loss and every local gradient must be bitwise equal. Rank 0 prints its
TP collectives (all-gathers and reduce-scatters under SP) of each model's two steps, then
"cases passed <count>".
"""
import dataclasses
import json
import sys

import numpy as np


def tp_collectives():
    """This rank's calls in its TP group since the last reset, every op together."""
    from npmegatron import comm
    return sum(groups.get("tp", {}).get("count", 0) for groups in comm.stats().table.values())


def run(cfg, layout, schedule, batches, steps=2):
    from npmegatron import comm
    from npmegatron.autograd.backend import to_numpy
    from npmegatron.config import ParallelConfig, TrainConfig
    from npmegatron.run import assemble
    from npmegatron.training import train_step

    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                              pipeline_model_parallel_layout=layout, pipeline_schedule=schedule,
                              num_micro_batches=len(batches))
    built = assemble(TrainConfig(model=cfg, parallel=parallel, seq_length=8, micro_batch_size=2))
    model = built.model
    losses, grads = [], []
    comm.reset_stats()
    for iteration in range(steps):
        model.rng.iteration = iteration          # as the trainer does: new dropout masks per step
        losses.append(to_numpy(train_step(model, built.exchange, batches, built.buckets, built.schedule)))
        grads.append([to_numpy(p.grad).copy() for p in model.parameters()])
    return losses, grads, tp_collectives()


def main(cases):
    from npmegatron import comm
    from npmegatron.model import GPTConfig
    from npmegatron.pipeline import default_layout

    world = comm.init()
    rng = np.random.default_rng(3)
    batches = [(ids[:, :-1], ids[:, 1:]) for ids in (rng.integers(0, 50, (2, 9)) for _ in range(4))]
    for case in cases:
        base = GPTConfig(num_layers=4, hidden_size=16, num_attention_heads=4, vocab_size=50,
                         max_position_embeddings=8, dtype=case["dtype"], hidden_dropout=0.2,
                         attention_dropout=0.2, sequence_parallel=True)
        layout = default_layout(4, 2, case.get("virtual", 1))
        *plain, plain_calls = run(base, layout, case["schedule"], batches)
        *again, again_calls = run(dataclasses.replace(base, **case["recompute"]), layout, case["schedule"], batches)
        for (loss, grads), (loss2, grads2) in zip(zip(*plain), zip(*again)):
            assert np.array_equal(loss, loss2), (case, loss, loss2)
            assert all(np.array_equal(a, b) for a, b in zip(grads, grads2)), case
        if world.rank == 0:
            print(f"tp collectives on rank 0: {plain_calls} plain, {again_calls} recomputing", flush=True)
        comm.barrier(world)
    if world.rank == 0:
        print(f"cases passed {len(cases)}", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
