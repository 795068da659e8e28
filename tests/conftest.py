"""The multi-rank harness: run code on N ranks by spawning `mpiexec -n N` (this pytest process
never initialises MPI), with a timeout so a hang fails the test, and every rank's output shown
on failure."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpiexec_path():
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.path.exists(beside) else shutil.which("mpiexec")
    if not found:
        pytest.fail("no mpiexec found: install the MPI extra (pip install -e '.[mpi,test]') or a system MPI")
    return found


def rank_environment(extra=None):
    env = dict(os.environ)
    # One BLAS thread per rank and throttled MPICH polling: up to 8 ranks share 2 cores here.
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


class MPIResult:
    def __init__(self, returncode, stdout, stderr, seconds):
        self.returncode, self.stdout, self.stderr, self.seconds = returncode, stdout, stderr, seconds

    def __str__(self):
        return (f"exit code {self.returncode} after {self.seconds:.1f} s\n--- stdout (all ranks) ---\n"
                f"{self.stdout}\n--- stderr (all ranks) ---\n{self.stderr}")


@pytest.fixture
def mpirun(tmp_path):
    """mpirun(n, code, timeout=120, env=None, check=True) -> MPIResult.

    `code` is a Python program run on every rank (dedented); with check=True a non-zero exit
    fails the test with every rank's output."""

    def run(n, code, timeout=120, env=None, check=True, args=()):
        script = tmp_path / f"ranks_{n}.py"
        script.write_text(textwrap.dedent(code))
        cmd = [mpiexec_path(), "-n", str(n), sys.executable, str(script), *args]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=ROOT, env=rank_environment(env), start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"mpiexec -n {n} hung: killed after {timeout} s\n"
                        + str(MPIResult(None, out, err, time.perf_counter() - start)))
        result = MPIResult(proc.returncode, out, err, time.perf_counter() - start)
        if check and result.returncode != 0:
            pytest.fail(f"mpiexec -n {n} failed: {result}")
        return result

    return run
