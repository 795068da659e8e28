"""`npmegatron evaluate`: a checkpoint's validation and test loss and perplexity, per token and per
byte, without training: by default on the saving run's data and evaluation batches, so the
validation loss is the one its last evaluation printed; --split's third part is the test part;
any layout under mpirun."""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, mpiexec_path, rank_environment
from npmegatron.autograd import InputError
from npmegatron.training import TrainConfig, train
from npmegatron.training.evaluate import evaluate_checkpoint, evaluation_config

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2, lr=3e-3,
             lr_warmup_iters=1, train_iters=4, log_interval=4, eval_interval=4, eval_iters=2, sample_tokens=0)


def trained(tmp_path, **options):
    log = tmp_path / "log.jsonl"
    train(TrainConfig.from_flat(**SMALL, save=str(tmp_path / "ck"), log_file=str(log), **options),
          echo=lambda *a: None)
    last = [json.loads(line) for line in log.read_text().splitlines() if "val_loss" in line][-1]
    return str(tmp_path / "ck"), last["val_loss"]


def test_the_validation_loss_is_the_one_the_run_printed_at_its_last_evaluation(tmp_path):
    folder, printed = trained(tmp_path)
    result = evaluate_checkpoint(evaluation_config(folder))
    assert result["iteration"] == 4 and result["test"] is None
    valid = result["validation"]
    assert valid["loss"] == pytest.approx(printed, abs=1e-6)
    # byte-level tokens: a byte a token; 2 global batches of 2 sequences of 16 predicted tokens
    assert valid["tokens"] == valid["bytes"] == 64 and valid["perplexity"] == pytest.approx(2.718281828 ** valid["loss"])


def test_split_gives_a_test_part_and_losses_per_byte(tmp_path):
    from npmegatron.data.preprocessing import preprocess
    os.makedirs(tmp_path / "docs")
    for i in range(40):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(f"document {i}: " + "é and ascii " * (5 + i % 7))
    preprocess([str(tmp_path / "docs")], str(tmp_path / "text"))
    folder, printed = trained(tmp_path, data_path=str(tmp_path / "text"), split="80,10,10")
    result = evaluate_checkpoint(evaluation_config(folder))
    assert result["validation"]["loss"] == pytest.approx(printed, abs=1e-6)
    test = result["test"]
    assert test is not None and test["loss"] != result["validation"]["loss"] and test["tokens"] == 64
    assert test["loss_per_byte"] == pytest.approx(test["loss"] * test["tokens"] / test["bytes"])


@pytest.mark.parametrize("options, message", [
    ({"load": None}, "evaluate needs the checkpoint to evaluate; pass --load DIR"),
    ({"load": "{tmp}/empty"}, "--load {tmp}/empty holds no checkpoint"),
])
def test_without_a_checkpoint_it_says_so(tmp_path, options, message):
    os.makedirs(tmp_path / "empty")
    load = options["load"] and options["load"].format(tmp=tmp_path)
    with pytest.raises(InputError, match=message.format(tmp=tmp_path)):
        evaluation_config(load)


def test_a_bad_flag_is_named_before_the_checkpoint_is_looked_for(tmp_path):
    with pytest.raises(InputError, match="micro_batch_size is 0; it must be a positive integer"):
        evaluation_config(str(tmp_path / "missing"), micro_batch_size=0)
    with pytest.raises(InputError, match="eval_iters is 0"):
        evaluation_config(None, eval_iters=0)


@pytest.mark.slow
def test_at_another_layout_under_mpirun(tmp_path):
    folder, printed = trained(tmp_path)
    result = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "npmegatron.cli", "evaluate", "--load",
                             folder, "--tp", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=rank_environment())
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["validation"]["loss"] == pytest.approx(printed, rel=1e-5)


@pytest.mark.slow
def test_the_command_prints_a_summary_and_json(tmp_path):
    folder, printed = trained(tmp_path)
    run = subprocess.run([sys.executable, "-m", "npmegatron.cli", "evaluate", "--load", folder], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "validation: loss" in run.stdout and json.loads(run.stdout.strip().splitlines()[-1])["validation"]
