"""scripts/bench_gpu.sh, everything a GPU machine runs in one command, run end to end on the
strict CuPy stand-in (with its cuDNN stand-in) and a small model, so that it cannot rot between
GPU runs: the tests, bench step at each precision, the two-rank run and the table; and
scripts/profile_gpu_host.py, the host's side of a step."""
import os
import re
import subprocess
import sys

import pytest

from fakes.strict_cupy import strict_cupy_env
from helpers import ROOT, mpiexec_path, rank_environment

SMALL = {
    "BENCH_MODEL": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 256 "
                   "--micro-batch-size 2",
    "BENCH_ITERS": "--warmup 1 --iters 2",
    "GPU_TESTS": "tests/comm/test_comm_gpu.py",
    "TEST_SECONDS": "600",     # the limit's watcher is set and, the tests done first, stopped
    "TRAIN_MODEL": "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
                   "--global-batch-size 2 --train-iters 4 --log-interval 2 --eval-interval 4 --eval-iters 1",
}


@pytest.mark.slow
def test_bench_gpu_script_runs_end_to_end_on_the_stand_in(tmp_path):
    env = rank_environment({**strict_cupy_env(devices=2), **SMALL})
    env["PATH"] = os.path.dirname(mpiexec_path()) + os.pathsep + env["PATH"]
    run = subprocess.run(["bash", "scripts/bench_gpu.sh", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = (tmp_path / "table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| precision")]
    assert [r.split(" | ")[0] for r in rows] == ["| fp32", "| tf32", "| fp16", "| bf16", "| bf16-graph"], table
    attention = {r.split(" | ")[0][2:]: r.split(" | ")[6] for r in rows}
    assert attention == {"fp32": "blockwise", "tf32": "blockwise", "fp16": "fused", "bf16": "fused",
                         "bf16-graph": "fused"}, table
    assert "strict CuPy stand-in" in table and "2 ranks, TP 2, --bf16: iter     4/4" in table, table
    assert "passed" in table.split("GPU tests:")[1].splitlines()[0], table


def test_host_profile_script_times_and_profiles_an_eager_step_on_the_stand_in():
    """scripts/profile_gpu_host.py: the step against the host's time to issue it, then cProfile's
    functions. On the stand-in the arrays are NumPy's, so issuing is the whole step."""
    env = rank_environment(strict_cupy_env(devices=1))
    run = subprocess.run([sys.executable, "scripts/profile_gpu_host.py", "--bf16", "--num-layers", "2", "--hidden-size", "64",
                          "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128",
                          "--micro-batch-size", "2", "--top", "5"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    first, second = run.stdout.splitlines()[:2]
    step, issued = re.fullmatch(r"step (\S+) ms; the host has issued it after (\S+) ms \(medians of 5\)", first).groups()
    assert 0 < float(issued) <= float(step), first
    assert re.fullmatch(r"[\d,]+ Python calls a step \(3 steps profiled\)", second), second
    assert "Ordered by: internal time" in run.stdout and "List reduced from" in run.stdout, run.stdout
