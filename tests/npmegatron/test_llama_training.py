"""Training the Llama family and with context parallelism, end to end under mpiexec in float64:
every layout follows the serial trajectory (TP x CP, CP x DP, the distributed optimizer over
DP x CP), a checkpoint saved at one CP size resumes at another, and the result generates."""
import json

import pytest

from helpers import generate_from, launch

RUN = ["--model-family", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "32",
       "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "12", "--log-interval", "1",
       "--eval-interval", "12", "--eval-iters", "1", "--lr-warmup-iters", "3", "--lr", "3e-3",
       "--sample-tokens", "0", "--dtype", "float64"]


def losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


def train(tmp_path, name, ranks, extra=()):
    log = tmp_path / f"{name}.jsonl"
    run = launch(ranks, RUN + list(extra) + ["--log-file", str(log)], timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return losses(log), run


@pytest.mark.slow      # 5 s; the quick selection keeps test_context_parallel.py's equalities
def test_every_layout_follows_the_serial_trajectory(tmp_path):
    serial, _ = train(tmp_path, "serial", 0)
    assert len(serial) == 12 and serial[-1] < serial[0] - 0.5
    for name, ranks, extra in [("tp2cp2", 4, ["--tp", "2", "--cp", "2"]), ("cp2dp2", 4, ["--cp", "2"]),
                               ("cp2dp2-distributed", 4, ["--cp", "2", "--use-distributed-optimizer"])]:
        curve, run = train(tmp_path, name, ranks, extra)
        assert "CP(2)" in run.stdout
        assert curve == pytest.approx(serial, rel=1e-9, abs=0), name


@pytest.mark.slow
def test_checkpoint_resumes_at_another_context_parallel_size_and_generates(tmp_path):
    straight, run = train(tmp_path, "straight", 2, ["--cp", "2", "--sample-tokens", "8"])
    assert "sample (the first 32 validation tokens" in run.stdout     # each CP rank holds every weight
    first, _ = train(tmp_path, "first", 2, ["--cp", "2", "--save", str(tmp_path / "ck"), "--exit-interval", "6"])
    second, run = train(tmp_path, "second", 2, ["--tp", "2", "--load", str(tmp_path / "ck")])
    assert "resumed from" in run.stdout and "at iteration 6" in run.stdout
    assert first + second == pytest.approx(straight, rel=1e-9, abs=0)
    # grouped keys and values in the cache, in one process and at TP 2
    texts = [generate_from(tmp_path / "ck", ranks, layout) for ranks, layout in ((0, []), (2, ["--tp", "2"]))]
    assert texts[0] == texts[1] and texts[0].count("def main(") == 1
