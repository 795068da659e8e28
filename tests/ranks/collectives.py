"""Rank program for tests/comm/test_collectives.py: collectives and point-to-point with
hand-computed values (inputs are `ones * rank`, so a sum all-reduce over ranks R gives sum(R)
everywhere, and so on), the comm statistics, and the BLAS thread pinning.

    mpiexec -n N python tests/ranks/collectives.py world       # test_collectives_and_p2p_on_the_world
    mpiexec -n 8 python tests/ranks/collectives.py grid        # test_every_group_of_a_2x2x2_grid
    mpiexec -n 2 python tests/ranks/collectives.py stats       # test_stats_count_calls_bytes_and_reset
    mpiexec -n 2 python tests/ranks/collectives.py blas        # test_blas_is_pinned_to_cores_over_local_ranks
    mpiexec -n N python tests/ranks/collectives.py shared-memory   # test_large_all_reduces_through_shared_memory
"""
import os

import numpy as np

from cases import run_case

from npmegatron import comm

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
SHAPES = [(), (5,), (3, 4), (2, 3, 4), (0, 3)]


def values(shape, dtype, rank):
    return (np.ones(shape) * rank).astype(dtype)


def non_contiguous(shape, dtype, rank):
    """Same values through a strided view (every other column of a wider array)."""
    if len(shape) < 2:
        return values(shape, dtype, rank)
    wide = values(shape[:-1] + (2 * shape[-1],), dtype, rank)
    view = wide[..., ::2]
    assert not view.flags.c_contiguous or view.size == 0
    return view


def check_group(world, group):
    ranks = group.ranks                     # global ranks in group order; inputs are ones * global rank
    me = world.rank
    for dtype in DTYPES:
        for shape in SHAPES:
            for make in (values, non_contiguous):
                x = make(shape, dtype, me)
                for op, expect in (("sum", sum(ranks)), ("max", max(ranks)), ("min", min(ranks))):
                    y = comm.all_reduce(x, group, op)
                    assert y.dtype == x.dtype and y.shape == x.shape, (op, y.dtype, y.shape)
                    assert np.array_equal(y, np.full(shape, expect, dtype)), (op, dtype, shape, y)
                if len(shape):
                    for axis in range(len(shape)):
                        y = comm.all_gather(x, group, axis)
                        ref = np.concatenate([values(shape, dtype, r) for r in ranks], axis=axis)
                        assert y.shape == ref.shape and np.array_equal(y, ref), (axis, dtype, shape)
                root = group.size - 1
                y = comm.broadcast(x, group, root)
                assert np.array_equal(y, np.full(shape, ranks[root], dtype)), (dtype, shape)
            # reduce-scatter: rank r holds base + r; the sum is n * base + sum(ranks), split in blocks
            for axis in (0, 1):
                full = (group.size * 2, 3) if axis == 0 else (3, group.size * 2)
                base = np.arange(np.prod(full)).reshape(full) % 7
                x = (base + me).astype(dtype)
                y = comm.reduce_scatter(x, group, axis)
                expect = np.split((group.size * base + sum(ranks)).astype(dtype), group.size, axis)[group.rank]
                assert np.array_equal(y, expect), (axis, dtype, y, expect)
                assert np.array_equal(comm.reduce_scatter(x, group, axis, op="max"),
                                      np.split((base + max(ranks)).astype(dtype), group.size, axis)[group.rank])
            # the non-blocking form of the distributed optimizer's buckets: 1-D, in even blocks
            flat = (np.arange(group.size * 5) % 7 + me).astype(dtype)
            request = comm.reduce_scatter_async(flat, group)
            expect = np.split((group.size * (np.arange(group.size * 5) % 7) + sum(ranks)).astype(dtype),
                              group.size)[group.rank]
            assert np.array_equal(request.wait(), expect), (dtype, expect)
    comm.barrier(group)


