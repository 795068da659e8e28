"""Rank program for tests/comm/test_comm_gpu.py: GPU (CuPy) arrays through comm, NCCL where each
rank has a GPU, MPI staged through host memory where ranks share one. Needs CuPy and a GPU.

    mpiexec -n 1 python tests/ranks/comm_gpu.py nccl         # test_nccl_backend_on_a_one_rank_group
    mpiexec -n 2 python tests/ranks/comm_gpu.py shared-gpu   # test_two_ranks_on_one_gpu_stage_through_host
"""
from cases import run_case


def nccl_one_rank():
    """The NCCL backend's collectives on a group of one rank."""
    import cupy
    from npmegatron import comm
    from npmegatron.comm.backends import NCCLBackend
    world = comm.init()
    nccl = NCCLBackend()
    x = cupy.arange(6, dtype=cupy.float32).reshape(2, 3)
    assert cupy.array_equal(nccl.all_reduce(world, x, "sum"), x)
    assert cupy.array_equal(nccl.all_gather(world, x), x[None])
    assert cupy.array_equal(nccl.reduce_scatter(world, x[None], "max"), x)
    assert cupy.array_equal(nccl.broadcast(world, x, 0), x)
    assert cupy.array_equal(nccl.ireduce_scatter(world, x.reshape(-1), "sum").wait(), x.reshape(-1))


def shared_gpu():
    """Two ranks: NCCL with two GPUs or more, else MPI staged through host memory."""
    import cupy
    from npmegatron import comm
    from npmegatron.comm.backends import backend_for
    world = comm.init()
    x = cupy.ones((4, 3), cupy.float64) * world.rank
    expect = "nccl" if cupy.cuda.runtime.getDeviceCount() >= 2 else "mpi"
    assert backend_for(x).name == expect, backend_for(x).name
    assert cupy.array_equal(comm.all_reduce(x, world), cupy.ones((4, 3)))
    assert cupy.array_equal(comm.all_gather(x, world, axis=1)[:, 3:], cupy.ones((4, 3)))
    assert cupy.array_equal(comm.reduce_scatter(x, world, axis=0), cupy.ones((2, 3)))
    got = comm.sendrecv(x, 1 - world.rank, 1 - world.rank)
    assert isinstance(got, cupy.ndarray) and float(got[0, 0]) == 1 - world.rank


CASES = {"nccl": nccl_one_rank, "shared-gpu": shared_gpu}


if __name__ == "__main__":
    run_case(CASES, __doc__)
