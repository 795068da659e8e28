"""A failing rank ends the whole job quickly with its message printed once, never a hang."""
import re

import pytest

RANKS = "ranks/failures.py"


def test_a_rank_that_raises_aborts_the_job_with_one_message(mpirun):
    result = mpirun(4, RANKS, args=["raise"], check=False, timeout=60)
    assert result.returncode != 0, str(result)
    assert result.seconds < 30, str(result)
    assert result.stderr.count("ValueError: rank two hit a bad value") == 1, str(result)
    assert "[rank 2] ValueError: rank two hit a bad value" in result.stderr


@pytest.mark.slow
def test_an_error_every_rank_shares_is_printed_once(mpirun):
    result = mpirun(4, RANKS, args=["shared-error"], check=False, timeout=60)
    assert result.returncode != 0 and result.seconds < 30, str(result)
    assert result.stderr.count("world size 4 is not divisible by TP x PP = 3") == 1, str(result)
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_killed_rank_ends_the_job(mpirun):
    result = mpirun(4, RANKS, args=["kill"], check=False, timeout=60)
    assert result.returncode != 0, str(result)
    assert result.seconds < 30, str(result)


def test_mismatched_collectives_in_debug_mode_are_a_clear_error(mpirun):
    result = mpirun(2, RANKS, args=["mismatched-collectives"],
                    env={"NPMEGATRON_DEBUG_COMM": "1"}, check=False, timeout=60)
    assert result.returncode != 0 and result.seconds < 30, str(result)
    message = ("mismatched collectives in group world: rank 0 called all_reduce(shape=(4,), "
               "dtype=float64, op=sum) but rank 1 called all_gather(shape=(4,), dtype=float64, axis=0)")
    assert result.stderr.count(message) == 1, str(result)
    assert re.search(r"\[rank 0\] .*CommMismatchError", result.stderr), str(result)


@pytest.mark.slow
def test_mismatched_shapes_in_debug_mode_are_a_clear_error(mpirun):
    result = mpirun(2, RANKS, args=["mismatched-shapes"],
                    env={"NPMEGATRON_DEBUG_COMM": "1"}, check=False, timeout=60)
    assert result.returncode != 0, str(result)
    assert "rank 0 called all_reduce(shape=(4,), dtype=float32, op=sum) but rank 1 called " \
           "all_reduce(shape=(5,), dtype=float32, op=sum)" in result.stderr, str(result)