def check_point_to_point(group):
    n, r = group.size, group.rank
    right, left = (r + 1) % n, (r - 1) % n
    for dtype in DTYPES:
        for shape in ((4, 3), (0,), (2, 2, 2)):
            x = values(shape, dtype, group.ranks[r])
            got = comm.sendrecv(x, right, left, group=group)
            assert np.array_equal(got, values(shape, dtype, group.ranks[left])), (dtype, shape)
            reqs = [comm.irecv(left, shape, dtype, group=group, tag=3), comm.isend(x, right, group=group, tag=3)]
            got = comm.wait_all(reqs)[0]
            assert np.array_equal(got, values(shape, dtype, group.ranks[left]))
    # blocking send/recv pairs ordered so they cannot deadlock: even ranks send first
    if n > 1:
        x = non_contiguous((3, 4), np.float64, group.ranks[r])
        if r % 2 == 0:
            if right != r and not (n % 2 and r == n - 1):
                comm.send(x, right, group=group)
            if not (n % 2 and r == 0):
                got = comm.recv(left, (3, 4), np.float64, group=group)
                assert np.array_equal(got, values((3, 4), np.float64, group.ranks[left]))
        else:
            got = comm.recv(left, (3, 4), np.float64, group=group)
            assert np.array_equal(got, values((3, 4), np.float64, group.ranks[left]))
            comm.send(x, right, group=group)
    # a batch listed in opposite orders on neighbours (sends first on even ranks) must not deadlock
    ops = [comm.P2POp("send", right, array=values((6,), np.float32, group.ranks[r])),
           comm.P2POp("send", left, array=values((6,), np.float32, group.ranks[r])),
           comm.P2POp("recv", left, shape=(6,), dtype=np.float32),
           comm.P2POp("recv", right, shape=(6,), dtype=np.float32)]
    if r % 2:
        ops = ops[::-1]
    results = comm.wait_all(comm.batch_isend_irecv(ops, group))
    received = [res for op, res in zip(ops, results) if op.kind == "recv"]
    peers = [op.peer for op in ops if op.kind == "recv"]
    for peer, res in zip(peers, received):
        assert np.array_equal(res, values((6,), np.float32, group.ranks[peer]))


def world_ops():
    """Every collective and point-to-point operation on the world group."""
    world = comm.init()
    check_group(world, world)
    check_point_to_point(world)
    print("rank", world.rank, "ok")


def grid_groups():
    """Every group of a TP=2 x PP=2 x DP=2 grid on 8 ranks; each rank reports its groups."""
    world = comm.init()
    grid = comm.ProcessGrid(tp=2, pp=2, dp=2)
    for group in (grid.tp_group, grid.pp_group, grid.dp_group, grid.mp_group, grid.embedding_group):
        check_group(world, group)
    for group in (grid.tp_group, grid.pp_group, grid.dp_group):
        check_point_to_point(group)
    print(f"<{grid} tp {list(grid.tp_group.ranks)} dp {list(grid.dp_group.ranks)} "
          f"pp {list(grid.pp_group.ranks)} next {grid.pp_next_rank} prev {grid.pp_prev_rank}>", flush=True)


def stats():
    """comm.stats() counts calls and bytes per operation and group, and resets."""
    world = comm.init()
    grid = comm.ProcessGrid(tp=2, pp=1, dp=1)
    comm.reset_stats()
    x = np.ones((4, 8), np.float32)
    for _ in range(3):
        comm.all_reduce(x, grid.tp_group)
    comm.all_gather(x, grid.tp_group, axis=1)
    comm.reduce_scatter(x, grid.tp_group, axis=0)
    comm.all_reduce(x, grid.dp_group)            # a group of one rank: no call, nothing recorded
    comm.sendrecv(x, 1 - world.rank, 1 - world.rank)
    s = comm.stats()
    assert s.count("all_reduce", "tp") == 3 and s.bytes("all_reduce", "tp") == 3 * 128, s
    assert s.count("all_reduce", "dp") == 0 and s.count("all_reduce") == 3, s
    assert s.count("all_gather", "tp") == 1 and s.count("reduce_scatter") == 1, s
    assert s.count("send", "world") == 1 and s.bytes("recv", "world") == 128, s
    assert s.seconds("all_reduce") > 0
    comm.reset_stats()
    assert comm.stats().count("all_reduce") == 0


