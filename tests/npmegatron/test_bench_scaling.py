"""Named timers in the training step and `npmegatron bench scaling` (strong and weak, over
mpiexec children, one per layout): phases that add up to the step, records, plots, bad input."""
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from npmegatron.cli import main
from npmegatron.comm.stats import record, reset_stats
from npmegatron.timers import NO_TIMERS, PHASES, TP_COMM, Timers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "npmegatron.cli", "bench", "scaling"]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--vocab-size", "64", "--warmup", "1", "--iters", "2"]


def run(args, timeout=180):
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def records_of(result):
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_timers_off_are_no_ops():
    timer = NO_TIMERS("forward-compute", exclude_comm=True)
    timer.start()
    timer.start()           # no state: not even a double start is noticed
    timer.stop()
    with NO_TIMERS("optimizer"):
        pass
    assert NO_TIMERS("a") is NO_TIMERS("b")
    assert NO_TIMERS.elapsed() == {} and not NO_TIMERS.enabled


def test_timers_sum_and_move_tp_communication_out_of_compute():
    reset_stats()
    timers = Timers(comm_groups=("tp",))
    for _ in range(2):
        with timers("forward-compute", exclude_comm=True):
            record("all_reduce", "tp", 64, 0.25)       # as if a TP collective took 0.25 s inside
            record("all_reduce", "dp", 64, 5.0)        # other groups stay where they are
    elapsed = timers.elapsed()
    assert elapsed[TP_COMM] == pytest.approx(0.5)
    assert -0.6 < elapsed["forward-compute"] < -0.4    # the clock saw ~0 s, 0.5 s moved out
    assert timers("forward-compute").count == 2
    timers.reset()
    assert timers.elapsed() == {"forward-compute": 0.0, TP_COMM: 0.0}
    with pytest.raises(RuntimeError):
        timers("x").stop()
    reset_stats()


def test_phases_add_up_to_the_step_at_tp2_and_pp2():
    records = records_of(run(["--layouts", "2x1x1,1x2x1", "--json"] + TINY[:-4]
                             + ["--warmup", "1", "--iters", "3", "--hidden-size", "64", "--seq-length", "32"]))
    by_layout = {r["layout"]: r for r in records}
    assert set(by_layout) == {"2x1x1", "1x2x1"}
    for r in records:
        assert set(r["phases_s"]) == set(PHASES) | {"other"}
        named = sum(v for k, v in r["phases_s"].items() if k != "other")
        assert named == pytest.approx(r["rank0_step_mean_s"], rel=0.10), r["phases_s"]
        assert r["phases_s"]["forward-compute"] > 0 and r["phases_s"]["backward-compute"] > 0
    assert by_layout["2x1x1"]["phases_s"]["tp-comm"] > 0
    assert by_layout["2x1x1"]["phases_s"]["pipeline-wait"] < 0.01 * by_layout["2x1x1"]["rank0_step_mean_s"]
    assert by_layout["1x2x1"]["phases_s"]["pipeline-wait"] > 0
    assert by_layout["1x2x1"]["phases_s"]["tp-comm"] == 0


