"""Rank program for tests/comm/test_all_to_all.py: comm.all_to_all and comm.all_to_all_v held to
a NumPy reference that every rank computes alike from one seed (every rank's input and the
matrix of counts, with empty splits), in float64 and bfloat16, on the world and on a grid's
groups, and the calls' counts and bytes in comm.stats().

    mpiexec -n N python tests/ranks/all_to_all.py host     # NumPy arrays: MPI's Alltoall(v)
    mpiexec -n N python tests/ranks/all_to_all.py device   # CuPy arrays under the strict stand-in:
                                                            # NCCL with strict_cupy_env(devices=N),
                                                            # MPI staged through host with devices=1
    mpiexec -n 2 python tests/ranks/all_to_all.py debug    # counts that disagree, under
                                                            # NPMEGATRON_DEBUG_COMM=1
"""
import ml_dtypes
import numpy as np

from cases import run_case

from npmegatron import comm

SEED = 1234
DTYPES = [np.float64, ml_dtypes.bfloat16]
ROWS = [(3, 2), ()]                     # each row of x: a (3, 2) block, or one value (x is 1-D)


def count_matrices(n):
    """[i, j]: rows group rank i sends group rank j, for every case: random with zeros, a rank
    that sends nothing at all, a rank that receives nothing, nothing anywhere (x of 0 rows on
    every rank), and one rank that sends everything it has to itself."""
    rng = np.random.default_rng([SEED, n])
    random = rng.integers(0, 4, (n, n))
    random[0, n - 1] = 0
    silent, deaf = rng.integers(1, 4, (n, n)), rng.integers(0, 3, (n, n))
    silent[n - 1] = 0
    deaf[:, 0] = 0
    selfish = rng.integers(0, 3, (n, n))
    selfish[1] = 0
    selfish[1, 1] = 5
    return {"random": random, "silent": silent, "deaf": deaf, "empty": np.zeros((n, n), int),
            "selfish": selfish}


def rows_of(group_rank_to_global, i, counts, row, dtype, case):
    """Group rank i's x: its rows to every peer in rank order, from the seed and its global rank."""
    rng = np.random.default_rng([SEED, group_rank_to_global[i], sum(map(ord, case)), len(row)])
    return rng.standard_normal((int(counts[i].sum()),) + row).astype(dtype)


def expected(group, counts, row, dtype, case):
    """What group rank `group.rank` receives: from each rank j, in order, the part of j's x meant
    for it."""
    me, parts = group.rank, []
    for j in range(group.size):
        x = rows_of(group.ranks, j, counts, row, dtype, case)
        start = counts[j, :me].sum()
        parts.append(x[start:start + counts[j, me]])
    return np.concatenate(parts)


def same(got, want):
    """Equal bits (bfloat16 compared as its 16-bit patterns)."""
    if want.dtype == ml_dtypes.bfloat16:
        got, want = got.view(np.uint16), want.view(np.uint16)
    return got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


def check_group(group, xp, to_host):
    """Every case, dtype and row shape through all_to_all_v, and the even ones through all_to_all;
    returns (calls, bytes) of each op, for the statistics."""
    made = {"all_to_all": [0, 0], "all_to_all_v": [0, 0]}
    for case, counts in count_matrices(group.size).items():
        for dtype in DTYPES:
            for row in ROWS:
                x = rows_of(group.ranks, group.rank, counts, row, dtype, case)
                y = comm.all_to_all_v(xp.asarray(x), group, counts[group.rank], counts[:, group.rank].tolist())
                assert same(to_host(y), expected(group, counts, row, dtype, case)), (group, case, dtype, row)
                made["all_to_all_v"][0] += 1
                made["all_to_all_v"][1] += x.nbytes
    for block in (2, 0):                # even splits: every rank sends `block` rows to each
        counts = np.full((group.size, group.size), block)
        for dtype in DTYPES:
            x = rows_of(group.ranks, group.rank, counts, (3, 2), dtype, "even")
            y = comm.all_to_all(xp.asarray(x), group)
            assert same(to_host(y), expected(group, counts, (3, 2), dtype, "even")), (group, block, dtype)
            made["all_to_all"][0] += 1
            made["all_to_all"][1] += x.nbytes
    return made


def groups_of(world):
    """The world, and on four ranks a TP = 2 x DP = 2 grid's groups (group ranks != global ranks)."""
    if world.size != 4:
        return [world]
    grid = comm.ProcessGrid(tp=2, pp=1, dp=2)
    return [world, grid.tp_group, grid.dp_group]


def run(xp, to_host):
    world = comm.init()
    comm.reset_stats()
    totals = {}
    for group in groups_of(world):
        for op, (calls, nbytes) in check_group(group, xp, to_host).items():
            stats = comm.stats()
            assert stats.count(op, group.name) == calls, (op, group, stats)
            assert stats.bytes(op, group.name) == nbytes, (op, group, stats)
            totals[op] = totals.get(op, 0) + calls
    assert all(comm.stats().count(op) == n for op, n in totals.items()), comm.stats()
    return world


def host():
    world = run(np, lambda y: y)
    print("rank", world.rank, "all_to_all ok", flush=True)


def device():
    """CuPy arrays: through NCCL where each rank has a GPU of its own, one group call per
    all-to-all with a send and a receive per peer that has rows to move, none for a count of
    zero; else (ranks sharing a GPU) through MPI, staged in host memory."""
    import cupy
    from npmegatron.comm.backends import backend_for
    assert "strict_cupy" in cupy.__file__, cupy.__file__
    world = run(cupy, lambda y: y.get())
    backend = backend_for(cupy.ones(1)).name
    sends, groups = cupy._strict.events("nccl.send"), cupy._strict.events("nccl.groupStart")
    if cupy.cuda.runtime.getDeviceCount() >= world.size:
        assert backend == "nccl" and groups, backend
        assert sends and all(e["grouped"] and e["count"] > 0 for e in sends), sends[:3]
    else:
        assert backend == "mpi" and not sends, backend
    print("rank", world.rank, f"all_to_all on {backend} ok", len(sends), "sends", flush=True)


def debug():
    """Rank 1 expects one row too many from rank 0: every rank raises CommMismatchError."""
    world = comm.init()
    recv = [1, 1] if world.rank == 0 else [2, 1]
    try:
        comm.all_to_all_v(np.zeros((2, 3)), world, [1, 1], recv)
    except comm.CommMismatchError as error:
        print("rank", world.rank, "mismatch:", error, flush=True)
    else:
        raise AssertionError("disagreeing counts were not caught")


CASES = {"host": host, "device": device, "debug": debug}


if __name__ == "__main__":
    run_case(CASES, __doc__)
