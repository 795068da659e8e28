"""A communication group: a name (for the accounting), its global ranks and its MPI communicator.

Groups are passed to every call, never looked up globally; a group of one rank makes every
collective a no-op, so TP=1 is the serial model itself.
"""


class Group:
    def __init__(self, name, mpi_comm, ranks):
        self.name = name
        self.mpi = mpi_comm
        self.ranks = tuple(ranks)           # global rank of each member, in group-rank order
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.nccl = None                    # made by ProcessGrid.connect_nccl (else at the first GPU call)
        self.nccl_pairs = None              # one-way NCCL pairs for point-to-point (NCCLBackend._pair)
        self.shared_memory = None           # comm/shared_memory.py's window, on the first large all-reduce

    @classmethod
    def single(cls, name, rank=0):
        """A group of one rank that needs no MPI: every collective on it returns at once."""
        group = cls.__new__(cls)
        group.name, group.mpi, group.ranks = name, None, (rank,)
        group.rank, group.size, group.nccl, group.nccl_pairs, group.shared_memory = 0, 1, None, None, None
        return group

    def __repr__(self):
        return f"Group({self.name}, ranks={list(self.ranks)}, rank={self.rank})"