@pytest.mark.slow
def test_strong_scaling_writes_records_and_plots(tmp_path):
    result = run(["--mode", "strong", "--layouts", "1x1x1,2x1x1", "--output", str(tmp_path)] + TINY)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "layout" in result.stdout and "2x1x1" in result.stdout and "threads per rank" in result.stdout
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["layout"] for r in records] == ["1x1x1", "2x1x1"]
    assert records[0]["efficiency"] == pytest.approx(1.0)
    assert records[0]["global_batch"] == records[1]["global_batch"] == 4    # micro-batch x DP 1 x 2
    cores = len(os.sched_getaffinity(0))
    assert [r["threads_per_rank"] for r in records] == [max(1, cores // n) for n in (1, 2)]
    assert [r["environment"]["blas"][0]["num_threads"] for r in records] == [max(1, cores // n) for n in (1, 2)]
    for r in records:
        assert r["tokens_per_s"] > 0 and r["model_flops_per_s_per_rank"] > 0
        assert r["environment"]["numpy"] and r["environment"]["mpi_library"]
    for name in ("scaling.png", "breakdown.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_threads_per_rank_sets_the_budget_of_blas_and_the_cpu_engine():
    """--threads-per-rank 1: the single-core serial baseline, even where more cores are free."""
    records = records_of(run(["--layouts", "1x1x1", "--threads-per-rank", "1", "--json"] + TINY))
    assert records[0]["threads_per_rank"] == 1
    assert records[0]["environment"]["blas"][0]["num_threads"] == 1


def test_sequence_parallel_applies_to_the_layouts_with_tp():
    from npmegatron.bench.scaling import plan_runs
    from npmegatron.config import GPTConfig
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    specs = plan_runs(cfg, [(1, 1, 1), (2, 1, 1), (2, 1, 2)], "strong", 2, 16, sequence_parallel=True)
    assert [s["layout"] for s in specs] == ["1x1x1", "2x1x1+sp", "2x1x2+sp"]
    assert [s["cfg"]["sequence_parallel"] for s in specs] == [False, True, True]
    records = records_of(run(["--layouts", "2x1x1", "--sequence-parallel", "--json"] + TINY))
    assert records[0]["layout"] == "2x1x1+sp" and records[0]["phases_s"][TP_COMM] > 0


def test_weak_scaling_over_tp_grows_the_model():
    records = records_of(run(["--mode", "weak", "--ranks", "1,2", "--parallel", "tp", "--json"] + TINY))
    one, two = records
    assert (one["tp"], two["tp"]) == (1, 2)
    assert one["hidden_size"] == 32 and two["hidden_size"] == 44      # 32 x sqrt(2), a multiple of 4 heads
    assert two["parameters"] > one["parameters"]
    assert two["efficiency"] == pytest.approx(two["model_flops_per_s_per_rank"] / one["model_flops_per_s_per_rank"])


@pytest.mark.parametrize("args, words", [
    (["--layouts", "abc"], "is not TPxPPxDP"),
    (["--layouts", "0x1x1"], "positive integers"),
    (["--layouts", ","], "is empty"),
    (["--layouts", "3x1x1"], "not divisible by TP = 3"),
    (["--layouts", "1x3x1"], "do not split evenly"),
    (["--ranks", "1,2"], "needs --parallel"),
    (["--ranks", "1,x", "--parallel", "dp"], "positive integers"),
    (["--layouts", "1x1x1", "--ranks", "2", "--parallel", "tp"], "not both"),
    (["--layouts", "1x1x2", "--global-batch-size", "3"], "not a multiple"),
    (["--layouts", "1x1x1000"], "more than 8 per core"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_bad_input_is_one_sentence(args, words):
    result = CliRunner().invoke(main, ["bench", "scaling"] + args + TINY[:10])
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], result.output


@pytest.mark.parametrize("flag", ["--micro-batch-size", "--seq-length"])
def test_a_zero_batch_flag_is_one_sentence(flag):
    """Not a ZeroDivisionError from planning the runs (the flags are train's, checked as train checks them)."""
    result = CliRunner().invoke(main, ["bench", "scaling"] + TINY[:10] + [flag, "0"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"Error: {flag} is 0; it must be a positive integer"], result.output


def test_rounds_keep_each_layouts_median_round_and_list_them_all():
    """--rounds N: each layout's row is the round of its median efficiency (lower median for an
    even count), each round's efficiency against that round's own baseline."""
    from npmegatron.bench.scaling import add_efficiency, combine_rounds, format_table
    env = {"device": "cpu", "cores": 2}

    def record(layout, ranks, step_s):
        return {"layout": layout, "ranks": ranks, "step_s": step_s, "tokens_per_s": 1000 / step_s,
                "step_min_s": step_s, "step_max_s": step_s, "dtype": "float32", "environment": env,
                "threads_per_rank": 1, "parameters": 10, "hidden_size": 8, "num_layers": 1, "global_batch": 4,
                "model_flops_per_s_per_rank": 1.0, "phases_s": {p: 0.0 for p in list(PHASES) + ["other"]}}

    # The baseline drifts; TP = 2's runs beside it give 90 %, 80 % and 100 %.
    by_round = [add_efficiency([record("1x1x1", 1, serial), record("2x1x1", 2, serial / 2 / eff)], "strong")
                for serial, eff in ((10.0, 0.9), (8.0, 0.8), (12.0, 1.0))]
    combined = combine_rounds(by_round)
    assert [r["layout"] for r in combined] == ["1x1x1", "2x1x1"]
    tp = combined[1]
    assert [x["efficiency"] for x in tp["rounds"]] == pytest.approx([0.9, 0.8, 1.0])
    assert tp["efficiency"] == pytest.approx(0.9) and tp["step_s"] == pytest.approx(10.0 / 2 / 0.9)
    even = combine_rounds(by_round[:2])[1]
    assert even["efficiency"] == pytest.approx(0.8)
    table = format_table(combined, "strong")
    assert "3 rounds of the layouts in turn" in table and "90 %" in table and "80 %" in table


@pytest.mark.slow
def test_rounds_from_the_command_line():
    records = records_of(run(["--layouts", "1x1x1,1x1x2", "--rounds", "2", "--json"] + TINY))
    assert [r["layout"] for r in records] == ["1x1x1", "1x1x2"]
    assert all(len(r["rounds"]) == 2 for r in records)
    assert [x["efficiency"] for x in records[0]["rounds"]] == pytest.approx([1.0, 1.0])


def test_sync_jitter_probe_measures_equal_work_meeting_on_two_ranks():
    from helpers import run_ranks
    result = run_ranks(2, "../scripts/bench_sync_jitter.py",
                       ["--segments", "5", "--segment-ms", "2", "--rows", "64", "--inner", "32", "--columns", "32"])
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ranks"] == 2 and report["segments"] == 5 and report["gemms_per_segment"] >= 1
    assert [r["rank"] for r in report["per_rank"]] == [0, 1]
    for rank in report["per_rank"]:
        assert 0 < rank["ceiling"] <= 1
        assert 0 < rank["segment"]["median_ms"] <= rank["segment"]["p90_ms"] <= rank["segment"]["max_ms"]
        assert 0 <= rank["all_reduce"]["median_ms"] <= rank["all_reduce"]["max_ms"]
    assert report["ceiling"] == pytest.approx(sum(r["ceiling"] for r in report["per_rank"]) / 2)
