"""The command line as a user meets it: --help everywhere, one-line errors, the step benchmark."""
import json
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "npmegatron.cli"]


def run(args, timeout=120):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.quick_variants(first=2)
@pytest.mark.parametrize("command", [[], ["train"], ["preprocess"], ["train-tokenizer"], ["generate"], ["evaluate"], ["bench"],
                                     ["bench", "step"], ["bench", "comm"]], ids=str)
def test_every_command_has_help(command):
    result = run(CLI + command + ["--help"])
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout


@pytest.mark.slow
def test_console_script_and_train_script_have_help():
    script = os.path.join(os.path.dirname(sys.executable), "npmegatron")
    assert run([script, "--help"]).returncode == 0
    result = run([sys.executable, "scripts/train.py", "--help"])
    assert result.returncode == 0 and "--num-attention-heads" in result.stdout


@pytest.mark.quick_variants("lr", "iters")
@pytest.mark.parametrize("args,message", [
    (["--hidden-size", "100", "--num-attention-heads", "3"],
     "hidden size 100 is not divisible by 3 attention heads"),
    (["--seq-length", "300", "--max-position-embeddings", "256"],
     "--seq-length 300 is longer than the position table"),
    (["--train-iters", "0"], "--train-iters is 0; it must be a positive integer"),
    (["--lr", "-1"], "--lr is -1.0; the learning rate must be positive"),
    (["--tp", "2"], "--tp 2 x --pp 1 needs 2 ranks; launch with mpirun -n 2"),
], ids=["heads", "positions", "iters", "lr", "tp-without-mpirun"])
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
    # Each timed step is paired with the round of GEMMs timed right after it; the ratio is their median.
    steps, rounds = record["steps_s"], record["gemm_rounds_s"]
    gemm_flops = record["gemm_flops_per_s"] * statistics.median(rounds)
    assert len(steps) == len(rounds) == 2
    assert record["ratios"] == pytest.approx([record["model_flops_per_step"] / step / (gemm_flops / gemm_s)
                                              for step, gemm_s in zip(steps, rounds)])
    assert record["ratio"] == pytest.approx(statistics.median(record["ratios"]))
    assert "GEMM FLOP/s at the model's shapes" in result.stdout
    assert record["tokens_per_s"] == pytest.approx(2 * 16 / record["step_s"])
    assert record["peak_bytes"] > 0 and record["device_name"] == "cpu" and record["precision"] == "fp32"
    assert record["attention"].startswith("blockwise")


def test_bench_step_model_presets_and_the_peak_table():
    from npmegatron.perf.peaks import peak_flops
    from npmegatron.config import MODEL_PRESETS
    assert MODEL_PRESETS["gpt2-124m"] == {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                                          "seq_length": 1024, "vocab_size": 50304}
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA H200", "tf32") == 494.5e12 and peak_flops("Tesla V100-SXM2-16GB", "bf16") is None
    assert peak_flops("a GPU nobody listed", "fp32") is None
    result = run(CLI + ["bench", "step", "--model", "gpt2-124m", "--num-layers", "2"])
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "--model gpt2-124m sets --num-layers; give either the preset or those flags" in lines[0]


@pytest.mark.slow
def test_preprocess_train_on_it_then_generate(tmp_path):
    """The user's path: own text -> token file -> training with checkpoints -> generated text."""
    (tmp_path / "docs").mkdir()
    for i in range(4):
        (tmp_path / "docs" / f"{i}.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    prep = run(CLI + ["preprocess", str(tmp_path / "docs"), "--output", str(tmp_path / "fox")])
    assert prep.returncode == 0, prep.stderr
    assert "tokens (uint8) from 4 documents, vocabulary 256" in prep.stdout
    train = run([sys.executable, "scripts/train.py", "--data-path", str(tmp_path / "fox"),
                 "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                 "--seq-length", "32", "--micro-batch-size", "8", "--train-iters", "60", "--lr", "1e-2",
                 "--lr-warmup-iters", "5", "--log-interval", "20", "--eval-interval", "60",
                 "--eval-iters", "1", "--save", str(tmp_path / "ck"), "--sample-tokens", "20"])
    assert train.returncode == 0, train.stderr
    assert train.stderr == ""          # no progress bar when stderr is not a terminal
    assert f"data {tmp_path / 'fox'}" in train.stdout and "sample (" in train.stdout
    final = [l for l in train.stdout.splitlines() if l.startswith("iter    60/60")][0]
    assert float(final.split("val loss")[1]) < 2.0               # it learned the sentence
    gen = run(CLI + ["generate", "--load", str(tmp_path / "ck"), "--prompt", "the quick brown",
                     "--max-tokens", "10", "--temperature", "0"])
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("the quick brown") and len(gen.stdout.strip()) == len("the quick brown") + 10
    again = run(CLI + ["generate", "--load", str(tmp_path / "ck"), "--prompt", "the quick brown",
                       "--max-tokens", "10", "--temperature", "0"])
    assert again.stdout == gen.stdout                             # greedy is deterministic


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "a.txt").write_text("the quick brown fox. " * 50)
    assert run(CLI + ["preprocess", str(folder / "a.txt"), "--output", str(folder / "fox")]).returncode == 0
    train = run([sys.executable, "scripts/train.py", "--data-path", str(folder / "fox"), "--num-layers", "1",
                 "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
                 "--micro-batch-size", "2", "--train-iters", "1", "--eval-iters", "1", "--sample-tokens", "0",
                 "--save", str(folder / "ck")])
    assert train.returncode == 0, train.stderr
    return str(folder / "ck")


