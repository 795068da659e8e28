"""Activation recomputation (--recompute-granularity/-method/-num-layers): bitwise the same losses
and gradients as without it, serially and at TP = 2 x PP = 2 with SP and dropout under every
schedule; the bytes kept for backward against the formula; bad combinations refused."""
import dataclasses
import json
import re

import numpy as np
import pytest

from npmegatron.autograd import InputError
from npmegatron.autograd.memory import saved_bytes_by_function
from npmegatron.perf.memory import ParallelShape, layer_activation_bytes
from npmegatron.config import GPTConfig, TrainConfig
from npmegatron.model import GPT
from npmegatron.recompute import recompute_segments

VARIANTS = [dict(recompute_granularity="full"),
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
            dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
            dict(recompute_granularity="selective")]


def small(dtype="float64", **extra):
    return GPTConfig(**{**dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64,
                               max_position_embeddings=16, hidden_dropout=0.1, attention_dropout=0.1,
                               dtype=dtype), **extra})


def loss_and_grads(cfg, ids):
    model = GPT(cfg)
    model.rng.iteration = 3
    _, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.data, [p.grad for p in model.parameters()], model


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(str(x) for x in v.values()))
def test_serial_losses_and_gradients_are_bitwise_the_same(dtype, variant):
    ids = np.random.default_rng(0).integers(0, 64, (2, 17))
    loss, grads, _ = loss_and_grads(small(dtype), ids)
    loss2, grads2, _ = loss_and_grads(small(dtype, **variant), ids)
    assert np.array_equal(loss, loss2)
    assert all(np.array_equal(a, b) for a, b in zip(grads, grads2))


def test_segments_follow_megatrons_methods():
    full = dict(recompute_granularity="full")
    assert recompute_segments(small(), 4) == [(0, 4, False)]
    assert recompute_segments(small(**full), 4) == [(0, 1, True), (1, 2, True), (2, 3, True), (3, 4, True)]
    assert recompute_segments(small(**full, recompute_num_layers=2), 4) == [(0, 2, True), (2, 4, True)]
    assert recompute_segments(small(**full, recompute_method="block", recompute_num_layers=3), 4) == [
        (0, 1, True), (1, 2, True), (2, 3, True), (3, 4, False)]
    assert recompute_segments(small(**full, recompute_method="block", recompute_num_layers=9), 2) == [
        (0, 1, True), (1, 2, True)]
    assert recompute_segments(small(recompute_granularity="selective"), 4) == [(0, 4, False)]


def kept_bytes_per_layer(cfg, seq=16, batch=2):
    """What one more layer adds to the tape, parameters (which the tape references) not counted."""
    ids = np.random.default_rng(1).integers(0, 64, (batch, seq + 1))
    kept = []
    for layers in (2, 4):
        model = GPT(dataclasses.replace(cfg, num_layers=layers))
        _, loss = model(ids[:, :-1], ids[:, 1:])
        params = [p.data for p in model.parameters()]
        kept.append(sum(saved_bytes_by_function([loss], exclude=params).values()))
    return (kept[1] - kept[0]) / 2


def test_full_recomputation_keeps_one_layer_input_per_layer_or_chunk():
    """Measured tape bytes per layer against layer_activation_bytes (the plan's formula)."""
    base = small("float32", hidden_dropout=0.0, attention_dropout=0.0)
    s, b, h, w = 16, 2, 32, 4
    none = kept_bytes_per_layer(base)
    assert none == pytest.approx(layer_activation_bytes(base, ParallelShape(seq=s, micro_batch=b), w), rel=0.01)
    assert kept_bytes_per_layer(dataclasses.replace(base, recompute_granularity="selective")) == none
    full = kept_bytes_per_layer(dataclasses.replace(base, recompute_granularity="full"))
    assert full == s * b * h * w == layer_activation_bytes(base, ParallelShape(seq=s, micro_batch=b, recompute="full"), w)
    two = kept_bytes_per_layer(dataclasses.replace(base, recompute_granularity="full", recompute_num_layers=2))
    assert two == s * b * h * w / 2
    assert none > 10 * full


