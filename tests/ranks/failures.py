"""Rank program for tests/comm/test_failures.py: ranks that fail on purpose, so the tests can
check that the whole job ends quickly with the message printed once, never a hang.

    mpiexec -n 4 python tests/ranks/failures.py raise          # test_a_rank_that_raises_aborts_the_job_with_one_message
    mpiexec -n 4 python tests/ranks/failures.py shared-error   # test_an_error_every_rank_shares_is_printed_once
    mpiexec -n 4 python tests/ranks/failures.py kill           # test_a_killed_rank_ends_the_job
    mpiexec -n 2 python tests/ranks/failures.py mismatched-collectives
                                              # test_mismatched_collectives_in_debug_mode_are_a_clear_error
    mpiexec -n 2 python tests/ranks/failures.py mismatched-shapes
                                              # test_mismatched_shapes_in_debug_mode_are_a_clear_error
(the last two under NPMEGATRON_DEBUG_COMM=1).
"""
import argparse
import os
import signal
import time

import numpy as np

from npmegatron import comm


def rank_raises(world):
    """Rank 2 raises while the others wait in an all-reduce forever, without the abort."""
    if world.rank == 2:
        time.sleep(0.3)
        raise ValueError("rank two hit a bad value")
    comm.all_reduce(np.ones(3), world)


def shared_error(world):
    """Every rank meets the same bad grid: world size 4 is not divisible by TP x PP = 3."""
    comm.ProcessGrid(tp=3, pp=1)


def rank_killed(world):
    """Rank 1 dies of SIGKILL while the others enter an all-reduce."""
    if world.rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(np.ones(3), world)
    comm.barrier(world)


def mismatched_collectives(world):
    """Rank 0 calls all_reduce where rank 1 calls all_gather."""
    x = np.ones(4)
    if world.rank == 0:
        comm.all_reduce(x, world)
    else:
        comm.all_gather(x, world)


def mismatched_shapes(world):
    """The same all_reduce on shapes (4,) and (5,)."""
    comm.all_reduce(np.ones(4 + world.rank, np.float32), world)


CASES = {"raise": rank_raises, "shared-error": shared_error, "kill": rank_killed,
         "mismatched-collectives": mismatched_collectives, "mismatched-shapes": mismatched_shapes}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=sorted(CASES))
    case = parser.parse_args(argv).case
    CASES[case](comm.init())


if __name__ == "__main__":
    main()
