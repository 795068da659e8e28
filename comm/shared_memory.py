"""All-reduce through node shared memory, for host arrays in a group whose ranks share one node.

Why: tensor parallelism all-reduces a 4 MiB activation 72 times a step on the reference model.
MPICH moves it between two ranks through its shared-memory cells in 1.8-2.5 ms after a GEMM has
evicted the caches; copying it into a shared slot and summing the slots took 0.9-1.5 ms (a
two-rank loop of three 2048 x 512 x 768 GEMMs and one 4 MiB all-reduce, on the 2-core machine).

How: each group gets one MPI shared window: a header of two counters per rank, then one slot per
rank. Call number k on rank r:
  1. wait until every rank has read the slots of call k - 1 (slot r is free again);
  2. copy x into slot r, then publish posted[r] = k;
  3. wait until every rank has posted k;
  4. reduce the slots in rank order (the same order on every rank: every rank gets the same bits);
  5. publish read[r] = k.
MPI_Win_sync stands between writing data and publishing a counter, and between seeing a counter
and reading data: a memory barrier on processors that reorder stores (x86 does not).

comm.all_reduce_async posts (steps 1-2) and its wait() does the rest, so a rank that posts early
computes something else instead of waiting (tensor parallelism's backward: the weight gradient's
GEMM). One call is in flight per group at a time; a call made while one is (the data-parallel
buckets, several at once) goes through MPI. Calls come in the same order on every rank of the
group, as for any collective, so every rank makes the same choice. Small arrays (below
MIN_BYTES, where MPICH takes microseconds) and large ones (above MAX_BYTES, to bound the shared
memory) go through MPI too. NPMEGATRON_SHM_ALLREDUCE=0 turns the path off.
"""
import os

import numpy

MIN_BYTES = 64 << 10
MAX_BYTES = 16 << 20
PAGE = 4096                     # the header (posted[], read[]: int64 per rank) and each slot fill whole pages
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
    return channel if channel and not channel.in_flight else None


class SharedMemoryRequest:
    """A posted all-reduce (comm.all_reduce_async), reduced into x itself by Wait(). Test and
    Wait are the names of an mpi4py request's methods, so backends.MPIRequest wraps either."""

    def __init__(self, channel, x, op):
        self.channel, self.x, self.op = channel, x, op
        channel.post(x)

    def Test(self):
        return self.channel.ready()

    def Wait(self):
        self.channel.collect(self.x, self.op, out=self.x)


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
        self.calls, self.slot_bytes, self.window, self.in_flight = 0, 0, None, False

    def _grow(self, nbytes):
        """A window whose slots hold nbytes (collective: every rank asks for the same size)."""
        from mpi4py import MPI
        if self.window is not None:
            self.comm.Barrier()              # nobody reads the old slots any more
            self.window.Unlock_all()
            self.window.Free()
        self.slot_bytes = _pages(max(nbytes, MIN_BYTES))
        header = _pages(2 * self.size * 8)
        total = header + self.size * self.slot_bytes
        self.window = MPI.Win.Allocate_shared(total if self.rank == 0 else 0, 1, comm=self.comm)
        self.window.Lock_all(MPI.MODE_NOCHECK)
        memory, _ = self.window.Shared_query(0)
        whole = numpy.frombuffer(memory, numpy.uint8)
        counters = whole[:header].view(numpy.int64)
        self.posted, self.read = counters[:self.size], counters[self.size:2 * self.size]
        self.slots = whole[header:]
        self.posted[self.rank] = self.read[self.rank] = self.calls
        self.window.Sync()
        self.comm.Barrier()                  # every rank's counters are set before anyone looks

    def all_reduce(self, x, op):
        """The reduction of every rank's x, in a new array."""
        self.post(x)
        return self.collect(x, op)

    def post(self, x):
        """Steps 1-2: x enters this rank's slot. The channel is busy until collect()."""
        if x.nbytes > self.slot_bytes:
            self._grow(x.nbytes)
        self.calls += 1
        self.in_flight = True
        self._wait_until(self.read, self.calls - 1)
        numpy.copyto(self._slot(self.rank, x), x, casting="no")
        self.window.Sync()
        self.posted[self.rank] = self.calls

    def ready(self):
        """Every rank has posted: collect() will not wait."""
        return self.posted.min() >= self.calls

    def collect(self, x, op, out=None):
        """Steps 3-5: the reduction of the posted slots (x gives shape and dtype), into out."""
        self._wait_until(self.posted, self.calls)
        self.window.Sync()
        reduce = REDUCE[op]
        out = reduce(self._slot(0, x), self._slot(1, x), out=out)
        for peer in range(2, self.size):
            reduce(out, self._slot(peer, x), out=out)
        self.window.Sync()
        self.read[self.rank] = self.calls
        self.in_flight = False
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


def _pages(nbytes):
    return -(-nbytes // PAGE) * PAGE
