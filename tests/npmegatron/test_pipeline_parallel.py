"""Pipeline parallelism under mpiexec, float64: every (PP, TP, DP) and schedule gives the serial
model's loss and every gradient to 1e-10 relative, with custom uneven layouts and with
variable-length micro-batches; the memory of the schedules; training and resume with PP > 1."""
import json

import pytest

from helpers import launch, pipeline_cases

RANKS = "ranks/pipeline_parallel.py"


def check(mpirun, n, cases):
    result = mpirun(n, RANKS, args=["check", json.dumps(cases)], timeout=300)
    assert "worst relative error" in result.stdout, result
    worst = float(result.stdout.split("worst relative error")[1].split()[0])
    print(f"{n} ranks, {len(cases)} cases: worst relative error {worst:.2e}")
    return worst


def test_two_stages_every_schedule_layout_and_variable_lengths(mpirun):
    assert check(mpirun, 2, pipeline_cases(2)) < 1e-10


@pytest.mark.slow       # 5 s; the 2-rank layouts above keep the quick loop's pipeline check
def test_four_ranks_pp4_pp2xtp2_pp2xdp2(mpirun):
    assert check(mpirun, 4, pipeline_cases(4)) < 1e-10


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["overlap", "no-overlap"])
def test_tag_free_p2p_matches_in_posting_order(mpirun, overlap):
    """NCCL has no tags: a pair's messages match in the order they are posted. With the MPI
    backend ignoring tags (NPMEGATRON_P2P_ORDERED=1), every layout still equals the serial model:
    each rank posts its receives in the order its neighbour sends (before this, AFAB at PP = 4
    received micro-batch 1's activation for micro-batch 0's, 0.69 relative error)."""
    ordered = {"NPMEGATRON_P2P_ORDERED": "1"}
    two = [c for c in pipeline_cases(2, overlap=overlap) if not (c["schedule"] == "1f1b" and c.get("variable"))]
    for n, cases in ((2, two), (4, pipeline_cases(4, overlap=overlap))):
        result = mpirun(n, RANKS, args=["check", json.dumps(cases)], timeout=300, env=ordered)
        worst = float(result.stdout.split("worst relative error")[1].split()[0])
        assert worst < 1e-10, result


@pytest.mark.slow
def test_eight_ranks_pp4xtp2_and_pp2xtp2xdp2(mpirun):
    assert check(mpirun, 8, pipeline_cases(8)) < 1e-10


@pytest.mark.slow
def test_schedule_memory_and_deallocated_outputs(mpirun):
    """PP = 4, M = 8: 1F1B holds fewer activations on stage 0 than AFAB, and deallocating sent
    outputs lowers the peak further; a deallocated output holds one element after its send."""
    result = mpirun(4, RANKS, args=["memory"], timeout=180)
    table = eval(result.stdout.split("TABLE ")[1].strip())
    assert table["1f1b", False][0] < table["afab", False][0]
    assert table["1f1b", True][0] < table["1f1b", False][0]
    assert table["afab", True][0] < table["afab", False][0]


def test_deallocating_a_view_is_refused():
    import numpy as np
    from npmegatron.autograd import InputError, Tensor
    from npmegatron.pipeline.exchange import deallocate
    base = np.zeros((4, 4))
    with pytest.raises(InputError, match="refusing to deallocate a pipeline output that is a view"):
        deallocate(Tensor(base[1:]))
    t = Tensor(np.zeros((4, 4)))
    deallocate(t)
    assert t.data.size == 1


TRAIN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "12", "--log-interval", "1",
         "--eval-interval", "6", "--eval-iters", "1", "--lr-warmup-iters", "3", "--lr", "3e-3",
         "--sample-tokens", "0"]


def losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


@pytest.mark.slow
def test_pipeline_training_follows_serial_and_resumes_bitwise(tmp_path):
    serial = launch(0, TRAIN + ["--dtype", "float64", "--log-file", str(tmp_path / "serial.jsonl")])
    assert serial.returncode == 0, serial.stderr
    for extra in (["--pp", "2"], ["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                  ["--pp", "2", "--pipeline-model-parallel-layout", "Et|tttL", "--variable-seq-lengths"]):
        run = launch(2, TRAIN + ["--dtype", "float64", "--log-file", str(tmp_path / "pp.jsonl")] + extra)
        assert run.returncode == 0, run.stderr
        assert "TP(1)-PP(2)-DP(1)-Rank(0)" in run.stdout and "no sample" not in run.stderr
        assert losses(tmp_path / "pp.jsonl") == pytest.approx(losses(tmp_path / "serial.jsonl"), rel=1e-10)
    # resume with PP = 2 x DP = 2 and dropout: 12 straight == 6 + save + load + 6, bitwise
    args = TRAIN + ["--pp", "2", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    straight = launch(4, args + ["--log-file", str(tmp_path / "a.jsonl")])
    first = launch(4, args + ["--save", str(tmp_path / "ck"), "--exit-interval", "6",
                              "--log-file", str(tmp_path / "b.jsonl")])
    second = launch(4, args + ["--load", str(tmp_path / "ck"), "--log-file", str(tmp_path / "b.jsonl")])
    for run in (straight, first, second):
        assert run.returncode == 0, run.stdout + run.stderr
    assert losses(tmp_path / "b.jsonl") == losses(tmp_path / "a.jsonl")
    assert sorted(p.name for p in (tmp_path / "ck" / "iter_0000006").iterdir()) == [
        "config.yaml", "manifest.json", "mp_rank_00_000.safetensors", "mp_rank_00_001.safetensors"]


@pytest.mark.quick_variants("layout")
@pytest.mark.parametrize("args,message", [
    (["--pipeline-model-parallel-layout", "Ett|tL"], "has 3 transformer layers but the model has 4"),
    (["--num-layers-per-virtual-pipeline-stage", "3"], "does not split 4 layers over 2 pipeline ranks"),
    (["--global-batch-size", "5"], "--global-batch-size 5 is not divisible by micro-batch x DP = 2 x 1 = 2"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "6"],
     "the interleaved schedule needs the micro-batches (3) to be a multiple of the pipeline size 2"),
    (["--lr", "1e30", "--dtype", "float32", "--clip-grad", "0", "--lr-warmup-iters", "0"],
     "the loss became nan at iteration 2"),
], ids=["layout", "virtual", "global-batch", "interleaved-m", "nan"])
def test_bad_pipeline_input_is_reported_once(args, message):
    result = launch(2, TRAIN + ["--pp", "2", "--global-batch-size", "4"] + args, timeout=90)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count(message) == 1, result.stderr
