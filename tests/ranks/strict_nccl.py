"""Rank program for tests/test_strict_cupy.py: the strict CuPy stand-in's NCCL over MPI, on 4
ranks, with the stand-in first on PYTHONPATH (fakes.strict_cupy.strict_cupy_env()):

    mpiexec -n 4 python tests/ranks/strict_nccl.py all

Each rank uses GPU <world rank>. Communicators: the pairs {0, 1} and {2, 3} and the world,
created in different orders on the two pairs (so creations overlap); then collectives on each,
a group call in which every rank sends two messages to its right neighbour, a check that a
send outside a group call blocks until its receive is posted, and one that two ranks on one GPU
are refused."""
import threading
import time

import numpy

from cases import run_case


def _setup():
    import cupy
    from mpi4py import MPI
    assert "strict_cupy" in cupy.__file__, cupy.__file__
    world = MPI.COMM_WORLD
    assert world.Get_size() == 4, "run on 4 ranks"
    cupy.cuda.Device(world.Get_rank()).use()
    return cupy, world


def _ids(cupy, mpi_comm):
    """Rank 0 of the MPI communicator makes the id, the others get it by (pickled) bcast."""
    uid = cupy.cuda.nccl.get_unique_id() if mpi_comm.Get_rank() == 0 else None
    return mpi_comm.bcast(uid, root=0)


