"""Rank program for tests/npmegatron/test_mixed_precision.py: --fp16 at TP = 2 (2 ranks) with an
overflow planted in one gradient of TP rank 1 only, at iteration 3. The norm is reduced over the
model-parallel group, so both ranks must see the overflow, skip the step (nothing applied) and
halve the scale. (The gradient is one of a split parameter: a replicated one is counted in the
norm on TP rank 0 only, as its gradient is the same on every TP rank.) Rank 0 prints "both ranks skipped iteration 3".

    mpiexec -n 2 python tests/ranks/mixed_precision.py
"""
import numpy as np


def main():
    from npmegatron import comm
    from npmegatron.training import TrainConfig
    from npmegatron.training import trainer as trainer_module

    config = TrainConfig.from_flat(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                                   micro_batch_size=2, train_iters=6, lr_warmup_iters=1, sample_tokens=0,
                                   tensor_model_parallel_size=2, fp16=True, initial_loss_scale=2.0 ** 12,
                                   hysteresis=1)
    original = trainer_module.train_step

    def planted(model, *args, **kwargs):
        loss = original(model, *args, **kwargs)
        if model.rng.iteration == 3 and model.grid.tp_rank == 1:
            split = next(p for name, p in model.named_parameters() if name.endswith("qkv.weight"))
            split.grad[...] = np.inf          # this rank's heads only
        return loss
    trainer_module.train_step = planted
    t = trainer_module.Trainer(config)
    for _ in range(3):
        t.step()
    before = [p.data.copy() for p in t.params]
    t.step()
    unchanged = all(np.array_equal(a, p.data) for a, p in zip(before, t.params))
    mine = np.array([t.skipped, t.loss_scale.scale, unchanged], np.float64)
    every = comm.all_gather(mine, t.grid.world).reshape(t.grid.world.size, -1)
    assert (every == [1, 2.0 ** 11, 1]).all(), every
    t.step()
    if t.grid.rank == 0:
        print("both ranks skipped iteration 3")


if __name__ == "__main__":
    main()
