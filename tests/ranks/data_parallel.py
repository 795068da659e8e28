"""Rank program for tests/npmegatron/test_data_parallel.py: gradient buckets that reduce while
backward runs, and a TP = 2 x DP = 2 run killed while saving a checkpoint, then resumed.

    mpiexec -n 2 python tests/ranks/data_parallel.py buckets
        test_buckets_reduce_while_backward_runs; each rank prints "buckets <number of buckets>".
    mpiexec -n 4 python tests/ranks/data_parallel.py save-and-resume {kill,resume,straight} \\
            --checkpoint DIR --straight-checkpoint DIR --log-file PATH
        test_killed_while_saving_resumes_from_the_previous_checkpoint: 6 iterations saving every 2
        into --checkpoint; "kill" dies (SIGKILL) once iteration 4's shards are written and before
        its manifest, "resume" loads --checkpoint, "straight" saves into --straight-checkpoint (a
        run of its own: never into another run's folder). Losses go to --log-file.
"""
import argparse
import os
import signal

import numpy as np


def buckets_overlap_backward():
    from npmegatron import comm
    from npmegatron.data_parallel import buckets as data_parallel
    from npmegatron.model import GPT, GPTConfig
    comm.init()
    grid = comm.ProcessGrid(tp=1)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                    hidden_dropout=0, attention_dropout=0, dtype="float64")
    model = GPT(cfg, grid)
    params = model.parameters()
    buckets = data_parallel.GradientBuckets(params, grid.dp_group, bucket_size=5000)
    ready, launched_at = [], []
    for p in params:
        p._accumulator.hooks.insert(0, lambda leaf: ready.append(leaf))
    real = comm.all_reduce_async
    data_parallel.comm.all_reduce_async = lambda x, g: (launched_at.append(len(ready)), real(x, g))[1]
    ids = np.random.default_rng(grid.rank).integers(0, 256, (2, 16))
    buckets.zero_grad()
    buckets.start_sync()
    _, loss = model(ids, np.roll(ids, -1, axis=1))
    loss.backward()
    buckets.finish_sync()
    # every rank holds the same averaged gradients: the sum over ranks is twice each one
    total = [comm.all_reduce(g, grid.world) for g in [p.grad for p in params]]
    for p, t in zip(params, total):
        assert np.allclose(p.grad * 2, t), "grads differ across ranks"
    n = len(buckets.buckets)
    assert n >= 3, n
    assert len(launched_at) == n
    assert launched_at[0] < len(params), launched_at      # first bucket left before backward ended
    print(f"buckets {n}", flush=True)


def save_and_resume(mode, checkpoint_dir, straight_dir, log_file):
    from npmegatron.checkpointing import checkpoint
    from npmegatron.training import TrainConfig, train
    real = checkpoint._write_synced

    def dying(path, data):
        if "iter_0000004.partial" in path and path.endswith("manifest.json"):
            os.kill(os.getpid(), signal.SIGKILL)      # shards written, manifest not yet
        real(path, data)

    if mode == "kill":
        checkpoint._write_synced = dying
    args = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                micro_batch_size=2, global_batch_size=4, train_iters=6, log_interval=1,
                eval_interval=100, eval_iters=1, hidden_dropout=0.1, sample_tokens=0,
                tensor_model_parallel_size=2, save=checkpoint_dir, save_interval=2,
                log_file=log_file)
    if mode == "resume":
        args["load"] = checkpoint_dir
    if mode == "straight":        # a run of its own: never into another run's folder
        args["save"] = straight_dir
    train(TrainConfig.from_flat(**args), echo=lambda *a: None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cases = parser.add_subparsers(dest="case", required=True)
    cases.add_parser("buckets")
    run = cases.add_parser("save-and-resume")
    run.add_argument("mode", choices=["kill", "resume", "straight"])
    run.add_argument("--checkpoint", required=True)
    run.add_argument("--straight-checkpoint", required=True)
    run.add_argument("--log-file", required=True)
    args = parser.parse_args(argv)
    if args.case == "buckets":
        buckets_overlap_backward()
    else:
        save_and_resume(args.mode, args.checkpoint, args.straight_checkpoint, args.log_file)


if __name__ == "__main__":
    main()
