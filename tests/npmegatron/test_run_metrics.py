"""What `train` measures besides the loss: the step's phases (--timing-log-level 1) adding up to
the step, throughput per rank and model-FLOP utilisation against a peak (--peak-tflops, or measured
at start), and measured peak memory beside the plan's prediction (--log-memory)."""
import json

import numpy as np
import pytest

from npmegatron.autograd import InputError
from npmegatron.model import GPT, GPTConfig
from npmegatron.timers import PHASES, Timers
from npmegatron.training import TrainConfig, train

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, micro_batch_size=4, lr=3e-3,
             lr_warmup_iters=1, train_iters=8, log_interval=4, eval_interval=4, eval_iters=1, sample_tokens=0)


def records(tmp_path, **options):
    said = []
    train(TrainConfig.from_flat(**SMALL, log_file=str(tmp_path / "log.jsonl"), **options), echo=said.append)
    return [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()], said


def test_phases_are_in_every_interval_and_add_up_to_the_step(tmp_path):
    logged, said = records(tmp_path, timing_log_level=1)
    for record in logged:
        assert set(record["phases_s"]) == set(PHASES)
        # phases (max over ranks; one rank here: max = min) plus what no phase covers are the step
        step_s = SMALL["micro_batch_size"] * SMALL["seq_length"] / record["tokens_per_s"]
        total = sum(high for high, _ in record["phases_s"].values()) + record["other_s"]
        assert total == pytest.approx(step_s, rel=1e-6)
        assert record["phases_s"]["forward-compute"][0] > 0 and record["phases_s"]["backward-compute"][0] > 0
        assert all(high == low for high, low in record["phases_s"].values())
    assert sum("phases ms/step (max/min over ranks): forward-compute" in line for line in said) == 2


def test_throughput_per_rank_and_utilisation_against_a_given_peak(tmp_path):
    logged, said = records(tmp_path, peak_tflops=0.5)
    for record in logged:
        assert record["tflops_per_rank"] == record["tflops"]            # one rank
        assert record["mfu"] == pytest.approx(record["tflops_per_rank"] / 0.5)
    assert any("model-FLOP utilisation against 0.5 TFLOP/s per rank (--peak-tflops)" in line for line in said)
    logged, said = records(tmp_path)
    assert all(0 < record["mfu"] < 1 for record in logged)              # against a product measured at start


def test_memory_is_reported_at_the_first_interval_and_when_it_grows(tmp_path):
    logged, said = records(tmp_path, log_memory=True)
    first = logged[0]
    assert first["memory_bytes"] > 0 and first["memory_bytes_max"] == first["memory_bytes"]
    assert first["predicted_bytes"] > 0 and first["resident_bytes"] >= 0
    # the arrays held and what the steps add: near the plan's states and activations (which leave
    # out the autograd's Python objects and short-lived temporaries)
    assert 0.8 * first["predicted_bytes"] < first["memory_bytes"] < 2 * first["predicted_bytes"], first
    assert all("memory_bytes" not in r or r["memory_bytes_max"] > first["memory_bytes_max"] for r in logged[1:])
    assert any(line.startswith("memory (the arrays held and the steps' traced peak on top)") for line in said)


def test_level_2_times_the_training_steps_layers_not_evaluations():
    """The phases time the training steps only, so the layers they are held against must too: an
    evaluation's forward (run before the interval is logged) is not counted."""
    model = GPT(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32,
                          max_position_embeddings=8, hidden_dropout=0.0, attention_dropout=0.0))
    timers = Timers()
    model.blocks[0].layer_timers = timers
    ids = np.zeros((1, 8), np.int64)
    model(ids)
    model.eval()
    model(ids)
    assert timers("layer 0 forward").count == 1


@pytest.mark.quick_variants("None")
@pytest.mark.parametrize("recompute", [None, "full"])
def test_each_layers_forward_and_backward_at_level_2(tmp_path, recompute):
    """Level 2 adds each layer's times, inside the phases that hold them; under full recomputation
    a layer's recomputed forward runs in the backward and counts in both."""
    extra = {"recompute_granularity": recompute} if recompute else {}
    logged, said = records(tmp_path, timing_log_level=2, **extra)
    for record in logged:
        layers = record["layers_s"]
        assert sorted(layers) == ["0", "1"] and all(forward > 0 and backward > 0 for forward, backward in layers.values())
        forward = record["phases_s"]["forward-compute"][0] + record["phases_s"]["tp-comm"][0]
        backward = record["phases_s"]["backward-compute"][0] + record["phases_s"]["tp-comm"][0]
        assert sum(f for f, _ in layers.values()) <= (backward + forward if recompute else forward)
        assert sum(b for _, b in layers.values()) <= backward
    assert sum(line.startswith("layers ms/step, forward/backward (max over ranks): 0 ") for line in said) == 2
    logged, _ = records(tmp_path, timing_log_level=1)
    assert "layers_s" not in logged[0]


def test_an_unknown_timing_level_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(InputError, match="--timing-log-level 3 is not a level; use 0"):
        records(tmp_path, timing_log_level=3)
