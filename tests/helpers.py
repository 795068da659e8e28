"""Helpers shared by the test modules (imported as `from helpers import ...`; tests/ is on
sys.path because tests/conftest.py lives there): where mpiexec is, the environment every rank
runs in, running a tests/ranks/ module on N ranks, and launching scripts/train.py.

No test module imports another test module: what several of them share lives here."""
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
RANKS = os.path.join(TESTS, "ranks")


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


def rank_program(module):
    """The path of a rank program: `module` is relative to tests/ ("ranks/collectives.py") or
    to tests/ranks/ ("collectives.py", "collectives")."""
    candidates = [module, module + ".py"] if not module.endswith(".py") else [module]
    for name in candidates:
        for base in (TESTS, RANKS):
            path = os.path.join(base, name)
            if os.path.isfile(path):
                return path
    pytest.fail(f"no rank program {module!r} under {TESTS} or {RANKS}")


def run_ranks(n, module, args=(), timeout=120, env=None, check=True):
    """`mpiexec -n n python tests/<module> <args>` from the repository root -> MPIResult.

    The job runs in its own session, so a hang (past `timeout` seconds) kills mpiexec and every
    rank and fails the test; with check=True a non-zero exit fails the test. Either way the
    failure shows every rank's stdout and stderr."""
    cmd = [mpiexec_path(), "-n", str(n), sys.executable, rank_program(module), *map(str, args)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=rank_environment(env), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mpiexec -n {n} {module} {' '.join(map(str, args))} hung: killed after {timeout} s\n"
                    + str(MPIResult(None, out, err, time.perf_counter() - start)))
    result = MPIResult(proc.returncode, out, err, time.perf_counter() - start)
    if check and result.returncode != 0:
        pytest.fail(f"mpiexec -n {n} {module} {' '.join(map(str, args))} failed: {result}")
    return result


@functools.lru_cache(maxsize=None)
def counted_gpu_work(args):
    """scripts/count_gpu_work.py's JSON text for `args` (a tuple), run once per session: the
    count tests and the planner's test read the same counts, and at GPT-2 124M's shapes a run
    takes about a minute on two cores."""
    command = [sys.executable, "scripts/count_gpu_work.py", "--json", "/dev/stdout", *args]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr
    return run.stdout[run.stdout.index("\n{") + 1:]


def launch(n, args, timeout=180):
    """scripts/train.py with `args`, under `mpiexec -n n` (n = 0: one process, no mpiexec)."""
    command = ([mpiexec_path(), "-n", str(n)] if n else []) + [sys.executable, "scripts/train.py"] + args
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=rank_environment())


def generate_from(folder, ranks=0, layout=(), max_tokens=12):
    """`npmegatron generate --load folder` greedily from the prompt "def main(", under `mpiexec -n
    ranks` (0: one process) with the layout flags given; its output, after checking it succeeded."""
    command = ([mpiexec_path(), "-n", str(ranks)] if ranks else []) + [
        sys.executable, "-m", "npmegatron.cli", "generate", "--load", str(folder),
        "--prompt", "def main(", "--max-tokens", str(max_tokens), "--temperature", "0"] + list(layout)
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=rank_environment())
    assert run.returncode == 0, run.stderr
    return run.stdout


def launch_logged(n, args, log, timeout=300):
    """launch() with --log-file `log`; the records it wrote (one per logged iteration), after
    checking the run succeeded (its output shown otherwise)."""
    result = launch(n, list(args) + ["--log-file", str(log)], timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(log) as f:
        return [json.loads(line) for line in f]


SCHEDULES = [{"schedule": "afab"}, {"schedule": "1f1b"}, {"schedule": "interleaved", "virtual": 2, "layers": 8}]


def pipeline_cases(ranks, **extra):
    """The pipeline equality layouts for 2, 4 or 8 ranks (tests/ranks/pipeline_parallel.py
    cases: every schedule, uneven layouts, variable lengths, SP, DP), each with `extra` added
    (e.g. overlap=False, device="gpu"). Shared by the CPU, ordered-P2P and GPU tests."""
    if ranks == 2:
        cases = [dict(tp=1, pp=2, m=4, **s) for s in SCHEDULES]
        cases += [dict(tp=1, pp=2, m=4, schedule="1f1b", layout="Et|tttL"),          # uneven
                  dict(tp=1, pp=2, m=4, schedule="interleaved", layout="E|t|ttt|tL", layers=5),
                  dict(tp=1, pp=2, m=4, schedule="1f1b", variable=True),
                  dict(tp=1, pp=2, m=4, schedule="interleaved", virtual=2, variable=True)]
    elif ranks == 4:
        cases = [dict(m=4, **grid, **s) for grid in (dict(tp=1, pp=4), dict(tp=2, pp=2), dict(tp=1, pp=2))
                 for s in SCHEDULES]                                        # the last grid is DP=2
        cases += [dict(tp=1, pp=4, m=4, schedule="1f1b", layout="Ettt|t|t|tL", layers=6),
                  dict(tp=2, pp=2, m=4, schedule="1f1b", variable=True, sp=True),
                  dict(tp=1, pp=2, m=4, schedule="afab", variable=True, layout="Ettt|tL")]
    else:
        cases = [dict(m=4, **grid, **s) for grid in (dict(tp=2, pp=4), dict(tp=2, pp=2)) for s in SCHEDULES]
        cases += [dict(tp=2, pp=4, m=4, schedule="interleaved", layout="Et|t|t|t|t|t|t|tL", layers=8,
                       variable=True, sp=True)]
    return [dict(case, **extra) for case in cases]


def write_indexed_dataset(prefix, documents, dtype):
    """PREFIX.bin and PREFIX.idx holding `documents` (arrays of token ids), one sequence each,
    written by the project's Megatron-format writer."""
    from npmegatron.data.indexed import IndexedDatasetWriter
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for ids in documents:
            writer.add_document(ids)
        writer.commit()
    return writer


def real_gpu_cupy():
    """CuPy on a CUDA device, for the test files that hold the stand-in's emulations to a real GPU;
    the calling module is skipped without CuPy, under the strict stand-in, or without a device."""
    cupy = pytest.importorskip("cupy")
    if hasattr(cupy, "_strict"):
        pytest.skip("the stand-in's own tests cover it; this file is for a real GPU", allow_module_level=True)
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError
    except Exception:
        pytest.skip("no CUDA device", allow_module_level=True)
    return cupy
