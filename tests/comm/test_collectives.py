"""Collectives and point-to-point on 1, 2, 4 and 8 ranks with hand-computed values: inputs are
`ones * rank`, so a sum all-reduce over ranks R gives sum(R) everywhere, and so on."""
import re

import pytest

RANKS = "ranks/collectives.py"


@pytest.mark.quick_variants("4")
@pytest.mark.parametrize("n", [1, 2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_collectives_and_p2p_on_the_world(mpirun, n):
    result = mpirun(n, RANKS, args=["world"], timeout=240)
    assert result.stdout.count("ok") == n


@pytest.mark.slow
def test_every_group_of_a_2x2x2_grid(mpirun):
    result = mpirun(8, RANKS, args=["grid"], timeout=300)
    reports = re.findall(r"<(TP[^>]*)>", result.stdout)
    assert "TP(2)-PP(2)-DP(2)-Rank(5) tp [4, 5] dp [5, 7] pp [1, 5] next 1 prev 1" in reports
    assert "TP(2)-PP(2)-DP(2)-Rank(2) tp [2, 3] dp [0, 2] pp [2, 6] next 6 prev 6" in reports
    assert len(reports) == 8


# Four ranks on two cores take 10 s: the slow suite's.
@pytest.mark.quick_variants("2")
@pytest.mark.parametrize("n", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_large_all_reduces_through_shared_memory(mpirun, n):
    result = mpirun(n, RANKS, args=["shared-memory"], timeout=240)
    assert result.stdout.count("shared memory ok") == n


def test_stats_count_calls_bytes_and_reset(mpirun):
    mpirun(2, RANKS, args=["stats"])


def test_blas_is_pinned_to_cores_over_local_ranks(mpirun):
    result = mpirun(2, RANKS, args=["blas"], env={"OMP_NUM_THREADS": "", "OPENBLAS_NUM_THREADS": ""})
    assert "threads" in result.stdout
