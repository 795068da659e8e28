"""Rank program for tests/test_cuda_graph_on_device.py: --cuda-graph across ranks, on the strict
CuPy stand-in (PYTHONPATH) with a GPU per rank, so collectives go through NCCL (the stand-in's,
over MPI) and are captured: tensor parallelism's all-reduces, the data-parallel buckets'
all-reduces on their own stream and the distributed optimizer's reduce-scatter and all-gather.

    mpiexec -n 2 python tests/ranks/cuda_graph_training.py '{"tensor_model_parallel_size": 2}'

Seven steps with the flag against seven without: losses, gradient norms and this rank's
parameters bitwise equal; from step 4 on each step is one graph launch. Rank 0 prints one JSON line."""
import collections
import json
import sys

import numpy

from npmegatron import comm
from npmegatron.autograd import InputError
from npmegatron.autograd.backend import to_numpy
from npmegatron.training import TrainConfig
from npmegatron.training.trainer import Trainer

SMALL = dict(device="gpu", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
             global_batch_size=8, lr=3e-3, lr_warmup_iters=2, train_iters=7, log_interval=1, eval_interval=100,
             eval_iters=1, sample_tokens=0, cuda_graph_warmup_steps=2)


def steps(options):
    import cupy
    trainer = Trainer(TrainConfig.from_flat(**{**SMALL, **options}))
    results, kinds = [], []
    for _ in range(7):
        cupy._strict.reset()
        results.append(trainer.step()[:2])
        kinds.append(dict(collections.Counter(launch.kind for launch in cupy._strict.launches())))
    return results, [to_numpy(p.data) for p in trainer.params], kinds


def main():
    options = json.loads(sys.argv[1])
    world = comm.init()
    if options.pop("expect_refusal", False):      # ranks sharing a GPU: collectives through MPI
        try:
            Trainer(TrainConfig.from_flat(**{**SMALL, **options, "cuda_graph": True}))
        except InputError as error:
            if world.rank == 0:
                print(json.dumps({"refused": str(error)}))
            return
        raise AssertionError("--cuda-graph with collectives through MPI was not refused")
    eager, eager_params, _ = steps(options)
    graphed, graphed_params, kinds = steps({**options, "cuda_graph": True})
    assert graphed == eager, (graphed, eager)
    for mine, theirs in zip(graphed_params, eager_params):
        numpy.testing.assert_array_equal(mine, theirs)
    assert all(k == {"graph": 1} for k in kinds[3:]), kinds
    if world.rank == 0:
        print(json.dumps({"losses": [loss for loss, _ in graphed], "replayed_launches": kinds[3:]}))


if __name__ == "__main__":
    main()
