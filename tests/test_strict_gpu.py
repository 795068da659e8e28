"""The GPU test files, run on this CPU-only machine against the strict CuPy stand-in
(tests/fakes/strict_cupy): arrays that refuse implicit conversion to NumPy, counted host
synchronisations, recorded device binding, NCCL over MPI with in-order matching and CuPy 14's
signatures, streams on which point-to-point transfers finish only when waited for. The very
files a GPU machine runs (tests/test_gpu.py, tests/comm/test_comm_gpu.py) must pass here, with
no test skipped."""
import os
import subprocess
import sys

import pytest

from fakes.strict_cupy import strict_cupy_env
from helpers import ROOT

GPU_FILES = ["tests/test_gpu.py", "tests/comm/test_comm_gpu.py"]


def run_gpu_files(marker):
    env = dict(os.environ, **strict_cupy_env(devices=8))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", marker,
                          *GPU_FILES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skipped" not in run.stdout.splitlines()[-1], run.stdout
    return run.stdout


def test_gpu_files_pass_on_the_strict_stand_in():
    out = run_gpu_files("not slow")
    assert "host syncs per step [1, 1, 1, 1]" in out, out


@pytest.mark.slow
def test_slow_gpu_files_pass_on_the_strict_stand_in():
    """The eight-rank layouts, the two-rank pipeline layouts, DP 2 training with the distributed
    optimizer, and TP 2 x PP 2 x DP 2 training."""
    out = run_gpu_files("slow")
    assert "TP 2 x PP 2 x DP 2: host syncs per step [1, 1, 1, 1]" in out, out
