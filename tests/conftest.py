"""The multi-rank harness: run a rank program (a module under tests/ranks/) on N ranks by spawning
`mpiexec -n N` (this pytest process never initialises MPI), with a timeout so a hang fails the
test, and every rank's output shown on failure. The helpers behind it (and those test modules
share: mpiexec_path, rank_environment, launch) live in tests/helpers.py."""
import pytest

from helpers import run_ranks


@pytest.fixture
def mpirun():
    """mpirun(n, module, args=(), timeout=120, env=None, check=True) -> MPIResult.

    Runs `mpiexec -n n python tests/<module> <args...>` from the repository root, e.g.
    mpirun(4, "ranks/collectives.py", args=["world"]); `args` are turned into strings. `env`
    adds to the rank environment (one BLAS thread per rank, throttled MPICH polling). With
    check=True a non-zero exit fails the test with every rank's output; a run past `timeout`
    seconds is killed (mpiexec and every rank) and fails the test."""
    return run_ranks
