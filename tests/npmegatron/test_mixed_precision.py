"""--fp16 and --bf16 (autograd/precision.py, optim/loss_scale.py): Megatron's loss-scaling
rules, float32 master weights behind 16-bit parameters, a planted overflow skipped with the scale
halved (also when only one tensor-parallel rank overflows), pipeline stages that round as the
serial model does, and checkpoints that resume bitwise with the masters and the scaler."""
import json

import numpy as np
import pytest

from helpers import launch, launch_logged, run_ranks
from npmegatron.autograd import precision
from npmegatron.training import TrainConfig
from npmegatron.optim.loss_scale import DynamicLossScale, LossScale
from npmegatron.training.trainer import Trainer

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, micro_batch_size=4,
             lr=3e-3, lr_warmup_iters=2, log_interval=1, eval_interval=100, eval_iters=1, sample_tokens=0)


def test_dynamic_scale_follows_megatrons_rules():
    scale = DynamicLossScale(initial_scale=2.0 ** 10, min_scale=2.0 ** 8, window=3, hysteresis=2)
    scale.update(True)
    assert scale.scale == 2.0 ** 10                  # the first overflow is absorbed (hysteresis 2)
    scale.update(True)
    assert scale.scale == 2.0 ** 9
    scale.update(True)                               # hysteresis is not restored by overflows
    assert scale.scale == 2.0 ** 8
    scale.update(True)
    assert scale.scale == 2.0 ** 8                   # never below the minimum
    for _ in range(2):
        scale.update(False)
    scale.update(True)                               # the window restarts after an overflow
    for _ in range(3):
        scale.update(False)
    assert scale.scale == 2.0 ** 9 and scale.overflows_left == 2
    fixed = LossScale(128.0)
    fixed.update(True)
    assert fixed.scale == 128.0


def trainer(**options):
    return Trainer(TrainConfig.from_flat(**{**SMALL, **options}))


def on_grid(a, fmt):
    return np.array_equal(a, precision.round_(a.copy(), fmt))


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_parameters_are_16_bit_and_the_masters_float32(fmt):
    scale = {"initial_loss_scale": 1024.0} if fmt == "fp16" else {}
    t = trainer(train_iters=8, **{fmt: True}, **scale)
    for _ in range(8):
        t.step()
    assert t.optimizer.step_count == 8
    for p, master in zip(t.params, t.optimizer.master):
        assert on_grid(p.data, fmt)
        np.testing.assert_array_equal(p.data, precision.round_(master.copy(), fmt))
    assert any(not on_grid(m, fmt) for m in t.optimizer.master)
    assert (t.loss_scale is None) == (fmt == "bf16")       # bf16 is not scaled (Megatron's default)


def plant_overflow(monkeypatch, at_iteration, rank_filter=lambda t: True):
    """Make one gradient inf after the training step of `at_iteration`."""
    from npmegatron.training import trainer as trainer_module
    original = trainer_module.train_step

    def planted(model, *args, **kwargs):
        loss = original(model, *args, **kwargs)
        if model.rng.iteration == at_iteration and rank_filter(model):
            model.parameters()[0].grad[...] = np.inf
        return loss
    monkeypatch.setattr(trainer_module, "train_step", planted)


def test_a_planted_overflow_is_skipped_and_halves_the_scale(monkeypatch):
    t = trainer(train_iters=10, fp16=True, initial_loss_scale=2.0 ** 12, hysteresis=1)
    plant_overflow(monkeypatch, at_iteration=5)
    for _ in range(5):
        t.step()
    assert t.skipped == 0 and t.loss_scale.scale == 2.0 ** 12
    before = [p.data.copy() for p in t.params] + [m.copy() for m in t.optimizer.master]
    steps = t.optimizer.step_count
    loss, norm, _ = t.step()
    assert np.isfinite(loss) and not np.isfinite(norm)
    assert t.skipped == 1 and t.iteration == 6 and t.optimizer.step_count == steps
    assert t.loss_scale.scale == 2.0 ** 11
    after = [p.data for p in t.params] + t.optimizer.master
    assert all(np.array_equal(a, b) for a, b in zip(before, after))       # nothing applied
    t.step()
    assert t.optimizer.step_count == steps + 1 and t.loss_scale.scale == 2.0 ** 11


def test_without_loss_scaling_an_overflow_stops_training(monkeypatch):
    from npmegatron.training.trainer import TrainingDiverged
    t = trainer(train_iters=4, bf16=True)
    plant_overflow(monkeypatch, at_iteration=1)
    t.step()
    with pytest.raises(TrainingDiverged, match="gradient norm became"):
        t.step()