@pytest.mark.parametrize("flags, words", [
    (dict(recompute_method="uniform"), "add --recompute-granularity full"),
    (dict(recompute_num_layers=2), "add --recompute-granularity full"),
    (dict(recompute_granularity="selective", recompute_num_layers=2), "granularity is selective"),
    (dict(recompute_granularity="partial"), "not known"),
    (dict(recompute_granularity="full", recompute_method="ring"), "not known"),
    (dict(recompute_granularity="full", recompute_num_layers=0), "positive integer"),
])
def test_bad_combinations_are_one_sentence(flags, words):
    with pytest.raises(InputError, match=words):
        small(**flags)


def test_a_chunk_size_that_does_not_divide_a_stage_is_refused_before_building():
    config = TrainConfig.from_flat(num_layers=4, recompute_granularity="full", recompute_num_layers=3)
    with pytest.raises(InputError, match="does not divide the 4 layers of a pipeline stage"):
        config.plan(1)
    config = TrainConfig.from_flat(num_layers=4, recompute_granularity="full", recompute_num_layers=2,
                                   pipeline_model_parallel_size=2)
    config.plan(2)      # 2 layers per stage: divides
    with pytest.raises(InputError, match="does not divide"):
        GPT(small(recompute_granularity="full", recompute_num_layers=3))


def test_evaluation_and_generation_do_not_recompute():
    from npmegatron.autograd import no_grad
    from npmegatron.generation import generate
    cfg = small(recompute_granularity="full")
    model = GPT(cfg)
    ids = np.random.default_rng(2).integers(0, 64, (1, 5))
    with no_grad():
        logits, _ = model(ids)
    assert logits.grad_fn is None
    model.eval()
    assert generate(model, ids[0].tolist(), 3, temperature=0.0) == generate(GPT(small()).eval(), ids[0].tolist(), 3, temperature=0.0)


CASES = [{"schedule": schedule, "dtype": dtype, "recompute": variant, **extra}
         for schedule, extra in (("1f1b", {}), ("afab", {}), ("interleaved", {"virtual": 2}))
         for dtype in ("float64", "float32")
         for variant in ([dict(recompute_granularity="full"),
                          dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)]
                         + ([dict(recompute_granularity="full", recompute_num_layers=2)] if not extra else []))]


@pytest.mark.slow
def test_tp2_pp2_with_sp_and_dropout_every_schedule_is_bitwise_the_same(mpirun):
    result = mpirun(4, "ranks/recompute.py", args=[json.dumps(CASES)], timeout=600)
    assert f"cases passed {len(CASES)}" in result.stdout, result


def test_tp2_pp2_one_schedule_quick(mpirun):
    cases = [c for c in CASES if c["schedule"] == "1f1b" and c["dtype"] == "float32"][:1]
    assert cases[0]["recompute"] == dict(recompute_granularity="full")
    result = mpirun(4, "ranks/recompute.py", args=[json.dumps(cases)], timeout=300)
    assert "cases passed 1" in result.stdout, result
    # the recomputed forward runs its layer's TP collectives again: under SP 2 all-gathers and 2
    # reduce-scatters for each of rank 0's 2 layers, 4 micro-batches and 2 steps, what the plan
    # counts (time_model.step_time: 2 + 2 x again + 2 pairs a layer)
    plain, again = map(int, re.search(r"tp collectives on rank 0: (\d+) plain, (\d+) recomputing", result.stdout).groups())
    assert again - plain == 4 * 2 * 4 * 2, result.stdout


@pytest.mark.parametrize("variant", VARIANTS[1:3], ids=["uniform-2", "block-3"])
def test_plan_counts_the_segments_recompute_keeps(variant):
    """plan's chunk_activation_bytes against the tape: what layers 3 and 4 add under each method."""
    from npmegatron.perf.memory import chunk_activation_bytes
    cfg = small("float32", hidden_dropout=0.0, attention_dropout=0.0, **variant)
    layout = ParallelShape(seq=16, micro_batch=2, recompute="full", recompute_method=variant["recompute_method"],
                    recompute_num_layers=variant["recompute_num_layers"])
    planned = chunk_activation_bytes(cfg, layout, 4, 4)[0] - chunk_activation_bytes(cfg, layout, 4, 2)[0]
    assert 2 * kept_bytes_per_layer(cfg) == pytest.approx(planned, rel=0.01)
