"""Data parallelism and checkpoints under mpiexec: every (TP, DP) layout follows the serial
trajectory, gradients reduce in buckets while backward runs, resume is bitwise, and a run killed
while saving resumes from the previous checkpoint."""
import json

import pytest
from safetensors.numpy import load_file

from helpers import generate_from, launch

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "20", "--log-interval",
        "1", "--eval-interval", "10", "--eval-iters", "1", "--lr-warmup-iters", "3", "--lr", "3e-3",
        "--sample-tokens", "0", "--ddp-bucket-size", "4000"]

RANKS = "ranks/data_parallel.py"


def losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


@pytest.mark.parametrize("layouts", [[(1, 1), (2, 2)],
                                     pytest.param([(1, 1), (2, 1), (1, 2)], marks=pytest.mark.slow)],
                         ids=["tp2xdp2", "tp2-and-dp2"])
def test_every_tp_dp_layout_follows_the_serial_trajectory(tmp_path, layouts):
    """(TP, DP) in {(2,1), (1,2), (2,2)} against (1,1), global batch 4 of micro-batches of 2: one
    rank accumulates 2 micro-batches where DP=2 runs one on each replica. The quick run keeps
    TP 2 x DP 2, which goes through both."""
    args = TINY + ["--dtype", "float64"]
    curves = {}
    for tp, dp in layouts:
        log = tmp_path / f"tp{tp}dp{dp}.jsonl"
        run = launch(tp * dp if tp * dp > 1 else 0, args + ["--tp", str(tp), "--log-file", str(log)])
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.stdout.count("done: loss") == 1          # rank 0 alone prints
        assert f"TP({tp})-PP(1)-DP({dp})-Rank(0)" in run.stdout
        assert f"= 2 x {2 // dp} accumulation x {dp} DP" in run.stdout
        curves[tp, dp] = losses(log)
    ref = curves[1, 1]
    assert len(ref) == 20 and ref[-1] < ref[0] - 0.5
    for layout, curve in curves.items():
        assert curve == pytest.approx(ref, rel=1e-9, abs=0), layout


@pytest.mark.slow
def test_buckets_reduce_while_backward_runs(mpirun):
    result = mpirun(2, RANKS, args=["buckets"], timeout=120)
    assert result.stdout.count("buckets") == 2, result


def shards(folder):
    latest = (folder / "latest").read_text()
    return {p.name: load_file(str(p)) for p in sorted((folder / latest).glob("*.safetensors"))}


@pytest.mark.slow
def test_resume_at_tp2_dp2_is_bitwise_with_dropout(tmp_path):
    args = TINY + ["--tp", "2", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    straight = launch(4, args + ["--save", str(tmp_path / "a"), "--log-file", str(tmp_path / "a.jsonl")])
    first = launch(4, args + ["--save", str(tmp_path / "b"), "--exit-interval", "10",
                              "--log-file", str(tmp_path / "b.jsonl")])
    second = launch(4, args + ["--load", str(tmp_path / "b"), "--save", str(tmp_path / "c"),
                               "--log-file", str(tmp_path / "b.jsonl")])
    for run in (straight, first, second):
        assert run.returncode == 0, run.stdout + run.stderr
    assert "resumed from" in second.stdout and "at iteration 10" in second.stdout
    assert losses(tmp_path / "b.jsonl") == losses(tmp_path / "a.jsonl")      # exact, float32
    a, c = shards(tmp_path / "a"), shards(tmp_path / "c")
    assert sorted(a) == ["mp_rank_00_000.safetensors", "mp_rank_01_000.safetensors"]
    for name in a:
        for key in a[name]:
            assert (a[name][key] == c[name][key]).all(), (name, key)


@pytest.mark.slow
def test_killed_while_saving_resumes_from_the_previous_checkpoint(mpirun, tmp_path):
    def run(mode, log):
        return ["save-and-resume", mode, "--checkpoint", tmp_path / "ck",
                "--straight-checkpoint", tmp_path / "straight", "--log-file", tmp_path / log]

    killed = mpirun(4, RANKS, args=run("kill", "killed.jsonl"), check=False, timeout=120)
    assert killed.returncode != 0
    assert (tmp_path / "ck" / "latest").read_text() == "iter_0000002"
    assert (tmp_path / "ck" / "iter_0000004.partial" / "mp_rank_01_000.safetensors").exists()
    assert not (tmp_path / "ck" / "iter_0000004").exists()
    mpirun(4, RANKS, args=run("resume", "resumed.jsonl"))
    mpirun(4, RANKS, args=run("straight", "straight.jsonl"))
    assert losses(tmp_path / "resumed.jsonl") == losses(tmp_path / "straight.jsonl")[2:]
    assert (tmp_path / "ck" / "latest").read_text() == "iter_0000006"
    assert not (tmp_path / "ck" / "iter_0000004.partial").exists()


@pytest.mark.slow
def test_generate_from_a_tensor_parallel_checkpoint_at_any_layout(tmp_path):
    """Saved at TP = 2; generated at TP = 2, on one process and over two pipeline stages (the
    checkpoint resharded on load): the same greedy text, printed once."""
    run = launch(2, TINY + ["--tp", "2", "--train-iters", "4", "--save", str(tmp_path / "ck")])
    assert run.returncode == 0, run.stderr
    texts = [generate_from(tmp_path / "ck", ranks, layout) for ranks, layout in ((2, []), (0, []), (2, ["--pp", "2"]))]
    assert all(text.count("def main(") == 1 for text in texts)      # printed once, by rank 0
    assert texts[0] == texts[1] == texts[2]
