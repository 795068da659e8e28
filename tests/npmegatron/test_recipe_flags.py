"""Megatron's recipe flags: the learning-rate schedules (WSD, inverse square root, a decay length
and a warmup fraction of it), AdamW's betas and epsilon, the MLP's size and the initialisation's
standard deviation, and what --load takes from a checkpoint (--no-load-optim, --no-load-rng,
--finetune)."""
import math

import numpy as np
import pytest

from npmegatron.autograd import InputError
from npmegatron.optim.adamw import learning_rate, scheduled_learning_rate
from npmegatron.training import TrainConfig
from npmegatron.training.trainer import Trainer

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2, lr=3e-3,
             min_lr=1e-4, lr_warmup_iters=2, log_interval=1, eval_interval=100, eval_iters=1, sample_tokens=0)


NO_WARMUP_ITERS = {k: v for k, v in SMALL.items() if k != "lr_warmup_iters"}


def test_wsd_holds_the_peak_then_decays_over_its_last_steps():
    lrs = [learning_rate(s, 1.0, 0.1, 10, 100, "WSD", 20, "linear") for s in range(101)]
    assert lrs[9] == pytest.approx(0.9) and all(lr == 1.0 for lr in lrs[10:81])     # warmup, then stable
    assert lrs[90] == pytest.approx(0.1 + 0.9 * 0.5) and lrs[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[80:], lrs[81:]))
    for style, middle in (("cosine", 0.5), ("exponential", 2 * 0.5 ** 0.5 - 1), ("minus_sqrt", 1 - 0.5 ** 0.5)):
        assert learning_rate(90, 1.0, 0.0, 10, 100, "WSD", 20, style) == pytest.approx(middle)


def test_inverse_square_root_decays_as_megatrons_and_not_below_the_minimum():
    assert learning_rate(10, 1.0, 0.01, 10, 100, "inverse-square-root") == pytest.approx(1.0)
    assert learning_rate(40, 1.0, 0.01, 10, 100, "inverse-square-root") == pytest.approx(math.sqrt(10 / 40))
    assert learning_rate(99, 1.0, 0.01, 10, 100, "inverse-square-root") == pytest.approx(math.sqrt(10 / 99))
    assert learning_rate(101, 1.0, 0.5, 10, 100, "inverse-square-root") == 0.5     # past the decay: the minimum


def test_decay_length_and_warmup_fraction():
    config = TrainConfig.from_flat(**NO_WARMUP_ITERS, train_iters=50, lr_decay_iters=40, lr_warmup_fraction=0.25)
    assert (config.decay_iters, config.warmup_iters) == (40, 10)
    assert scheduled_learning_rate(config, 10) == pytest.approx(3e-3)
    # not rounded to whole steps: a warmup of 1.5 steps peaks after the second update
    short = TrainConfig.from_flat(**NO_WARMUP_ITERS, train_iters=50, lr_warmup_fraction=0.03)
    assert short.warmup_iters == pytest.approx(1.5)
    assert scheduled_learning_rate(short, 1) == pytest.approx(3e-3 / 1.5) and scheduled_learning_rate(short, 2) < 3e-3
    assert scheduled_learning_rate(config, 40) == pytest.approx(1e-4) == scheduled_learning_rate(config, 49)


