"""comm.all_to_all and comm.all_to_all_v (expert parallelism's token dispatch): a group of one
rank, bad input as one sentence, the debug check of counts, and on 2, 3 and 4 ranks the results
against a NumPy reference (tests/ranks/all_to_all.py) through MPI and, under the strict CuPy
stand-in, through NCCL's grouped sends and receives."""
import ml_dtypes
import numpy
import pytest

from fakes.strict_cupy import strict_cupy_env

from npmegatron import comm
from npmegatron.autograd.errors import InputError
from npmegatron.comm import debug
from npmegatron.comm.group import Group

RANKS = "ranks/all_to_all.py"


def group_of(size):
    """A group of `size` ranks seen from rank 0, without MPI: enough for checks made before any
    message moves."""
    group = Group.single("ep")
    group.size, group.ranks = size, tuple(range(size))
    return group


@pytest.mark.parametrize("dtype", [numpy.float64, ml_dtypes.bfloat16])
def test_a_group_of_one_rank_returns_x(dtype):
    one, x = Group.single("ep"), numpy.arange(12).reshape(4, 3).astype(dtype)
    comm.reset_stats()
    assert comm.all_to_all(x, one) is x
    assert comm.all_to_all_v(x, one, [4], numpy.array([4])) is x
    empty = x[:0]
    assert comm.all_to_all_v(empty, one, [0], [0]) is empty
    assert comm.stats().count("all_to_all") == comm.stats().count("all_to_all_v") == 0


BAD = [
    (dict(x=numpy.ones((5, 2))), r"all_to_all splits axis 0 .* multiple of the group size 3, got shape \(5, 2\)"),
    (dict(x=numpy.float64(1.0)), r"group size 3, got shape \(\)"),
    (dict(send=[1, 2], recv=[1, 1, 1]), r"send_counts \[1, 2\] has 2 entries, but group ep has 3 ranks"),
    (dict(send=[1, 1, 1], recv=[1, 1, 1, 0]), r"recv_counts \[1, 1, 1, 0\] has 4 entries"),
    (dict(send=[2, -1, 2], recv=[1, 1, 1]), r"send_counts \[2, -1, 2\] holds a negative count"),
    (dict(send=[1, 1, 1], recv=[0, -2, 1]), r"recv_counts \[0, -2, 1\] holds a negative count"),
    (dict(send=[1.0, 1, 1], recv=[1, 1, 1]), r"send_counts must be a list or NumPy array of host integers"),
    (dict(send=[[1, 1, 1]], recv=[1, 1, 1]), r"send_counts must be .* one per rank, got \[\[1, 1, 1\]\]"),
    (dict(send=[1, 1, 1], recv=None), r"recv_counts must be .* got None"),
    (dict(send=[1, 2, 1], recv=[1, 1, 1]),
     r"send_counts \[1, 2, 1\] add up to 4, but x of shape \(3, 2\) has 3 rows; the counts must split"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_one_sentence_naming_the_value(bad, message):
    group = group_of(3)
    with pytest.raises(InputError, match=message):
        if "x" in bad:
            comm.all_to_all(bad["x"], group)
        else:
            comm.all_to_all_v(numpy.ones((3, 2)), group, bad["send"], bad["recv"])


def test_one_rank_receives_what_it_sends():
    with pytest.raises(InputError, match=r"recv_counts \[2\] must equal send_counts \[3\]"):
        comm.all_to_all_v(numpy.ones((3, 2)), Group.single("ep"), [3], [2])


def test_counts_on_the_gpu_are_refused(fresh_strict_cupy):
    """Counts are host integers: they size the receive buffer before anything moves."""
    with pytest.raises(InputError, match="send_counts must be a list or NumPy array of host integers"):
        comm.all_to_all_v(numpy.ones((3, 2)), group_of(2), fresh_strict_cupy.array([1, 2]), [1, 2])


class AllgatherOf:
    """An MPI communicator whose Allgather returns the given rows (every rank's contribution)."""

    def __init__(self, rows):
        self.rows = numpy.asarray(rows, numpy.int64)

    def Allgather(self, mine, everyone):
        everyone[...] = self.rows.reshape(everyone.shape)


def test_debug_mode_names_the_pair_whose_counts_disagree():
    """Rank 1 (global rank 11) expects 3 rows from rank 0 (global 10), which sends it 2."""
    group = group_of(2)
    group.ranks = (10, 11)
    group.mpi = AllgatherOf([[[1, 2], [1, 1]], [[1, 1], [3, 1]]])     # per rank: send, recv counts
    with pytest.raises(comm.CommMismatchError, match="rank 10 sends 2 rows to rank 11, which expects 3"):
        debug.check_counts(group, numpy.array([1, 2]), numpy.array([1, 1]))
    group.mpi = AllgatherOf([[[1, 2], [1, 1]], [[1, 1], [2, 1]]])
    debug.check_counts(group, numpy.array([1, 2]), numpy.array([1, 1]))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_to_all_matches_numpy_through_mpi(mpirun, n):
    result = mpirun(n, RANKS, args=["host"], timeout=120)
    assert result.stdout.count("all_to_all ok") == n


# Four ranks take the world and a grid's groups; two and three, the world again: the slow suite's.
@pytest.mark.quick_variants("4")
@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_to_all_matches_numpy_through_nccl_on_the_strict_stand_in(mpirun, n):
    result = mpirun(n, RANKS, args=["device"], env=strict_cupy_env(devices=n), timeout=180)
    assert result.stdout.count("all_to_all on nccl ok") == n


def test_gpu_arrays_of_ranks_sharing_a_gpu_stage_through_host(mpirun):
    result = mpirun(2, RANKS, args=["device"], env=strict_cupy_env(devices=1), timeout=120)
    assert result.stdout.count("all_to_all on mpi ok") == 2


def test_counts_that_disagree_are_a_clear_error_in_debug_mode(mpirun):
    result = mpirun(2, RANKS, args=["debug"], env={"NPMEGATRON_DEBUG_COMM": "1"}, timeout=60)
    assert result.stdout.count("rank 0 sends 1 rows to rank 1, which expects 2") == 2

