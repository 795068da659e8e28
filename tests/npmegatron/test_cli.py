"""The command line as a user meets it: --help everywhere, one-line errors, the step benchmark."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "npmegatron.cli"]


def run(args, timeout=120):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("command", [[], ["train"], ["bench"], ["bench", "step"], ["bench", "comm"]], ids=str)
def test_every_command_has_help(command):
    result = run(CLI + command + ["--help"])
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout


def test_console_script_and_train_script_have_help():
    script = os.path.join(os.path.dirname(sys.executable), "npmegatron")
    assert run([script, "--help"]).returncode == 0
    result = run([sys.executable, "scripts/train.py", "--help"])
    assert result.returncode == 0 and "--num-attention-heads" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--hidden-size", "100", "--num-attention-heads", "3"],
     "hidden size 100 is not divisible by 3 attention heads"),
    (["--seq-length", "300", "--max-position-embeddings", "256"],
     "--seq-length 300 is longer than the position table"),
    (["--train-iters", "0"], "--train-iters is 0; it must be a positive integer"),
], ids=["heads", "positions", "iters"])
def test_bad_input_is_one_sentence_and_non_zero_exit(args, message):
    result = run([sys.executable, "scripts/train.py"] + args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_bench_step_reports_a_ratio_to_the_measured_gemm_ceiling():
    result = run(CLI + ["bench", "step", "--num-layers", "1", "--hidden-size", "32",
                        "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
                        "--warmup", "1", "--iters", "2"])
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("step_s", "model_flops_per_s", "gemm_flops_per_s", "ratio"):
        assert record[key] > 0
    assert record["ratio"] == pytest.approx(record["model_flops_per_s"] / record["gemm_flops_per_s"])
    assert "GEMM FLOP/s at the model's shapes" in result.stdout