@pytest.mark.parametrize("options, message", [
    ({"lr_warmup_fraction": 0.1, "lr_warmup_iters": 5}, "--lr-warmup-fraction and --lr-warmup-iters both set"),
    ({"lr_decay_style": "WSD"}, "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    ({"lr_wsd_decay_iters": 5}, "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    ({"lr_decay_style": "WSD", "lr_wsd_decay_iters": 2000}, "--lr-wsd-decay-iters 2000 is longer than the decay"),
    ({"lr_warmup_fraction": 1.5, "lr_warmup_iters": 100}, "--lr-warmup-fraction is 1.5"),
    # Megatron's OptimizerParamScheduler asserts init_lr <= lr and warmup < decay
    ({"lr_warmup_fraction": 1.0, "lr_warmup_iters": 100}, "--lr-warmup-fraction is 1.0; .* below 1"),
    ({"lr_warmup_init": 0.01}, r"--lr-warmup-init 0.01 is above --lr 0.003, .*; lower it to at most 0.003"),
    ({"lr_warmup_iters": 40, "lr_decay_iters": 40}, "--lr-warmup-iters 40 is not shorter than --lr-decay-iters 40"),
    ({"lr_warmup_iters": 100, "lr_decay_iters": 50},
     r"--lr-warmup-iters 100 \(the default\) is not shorter than --lr-decay-iters 50"),
    ({"finetune": True}, "--finetune says what to take from the checkpoint --load names"),
    ({"no_load_optim": True}, "--no-load-optim says what to take"),
])
def test_schedule_and_load_flags_that_do_not_fit_are_one_sentence(options, message):
    with pytest.raises(InputError, match=message):
        TrainConfig.from_flat(**{**SMALL, **options})


def test_schedules_megatron_accepts_are_accepted():
    """The edges Megatron allows: a warmup starting at --lr, --min-lr equal to --lr, a warmup one
    step shorter than the decay, and a run all warmup whose decay is left at --train-iters (warned)."""
    TrainConfig.from_flat(**{**SMALL, "lr_warmup_init": 3e-3, "min_lr": 3e-3})
    TrainConfig.from_flat(**{**SMALL, "lr_warmup_iters": 39, "lr_decay_iters": 40})
    TrainConfig.from_flat(**{**SMALL, "lr_warmup_iters": 5, "train_iters": 2})
    TrainConfig.from_flat(**{**NO_WARMUP_ITERS, "train_iters": 20})


def test_adam_settings_mlp_size_and_initialisation_reach_the_run():
    trainer = Trainer(TrainConfig.from_flat(**SMALL, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6,
                                            ffn_hidden_size=48, init_method_std=0.05, train_iters=1))
    assert (trainer.optimizer.betas, trainer.optimizer.eps) == ((0.8, 0.95), 1e-6)
    shapes = {name: p.data.shape for name, p in trainer.model.named_parameters()}
    assert any(shape == (32, 48) for shape in shapes.values()) and any(shape == (48, 32) for shape in shapes.values())
    qkv = next(p.data for name, p in trainer.model.named_parameters() if name.endswith("qkv.weight"))
    assert qkv.std() == pytest.approx(0.05, rel=0.1)


def trained(tmp_path, steps=3):
    trainer = Trainer(TrainConfig.from_flat(**SMALL, train_iters=steps, save=str(tmp_path / "ck")))
    for _ in range(steps):
        trainer.step()
    trainer.save()
    trainer.close()
    return trainer


def test_finetune_starts_from_the_weights_alone_and_no_load_optim_keeps_the_iteration(tmp_path):
    source = trained(tmp_path)
    weights = {name: p.data.copy() for name, p in source.model.named_parameters()}
    tuned = Trainer(TrainConfig.from_flat(**SMALL, train_iters=5, load=str(tmp_path / "ck"), finetune=True,
                                          global_batch_size=4))
    assert tuned.iteration == 0 and tuned.optimizer.step_count == 0 and tuned.last_saved is None
    assert all(not np.any(m) for m in tuned.optimizer.exp_avg)
    for name, p in tuned.model.named_parameters():
        np.testing.assert_array_equal(p.data, weights[name])
    fresh = Trainer(TrainConfig.from_flat(**SMALL, train_iters=5, load=str(tmp_path / "ck"), no_load_optim=True))
    assert fresh.iteration == 3 and fresh.optimizer.step_count == 0
    assert all(not np.any(m) for m in fresh.optimizer.exp_avg_sq)
    resumed = Trainer(TrainConfig.from_flat(**SMALL, train_iters=5, load=str(tmp_path / "ck")))
    assert resumed.optimizer.step_count == 3 and any(np.any(m) for m in resumed.optimizer.exp_avg)


def test_one_job_script_starts_then_resumes_and_exits_before_a_time_limit(tmp_path):
    """The same command twice, `--load ck --save ck`: the first run finds no checkpoint and starts
    from scratch, stopping after its first iteration because --exit-duration-in-mins is over; the
    second resumes there."""
    from npmegatron.training import train
    folder = str(tmp_path / "ck")
    said = []
    first = train(TrainConfig.from_flat(**SMALL, train_iters=3, load=folder, save=folder, exit_duration_in_mins=0),
                  echo=said.append)
    assert len(first) == 1 and any("holds no checkpoint yet: training starts from scratch" in s for s in said)
    assert any("exiting at iteration 1: 0 minutes of training are over (--exit-duration-in-mins); saved in "
               in s for s in said), said
    said.clear()
    second = train(TrainConfig.from_flat(**SMALL, train_iters=3, load=folder, save=folder), echo=said.append)
    assert len(second) == 2 and any(f"resumed from {folder} at iteration 1" in s for s in said), said


def test_a_save_says_where_and_the_sample_marks_where_its_prompt_ends(tmp_path):
    from npmegatron.training import train
    from npmegatron.training.trainer import PROMPT_END
    said = []
    train(TrainConfig.from_flat(**{**SMALL, "sample_tokens": 8}, train_iters=2, save=str(tmp_path / "ck")),
          echo=said.append)
    assert f"saved iter_0000002 in {tmp_path / 'ck'}" in said
    sample = next(line for line in said if line.startswith("sample ("))
    assert sample.count(PROMPT_END) == 2        # named in the heading, then marking the place


def test_preprocess_makes_the_output_folder(tmp_path):
    from npmegatron.data.preprocessing import preprocess
    (tmp_path / "a.txt").write_text("hello world")
    preprocess([str(tmp_path / "a.txt")], str(tmp_path / "data" / "deeper" / "x"))
    assert (tmp_path / "data" / "deeper" / "x.bin").exists()