def _communicators(cupy, world):
    """(pair communicator, world communicator, pair MPI comm); pairs {0,1} and {2,3} create
    theirs first, the other pair second, so the rendezvous of both overlap."""
    nccl = cupy.cuda.nccl
    pair_mpi = world.Split(world.Get_rank() // 2, world.Get_rank())
    pair_id, world_id = _ids(cupy, pair_mpi), _ids(cupy, world)
    make_pair = lambda: nccl.NcclCommunicator(2, pair_id, pair_mpi.Get_rank())      # noqa: E731
    make_world = lambda: nccl.NcclCommunicator(4, world_id, world.Get_rank())       # noqa: E731
    if world.Get_rank() < 2:
        pair = make_pair()
        everyone = make_world()
    else:
        everyone = make_world()
        pair = make_pair()
    assert (pair.size(), pair.rank_id()) == (2, pair_mpi.Get_rank())
    assert (everyone.size(), everyone.rank_id()) == (4, world.Get_rank())
    return pair, everyone, pair_mpi


def _collectives(cupy, world, pair, everyone, stream):
    nccl, me = cupy.cuda.nccl, world.Get_rank()
    mate = me ^ 1
    host = lambda r: numpy.arange(6, dtype=numpy.float32) + 10 * r                 # noqa: E731
    x = cupy.arange(6, dtype=cupy.float32) + 10 * me

    out = cupy.empty_like(x)
    pair.allReduce(x.data.ptr, out.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    assert numpy.array_equal(out.get(), host(me) + host(mate))

    gathered = cupy.empty((4, 6), cupy.float32)
    everyone.allGather(x.data.ptr, gathered.data.ptr, x.size, nccl.NCCL_FLOAT32, stream.ptr)
    assert numpy.array_equal(gathered.get(), numpy.stack([host(r) for r in range(4)]))

    rows = cupy.arange(12, dtype=cupy.float64).reshape(4, 3) * (me + 1)
    mine = cupy.empty(3, cupy.float64)
    everyone.reduceScatter(rows.data.ptr, mine.data.ptr, 3, nccl.NCCL_FLOAT64, nccl.NCCL_SUM,
                           stream.ptr)
    assert numpy.array_equal(mine.get(), numpy.arange(12.0).reshape(4, 3)[me] * 10)

    y = cupy.full(5, me, dtype=cupy.int64)
    pair.bcast(y.data.ptr, y.size, nccl.NCCL_INT64, 1, stream.ptr)
    assert y.get().tolist() == [me | 1] * 5

    z = cupy.full(4, me, dtype=cupy.float16)
    everyone.allReduce(z.data.ptr, z.data.ptr, z.size, nccl.NCCL_FLOAT16, nccl.NCCL_MAX, stream.ptr)
    assert z.get().tolist() == [3.0] * 4

    logged = cupy._strict.events("nccl.")
    calls = [e for e in logged if e["what"] in ("nccl.allReduce", "nccl.allGather",
                                                "nccl.reduceScatter", "nccl.bcast")]
    assert len(calls) == 5 and all(e["stream"] == stream.ptr for e in calls), calls


def _p2p_group(cupy, world, everyone, stream):
    """Two same-shaped messages to the right neighbour inside one group call: they arrive in
    issue order (NCCL has no tags)."""
    nccl, me = cupy.cuda.nccl, world.Get_rank()
    right, left = (me + 1) % 4, (me - 1) % 4
    first, second = cupy.full(3, 100 * me, cupy.int32), cupy.full(3, 100 * me + 1, cupy.int32)
    got = [cupy.zeros(3, cupy.int32), cupy.zeros(3, cupy.int32)]
    nccl.groupStart()
    everyone.send(first.data.ptr, 3, nccl.NCCL_INT32, right, stream.ptr)
    nccl.groupStart()                                    # nested: still one group
    everyone.send(second.data.ptr, 3, nccl.NCCL_INT32, right, stream.ptr)
    everyone.recv(got[0].data.ptr, 3, nccl.NCCL_INT32, left, stream.ptr)
    nccl.groupEnd()
    assert got[0].get().tolist() == [0, 0, 0], "data moved before the outermost groupEnd"
    everyone.recv(got[1].data.ptr, 3, nccl.NCCL_INT32, left, stream.ptr)
    nccl.groupEnd()
    pending = cupy.cuda.stream.pending.get(stream.ptr, [])
    assert len(pending) == 4, "transfers on a stream finish when waited for, as on a GPU"
    stream.synchronize()
    assert got[0].get().tolist() == [100 * left] * 3, got[0].get()
    assert got[1].get().tolist() == [100 * left + 1] * 3, got[1].get()


def _send_blocks(cupy, world, pair, pair_mpi, stream):
    """Both ranks of a pair send first: each send must still be blocked when both have looked
    (a barrier, on another communicator, separates looking from receiving), then the receives
    release them. An eagerly buffered send would have returned at once. (On the null stream,
    which the stand-in runs at once; on another stream a send starts and the host goes on.)"""
    stream = cupy.cuda.Stream.null
    nccl = cupy.cuda.nccl
    mate = pair_mpi.Get_rank() ^ 1
    mine = cupy.full(4, world.Get_rank(), cupy.float32)
    theirs = cupy.zeros(4, cupy.float32)
    pair_mpi.Barrier()
    sender = threading.Thread(target=pair.send, args=(mine.data.ptr, 4, nccl.NCCL_FLOAT32, mate,
                                                      stream.ptr))
    sender.start()
    time.sleep(0.3)
    blocked = sender.is_alive()
    pair_mpi.Barrier()
    pair.recv(theirs.data.ptr, 4, nccl.NCCL_FLOAT32, mate, stream.ptr)
    sender.join(timeout=30)
    assert blocked, "a send with no posted receive returned: it was buffered"
    assert not sender.is_alive()
    assert theirs.get().tolist() == [float(world.Get_rank() ^ 1)] * 4


def _duplicate_gpu_refused(cupy, pair_mpi):
    """NCCL refuses a communicator with two ranks on one GPU: both ranks of each pair try one
    on device 0, and both get the error (the root tells the member)."""
    nccl = cupy.cuda.nccl
    uid = _ids(cupy, pair_mpi)
    with cupy.cuda.Device(0):
        try:
            nccl.NcclCommunicator(2, uid, pair_mpi.Get_rank())
        except nccl.NcclError as error:
            assert "Duplicate GPU" in str(error), error
        else:
            raise AssertionError("two ranks on one GPU were accepted")


def everything():
    cupy, world = _setup()
    pair, everyone, pair_mpi = _communicators(cupy, world)
    stream = cupy.cuda.Stream(non_blocking=True)
    _collectives(cupy, world, pair, everyone, stream)
    _p2p_group(cupy, world, everyone, stream)
    _send_blocks(cupy, world, pair, pair_mpi, stream)
    _duplicate_gpu_refused(cupy, pair_mpi)
    world.Barrier()
    print(f"rank {world.Get_rank()} ok", flush=True)


CASES = {"all": everything}


if __name__ == "__main__":
    run_case(CASES, __doc__)
