"""The distributed optimizer (--use-distributed-optimizer, ZeRO-1): the same losses as plain data
parallelism in float64 over 20 iterations at DP = 2 and 4 (and with the tied embedding split over
PP = 2), 1/DP of AdamW's state per rank, and checkpoints that resume bitwise, also at another DP
size and without it."""

import numpy as np
import pytest

from helpers import launch_logged

RUN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
       "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "20", "--log-interval", "1",
       "--eval-interval", "20", "--eval-iters", "1", "--lr-warmup-iters", "4", "--dtype", "float64",
       "--hidden-dropout", "0.1", "--sample-tokens", "0"]
DISTRIBUTED = ["--use-distributed-optimizer"]


def train(tmp_path, name, ranks, extra=()):
    records = launch_logged(ranks, RUN + list(extra), tmp_path / f"{name}.jsonl")
    return np.array([r["loss"] for r in records])


def assert_close(got, want, rel=1e-12):
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= rel * np.abs(want).max(), np.abs(got - want).max()


@pytest.mark.parametrize("ranks, extra", [
    (2, []),
    pytest.param(4, [], marks=pytest.mark.slow),
    pytest.param(4, ["--pp", "2"], marks=pytest.mark.slow),
], ids=["dp2", "dp4", "pp2xdp2"])
def test_same_losses_as_plain_data_parallelism(tmp_path, ranks, extra):
    plain = train(tmp_path, "plain", ranks, extra)
    assert_close(train(tmp_path, "distributed", ranks, extra + DISTRIBUTED), plain)


class FakeGroup:
    def __init__(self, size, rank):
        self.size, self.rank = size, rank


@pytest.mark.parametrize("dp", [2, 4])
def test_each_rank_holds_one_dp_th_of_the_optimizer_state(dp):
    """Measured: the moments' bytes on each DP rank (construction does not communicate)."""
    from npmegatron.data_parallel.distributed_optimizer import DistributedAdamW, ShardedGradientBuckets
    from npmegatron.model import GPT, GPTConfig
    from npmegatron.optim.adamw import AdamW
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    state = lambda opt: sum(a.nbytes for kind in (opt.exp_avg, opt.exp_avg_sq) for a in kind)
    whole = state(AdamW(GPT(cfg).parameters()))
    per_rank = []
    for rank in range(dp):
        model = GPT(cfg)
        per_rank.append(state(DistributedAdamW(ShardedGradientBuckets(model.parameters(), FakeGroup(dp, rank),
                                                                      bucket_size=4000))))
    padding = 2 * 8 * dp * 4 * len(ShardedGradientBuckets(GPT(cfg).parameters(), FakeGroup(dp, 0), 4000).buckets)
    assert len(set(per_rank)) == 1
    assert whole / dp <= per_rank[0] <= whole / dp + padding
    from npmegatron.perf.memory import ParallelShape, memory_plan
    planned = memory_plan(cfg, ParallelShape(dp=dp, seq=32, global_batch=dp, distributed_optimizer=True))
    assert planned["ranks"][0]["optimizer"] == pytest.approx(per_rank[0], abs=padding)


def test_blocks_cover_every_parameter_once():
    from npmegatron.data_parallel.distributed_optimizer import ShardedGradientBuckets
    from npmegatron.model import GPT, GPTConfig
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    covered = {}
    for rank in range(3):
        model = GPT(cfg)
        buckets = ShardedGradientBuckets(model.parameters(), FakeGroup(3, rank), bucket_size=5000,
                                         alone=[model.wte.weight])
        assert [b.params for b in buckets.buckets if model.wte.weight in b.params] == [[model.wte.weight]]
        names = {id(p): n for n, p in model.named_parameters()}
        for p, mine, _ in buckets.segments()[0]:
            covered.setdefault(names[id(p)], []).append((mine.start, mine.stop))
    for name, p in GPT(cfg).named_parameters():
        spans = sorted(covered[name])
        assert spans[0][0] == 0 and spans[-1][1] == p.data.size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.slow
def test_resumes_bitwise_and_at_another_dp_size(tmp_path):
    reference = train(tmp_path, "whole", 2, DISTRIBUTED)
    saved = tmp_path / "ckpt"
    first = train(tmp_path, "first", 2, DISTRIBUTED + ["--exit-interval", "10", "--save", str(saved)])
    np.testing.assert_array_equal(first, reference[:10])
    resumed = train(tmp_path, "resumed", 2, DISTRIBUTED + ["--load", str(saved)])
    np.testing.assert_array_equal(resumed, reference[10:])
    # Saved at DP = 2 by the distributed optimizer: loaded at DP = 4 with it, and at DP = 1 without.
    assert_close(train(tmp_path, "dp4", 4, DISTRIBUTED + ["--load", str(saved)]), reference[10:])
    assert_close(train(tmp_path, "dp1", 0, ["--load", str(saved)]), reference[10:])
    # Saved by plain DP = 4, loaded by the distributed optimizer at DP = 2.
    plain = tmp_path / "plain"
    train(tmp_path, "plain-first", 4, ["--exit-interval", "10", "--save", str(plain)])
    assert_close(train(tmp_path, "plain-resumed", 2, DISTRIBUTED + ["--load", str(plain)]), reference[10:])


def test_resume_quick(tmp_path):
    """The same at DP = 2 only (the quick loop's check)."""
    reference = train(tmp_path, "whole", 2, DISTRIBUTED + ["--train-iters", "6"])
    saved = tmp_path / "ckpt"
    train(tmp_path, "first", 2, DISTRIBUTED + ["--train-iters", "6", "--exit-interval", "3", "--save", str(saved)])
    resumed = train(tmp_path, "resumed", 2, DISTRIBUTED + ["--train-iters", "6", "--load", str(saved)])
    np.testing.assert_array_equal(resumed, reference[3:])
