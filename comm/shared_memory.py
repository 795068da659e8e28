"""All-reduce through node shared memory, for host arrays in a group whose ranks share one node.

Why: tensor parallelism all-reduces a 4 MiB activation 72 times a step on the reference model.
MPICH moves it between two ranks through its shared-memory cells in 1.8-2.5 ms after a GEMM has
evicted the caches; copying it into a shared slot and summing the slots takes 0.9-1.5 ms (two
ranks on this 2-core machine; scripts/bench_sync_jitter.py's neighbour, measured both ways).

How: each group gets one MPI shared window: a header of two counters per rank, then one slot per
rank. Call number k on rank r:
  1. wait until every rank has read the slots of call k - 1 (slot r is free again);
  2. copy x into slot r, then publish posted[r] = k;
  3. wait until every rank has posted k;
  4. reduce the slots in rank order (the same order on every rank: every rank gets the same bits);
  5. publish read[r] = k.
MPI_Win_sync stands between writing data and publishing a counter, and between seeing a counter
and reading data: a memory barrier on processors that reorder stores (x86 does not).

One call is in flight per group at a time, so calls must come in the same order on every rank
of the group, as for any collective. Small arrays (below MIN_BYTES, where MPICH's own path costs
microseconds) and large ones (above MAX_BYTES, to bound shared memory) go through MPI.
NPMEGATRON_SHM_ALLREDUCE=0 turns the path off.
"""
import os

import numpy

MIN_BYTES = 64 << 10
MAX_BYTES = 16 << 20
HEADER_BYTES = 4096             # posted[], read[] (int64 per rank); slots start on a page
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64))
REDUCE = {"sum": numpy.add, "max": numpy.maximum, "min": numpy.minimum}


def enabled():
    return os.environ.get("NPMEGATRON_SHM_ALLREDUCE", "1") not in ("", "0")


def channel_for(group, x):
    """The group's shared-memory channel when this all-reduce should take it, else None. The
    answer depends only on what every rank of the group shares (size, dtype, node), so all
    ranks agree."""
    if not (enabled() and MIN_BYTES <= x.nbytes <= MAX_BYTES and x.dtype in DTYPES):
        return None
    channel = group.shared_memory
    if channel is None:
        channel = group.shared_memory = SharedMemoryChannel.open(group)
    return channel or None


class SharedMemoryChannel:
    """The shared window of one group (see the module docstring for the protocol)."""

    @classmethod
    def open(cls, group):
        """A channel, or False when the group's ranks are not all on one node (collective)."""
        from mpi4py import MPI
        node = group.mpi.Split_type(MPI.COMM_TYPE_SHARED)
        on_one_node = node.Get_size() == group.size
        node.Free()
        if not on_one_node:
            return False
        return cls(group.mpi)

    def __init__(self, mpi_comm):
        self.comm, self.rank, self.size = mpi_comm, mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.calls, self.slot_bytes, self.window = 0, 0, None

    def _grow(self, nbytes):
        """A window whose slots hold nbytes (collective: every rank asks for the same size)."""
        from mpi4py import MPI
        if self.window is not None:
            self.comm.Barrier()              # nobody reads the old slots any more
            self.window.Unlock_all()
            self.window.Free()
        self.slot_bytes = max(nbytes, MIN_BYTES)
        total = HEADER_BYTES + self.size * self.slot_bytes
        self.window = MPI.Win.Allocate_shared(total if self.rank == 0 else 0, 1, comm=self.comm)
        self.window.Lock_all(MPI.MODE_NOCHECK)
        memory, _ = self.window.Shared_query(0)
        whole = numpy.frombuffer(memory, numpy.uint8)
        counters = whole[:HEADER_BYTES].view(numpy.int64)
        self.posted, self.read = counters[:self.size], counters[self.size:2 * self.size]
        self.slots = whole[HEADER_BYTES:]
        self.posted[self.rank] = self.read[self.rank] = self.calls
        self.window.Sync()
        self.comm.Barrier()                  # every rank's counters are set before anyone looks

    def all_reduce(self, x, op):
        if x.nbytes > self.slot_bytes:
            self._grow(x.nbytes)
        self.calls += 1
        k = self.calls
        self._wait_until(self.read, k - 1)
        mine = self._slot(self.rank, x)
        numpy.copyto(mine, x, casting="no")
        self.window.Sync()
        self.posted[self.rank] = k
        self._wait_until(self.posted, k)
        self.window.Sync()
        reduce = REDUCE[op]
        out = reduce(self._slot(0, x), self._slot(1, x))
        for peer in range(2, self.size):
            reduce(out, self._slot(peer, x), out=out)
        self.window.Sync()
        self.read[self.rank] = k
        return out

    def _slot(self, rank, x):
        start = rank * self.slot_bytes
        return self.slots[start:start + x.nbytes].view(x.dtype).reshape(x.shape)

    def _wait_until(self, counters, k):
        """Spin until every rank's counter reaches k, yielding the core each time round: where
        ranks outnumber cores the rank we wait for may need it (the yield costs about a
        microsecond when nothing else is runnable)."""
        while counters.min() < k:
            os.sched_yield()
