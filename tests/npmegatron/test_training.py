"""Optimizer, schedule and a short real training run on the embedded corpus."""
import math

import numpy as np
import pytest

from npmegatron.autograd import Tensor
from npmegatron.autograd.backend import to_numpy
from npmegatron.optim.adamw import AdamW, clip_gradients, grad_norm_squared, learning_rate
from npmegatron.training import TrainConfig, train


def test_learning_rate_warmup_then_cosine_to_minimum():
    """Megatron's steps: the first update at the warmup's start (0 by default), the peak at update
    11 (step 10) of a 10-step warmup, then down to the minimum at the decay's end."""
    lrs = [learning_rate(s, 1.5e-4, 1e-5, 10, 100) for s in range(101)]
    assert lrs[0] == 0 and lrs[1] == pytest.approx(1.5e-5) and lrs[10] == pytest.approx(1.5e-4)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[100] == pytest.approx(1e-5) and learning_rate(101, 1.5e-4, 1e-5, 10, 100) == 1e-5
    assert learning_rate(0, 1.5e-4, 1e-5, 10, 100, init_lr=1e-6) == 1e-6


def test_adamw_matches_the_formula_and_skips_decay_on_1d():
    w = Tensor(np.array([[1.0, -2.0]]), requires_grad=True)
    b = Tensor(np.array([0.5]), requires_grad=True)
    w.grad, b.grad = np.array([[0.1, 0.2]]), np.array([0.3])
    AdamW([w, b], lr=0.1, weight_decay=0.5).step()
    # first step: m/sqrt(v) with bias correction is sign(g); decay only on the matrix
    np.testing.assert_allclose(w.data, np.array([[1.0, -2.0]]) * (1 - 0.05) - 0.1, rtol=1e-6)
    np.testing.assert_allclose(b.data, [0.5 - 0.1], rtol=1e-6)


def clip_grad_norm(params, max_norm, group=None, skip=()):
    """Scale all gradients so their global L2 norm is at most max_norm; returns the norm before
    (reading it is one host synchronisation on a GPU)."""
    norm = math.sqrt(float(to_numpy(grad_norm_squared(params, group, skip))[0]))
    clip_gradients(params, norm, max_norm)
    return norm


def test_clip_grad_norm():
    a = Tensor(np.ones(4), requires_grad=True)
    a.grad = np.full(4, 3.0)
    assert clip_grad_norm([a], 1.0) == pytest.approx(6.0)
    assert math.sqrt((a.grad ** 2).sum()) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.slow
def test_training_on_the_embedded_corpus_lowers_the_loss(tmp_path):
    args = TrainConfig.from_flat(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=64,
                     micro_batch_size=8, train_iters=60, lr=3e-3, lr_warmup_iters=10,
                     log_interval=20, eval_interval=60, eval_iters=2,
                     log_file=str(tmp_path / "metrics.jsonl"))
    lines = []
    losses = train(args, echo=lines.append)
    assert losses[0] > 4.5
    assert np.mean(losses[-10:]) < 3.3
    records = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 3 and '"val_loss"' in records[-1]


def test_setup_objects_are_frozen_while_steps_run_and_released_after():
    import gc
    from npmegatron.training.step import setup_objects_frozen
    before = gc.get_freeze_count()
    with setup_objects_frozen():
        assert gc.get_freeze_count() > before
        cycle = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1        # what the steps create is still collected
    assert gc.get_freeze_count() == 0