@pytest.mark.slow
def test_the_first_steps_lower_the_scale_from_two_to_the_32(tmp_path):
    """The default initial scale overflows float16 at once: those steps are skipped and logged."""
    log = tmp_path / "log.jsonl"
    result = launch(0, ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                        "--seq-length", "32", "--micro-batch-size", "4", "--train-iters", "40",
                        "--log-interval", "10", "--eval-interval", "40", "--eval-iters", "1",
                        "--lr-warmup-iters", "5", "--sample-tokens", "0", "--fp16", "--log-file", str(log)])
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in open(log)]
    assert "loss scale" in result.stdout and "skipped" in result.stdout
    first, last = records[0], records[-1]
    assert first["skipped_iterations"] >= 2 and first["loss_scale"] < 2.0 ** 32
    assert last["loss"] < first["loss"] and np.isfinite(last["grad_norm"])


def test_one_overflowing_tensor_parallel_rank_makes_every_rank_skip():
    result = run_ranks(2, "ranks/mixed_precision.py", timeout=180)
    assert "both ranks skipped iteration 3" in result.stdout, result.stdout + result.stderr


RUN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8", "--log-interval", "1",
       "--eval-interval", "8", "--eval-iters", "1", "--lr-warmup-iters", "2", "--sample-tokens", "0",
       "--hidden-dropout", "0.1", "--initial-loss-scale", "1024", "--loss-scale-window", "3"]


def run(tmp_path, name, ranks, extra):
    """The run's log records without their timings."""
    records = launch_logged(ranks, RUN + extra, tmp_path / f"{name}.jsonl")
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "tflops", "tflops_per_rank", "mfu", "iteration_s")} for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["--fp16", "--bf16"])
def test_pipeline_stages_round_as_the_serial_model(tmp_path, fmt):
    """Untied, a stage boundary changes no rounding: the losses are equal bit for bit. Tied, the
    shared weight's float32 gradient is summed in another order (serial: the output layer's GEMM, then
    the embedding's rows scattered onto it; two stages: each part alone, then their all-reduce), so
    from the step where one master weight's last bit moves a 16-bit copy the losses drift apart by
    float32's summation error grown over the steps left (1.5e-6 relative measured at the last of 8
    steps with OpenBLAS), held to 1e-5: far inside one 16-bit rounding's effect (fp16's step is
    2^-11, 4.9e-4)."""
    untie = ["--untie-embeddings-and-output-weights"]
    serial = run(tmp_path, "serial", 0, [fmt] + untie)
    staged = run(tmp_path, "pp2", 2, [fmt, "--pp", "2"] + untie)
    assert [r["loss"] for r in staged] == [r["loss"] for r in serial]
    serial_tied = run(tmp_path, "serial-tied", 0, [fmt])
    staged_tied = run(tmp_path, "pp2-tied", 2, [fmt, "--pp", "2"])
    np.testing.assert_allclose([r["loss"] for r in staged_tied], [r["loss"] for r in serial_tied], rtol=1e-5)


@pytest.mark.parametrize("ranks, extra", [
    (0, []),
    pytest.param(2, ["--use-distributed-optimizer"], marks=pytest.mark.slow),
], ids=["serial", "distributed-optimizer-dp2"])
def test_resume_is_bitwise_with_masters_and_scaler(tmp_path, ranks, extra):
    whole = run(tmp_path, "whole", ranks, ["--fp16"] + extra)
    save = ["--fp16", "--save", str(tmp_path / "ck")] + extra
    first = run(tmp_path, "first", ranks, save + ["--exit-interval", "4"])
    second = run(tmp_path, "second", ranks, save + ["--load", str(tmp_path / "ck"), "--overwrite"])
    assert first + second == whole
    assert whole[-1]["loss_scale"] != 1024.0          # the scale moved, and resumed where it was


def test_the_plan_and_the_header_count_16_bit_weights_with_float32_gradients_and_masters():
    from npmegatron.perf.memory import ParallelShape, rank_memory
    from npmegatron.model import GPTConfig
    layout = ParallelShape(dp=2, global_batch=2, distributed_optimizer=True)
    plain = rank_memory(GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4), layout, 0)
    mixed = rank_memory(GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, bf16=True), layout, 0)
    n = mixed["parameter_count"]
    assert (mixed["parameters"], mixed["gradients"], mixed["optimizer"]) == (2 * n, 4 * n, 12 * n / 2)
    assert mixed["activations"] < 0.6 * plain["activations"]
    from npmegatron.training.log import memory_note
    note = memory_note(trainer(train_iters=1, bf16=True))
    assert note.startswith("memory: 2 B weight + 4 B gradient + 12 B AdamW state (2 moments + float32 master)")