def blas_threads():
    """BLAS runs cores // local ranks threads on each rank."""
    from threadpoolctl import threadpool_info
    comm.init()
    cores = len(os.sched_getaffinity(0))
    blas = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    assert comm.blas_threads() == max(1, cores // comm.local_size()), comm.blas_threads()
    assert blas and all(t == comm.blas_threads() for t in blas), blas
    print("threads", comm.blas_threads())


def shared_memory():
    """Large all-reduces take comm's shared-memory channel and give the same bits as summing
    every rank's input in rank order; sizes past its limits go through MPI; two groups each
    keep their own window; a result stays valid after the next call."""
    from npmegatron.comm import shared_memory as shm
    world = comm.init()
    groups = [world]
    if world.size == 4:
        grid = comm.ProcessGrid(tp=2, pp=1, dp=2)
        groups += [grid.tp_group, grid.dp_group]

    def inputs(shape, dtype, rank, call):
        return np.random.default_rng([rank, call]).standard_normal(shape).astype(dtype)

    cases = [((shm.MIN_BYTES // 4,), np.float32), ((2048, 512), np.float32), ((300, 301), np.float64),
             ((shm.MAX_BYTES // 8,), np.float64), ((shm.MAX_BYTES // 4 + 1,), np.float32),
             ((shm.MIN_BYTES // 4 - 1,), np.float32), ((2048, 512), np.float32)]
    kept = []
    for call, (shape, dtype) in enumerate(cases):
        for group in groups:
            before = group.shared_memory.calls if group.shared_memory else 0
            x = inputs(shape, dtype, world.rank, call)
            strided = np.repeat(x[..., None], 2, axis=-1)[..., 0]        # the same values, not contiguous
            for op, reduce in (("sum", np.add), ("max", np.maximum), ("min", np.minimum)):
                expect = inputs(shape, dtype, group.ranks[0], call)
                for peer in group.ranks[1:]:
                    expect = reduce(expect, inputs(shape, dtype, peer, call))
                y = comm.all_reduce(strided if op == "max" else x, group, op)
                assert y.dtype == x.dtype, (group, shape, dtype, op)
                if shm.MIN_BYTES <= x.nbytes <= shm.MAX_BYTES:
                    assert np.array_equal(y, expect), (group, shape, dtype, op)
                else:               # MPI's own order of summation (pairwise on 4 ranks)
                    np.testing.assert_allclose(y, expect, rtol=1e-5, atol=1e-5)
            kept.append((y, y.copy()))
            took = group.shared_memory.calls - before if group.shared_memory else 0
            assert took == (3 if shm.MIN_BYTES <= x.nbytes <= shm.MAX_BYTES else 0), (shape, took)
    assert all(np.array_equal(a, b) for a, b in kept)
    check_async_shared_memory(world, inputs)
    print("rank", world.rank, "shared memory ok", world.shared_memory.slot_bytes)


def check_async_shared_memory(world, inputs):
    """all_reduce_async posts into shared memory and reduces in place at wait(); while it is in
    flight, other all-reduces on the group (async or not) go through MPI."""
    channel = world.shared_memory
    shape, ranks = (512, 256), world.ranks
    expect = [sum(inputs(shape, np.float64, r, call) for r in ranks) for call in (100, 101, 102)]
    first, second, third = (inputs(shape, np.float64, world.rank, call) for call in (100, 101, 102))
    before = channel.calls
    request = comm.all_reduce_async(first, world)
    assert channel.in_flight and channel.calls == before + 1
    other = comm.all_reduce_async(second, world)               # MPI: the channel is busy
    blocking = comm.all_reduce(third, world)                   # MPI as well
    assert request.wait() is first and not channel.in_flight and channel.calls == before + 1
    other.wait()
    for got, want in zip((first, second, blocking), expect):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.array_equal(first, expect[0])                     # the channel sums in rank order


CASES = {"world": world_ops, "grid": grid_groups, "stats": stats, "blas": blas_threads,
         "shared-memory": shared_memory}


if __name__ == "__main__":
    run_case(CASES, __doc__)