@pytest.mark.quick_variants("inf")
@pytest.mark.parametrize("args,message", [
    (["--temperature", "nan"], "temperature nan must be a finite number >= 0"),
    (["--temperature", "inf"], "temperature inf must be a finite number >= 0"),
    (["--prompt", b"\xff\xfe"], "--prompt is not UTF-8 text"),
], ids=["nan", "inf", "not-utf8"])
def test_bad_generate_input_is_one_sentence(tiny_checkpoint, args, message):
    command = CLI + ["generate", "--load", tiny_checkpoint, "--prompt", "the", "--max-tokens", "3"] + args
    result = subprocess.run(command, capture_output=True, timeout=120, cwd=ROOT)
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode != 0 and "Traceback" not in stderr
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], stderr


def test_generate_from_a_prompts_file_several_samples_past_the_positions(tiny_checkpoint, tmp_path):
    (tmp_path / "prompts.txt").write_text("the quick\n\nbrown fox\n")
    result = run(CLI + ["generate", "--load", tiny_checkpoint, "--prompts-file", str(tmp_path / "prompts.txt"),
                        "--num-samples", "2", "--max-tokens", "20", "--top-p", "0.9"])
    assert result.returncode == 0, result.stderr
    samples = result.stdout.split("-" * 40 + "\n")[1:]
    assert len(samples) == 4 and [s[:9] for s in samples] == ["the quick", "the quick", "brown fox", "brown fox"]
    assert all(len(s.rstrip("\n").encode()) >= 9 + 20 for s in samples[:2])   # 20 new bytes past 16 positions
    assert samples[0] != samples[1]                                              # seeds 0 and 1
    assert result.stderr.count("note: the model holds 16 positions") == 1


@pytest.mark.quick_variants("top-p")
@pytest.mark.parametrize("args,message", [
    ([], "generate needs a prompt: give --prompt TEXT or --prompts-file FILE"),
    (["--prompt", "a", "--prompts-file", "x.txt"], "generate needs a prompt: give --prompt TEXT or --prompts-file"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "cannot read --prompts-file /nonexistent/prompts.txt"),
    (["--prompt", "a", "--top-p", "1.5"], "top-p 1.5 must be in (0, 1]"),
], ids=["none", "both", "missing", "top-p"])
def test_bad_prompts_are_one_sentence(tiny_checkpoint, args, message):
    result = run(CLI + ["generate", "--load", tiny_checkpoint, "--max-tokens", "3"] + args)
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert result.returncode != 0 and len(lines) == 1 and message in lines[0], result.stderr


def test_bench_comm_without_ranks_launches_two():
    from helpers import rank_environment
    result = subprocess.run(CLI + ["bench", "comm", "--max-bytes", "4096"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=rank_environment())
    assert result.returncode == 0, result.stderr
    assert "alpha-beta fit on 2 ranks" in result.stdout
    assert json.loads(result.stdout.strip().splitlines()[-1])["ranks"] == 2


@pytest.mark.parametrize("ranks,command,message", [
    (1, ["bench", "comm", "--max-bytes", "4096"], "bench comm runs on 1 rank but measures traffic between ranks"),
    (2, ["bench", "step", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "16", "--micro-batch-size", "2", "--warmup", "1", "--iters", "1"],
     "bench step times one process, but mpirun started 2 ranks; run it without mpirun"),
], ids=["comm-on-one-rank", "step-on-two-ranks"])
def test_bench_on_the_wrong_number_of_ranks_says_so_once(ranks, command, message):
    from helpers import mpiexec_path, rank_environment
    result = subprocess.run([mpiexec_path(), "-n", str(ranks)] + CLI + command, capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=rank_environment())
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output
    assert output.count(message) == 1 and "GEMM" not in output, output
