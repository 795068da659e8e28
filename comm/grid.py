"""ProcessGrid(tp, pp, dp): every group built from one rank grid, as Megatron's parallel_state.

TP varies fastest (rank = tp + TP * (dp + DP * pp)), so a tensor-parallel group is neighbouring
ranks (one node on a cluster), then data parallel, then pipeline stages.
"""
from npmegatron.autograd.errors import InputError

from .backends import connect_nccl
from .group import Group
from .runtime import init


def grid_coordinates(rank, tp, dp):
    """(tp_rank, dp_rank, pp_rank) of a global rank."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def grid_ranks(world_size, tp, pp, dp):
    """The rank lists of every group kind, computed without MPI (so 16-rank layouts are testable
    in one process): tp, dp, pp, mp (model parallel: TP x PP, one per DP replica) and embd
    (first and last pipeline stage, for the tied embedding)."""
    for name, size in (("tensor", tp), ("pipeline", pp), ("data", dp)):
        if size < 1:
            raise InputError(f"{name}-parallel size {size} must be a positive integer")
    if tp * pp * dp != world_size:
        raise InputError(f"world size {world_size} does not equal TP x PP x DP = {tp} x {pp} x {dp} "
                         f"= {tp * pp * dp}; launch {tp * pp * dp} ranks or change the sizes")
    rank = lambda t, d, p: t + tp * (d + dp * p)
    return {
        "tp": [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "mp": [sorted(rank(t, d, p) for p in range(pp) for t in range(tp)) for d in range(dp)],
        "embd": [sorted({rank(t, d, 0), rank(t, d, pp - 1)}) for d in range(dp) for t in range(tp)],
    }


def _split(world, name, lists):
    """This rank's group among `lists` (MPI Comm.Split, collective over the world)."""
    from mpi4py import MPI
    me = world.rank
    mine = next((i for i, ranks in enumerate(lists) if me in ranks), None)
    color = MPI.UNDEFINED if mine is None else mine
    key = 0 if mine is None else lists[mine].index(me)
    comm = world.mpi.Split(color, key)
    return None if mine is None else Group(name, comm, lists[mine])


class ProcessGrid:
    """Tensor x pipeline x data parallel groups over the world, with axis-prefixed attributes."""

    def __init__(self, tp=1, pp=1, dp=None, world=None, nccl=False):
        """nccl: the run computes on GPUs, so create every NCCL communicator now (connect_nccl)."""
        world = world or init()
        if dp is None:
            if world.size % (tp * pp):
                raise InputError(f"world size {world.size} is not divisible by TP x PP = {tp * pp}; "
                                 "launch a multiple of TP x PP ranks (mpirun -n N)")
            dp = world.size // (tp * pp)
        layout = grid_ranks(world.size, tp, pp, dp)
        self.world, self.rank, self.world_size = world, world.rank, world.size
        self.tp_size, self.pp_size, self.dp_size = tp, pp, dp
        self.tp_rank, self.dp_rank, self.pp_rank = grid_coordinates(world.rank, tp, dp)
        self.tp_group = _split(world, "tp", layout["tp"])
        self.dp_group = _split(world, "dp", layout["dp"])
        self.pp_group = _split(world, "pp", layout["pp"])
        self.mp_group = _split(world, "mp", layout["mp"])
        self.embedding_group = _split(world, "embd", layout["embd"])
        ring = self.pp_group.ranks
        self.pp_next_rank = ring[(self.pp_rank + 1) % pp]     # global ranks, wrapping as Megatron
        self.pp_prev_rank = ring[(self.pp_rank - 1) % pp]
        if nccl:
            self.connect_nccl()

    def connect_nccl(self):
        """Every NCCL communicator this rank's collectives and pipeline messages will use, made
        now in one order on every rank: TP, DP, PP, model-parallel and embedding groups, then the
        pipeline's pairs (a no-op where NCCL does not serve the GPU arrays). Groups of one rank
        have none: their collectives return at once. The world's collectives carry host arrays."""
        groups = [self.tp_group, self.dp_group, self.pp_group, self.mp_group, self.embedding_group]
        connect_nccl([g for g in groups if g is not None and g.size > 1],
                     [self.pp_group] if self.pp_size > 1 else [])

    @classmethod
    def single(cls):
        """The 1 x 1 x 1 grid of a serial run, without MPI."""
        grid = cls.__new__(cls)
        grid.world = Group.single("world")
        grid.rank, grid.world_size = 0, 1
        grid.tp_size = grid.pp_size = grid.dp_size = 1
        grid.tp_rank = grid.dp_rank = grid.pp_rank = 0
        for name in ("tp", "dp", "pp", "mp"):
            setattr(grid, f"{name}_group", Group.single(name))
        grid.embedding_group = Group.single("embd")
        grid.pp_next_rank = grid.pp_prev_rank = 0
        return grid

    def __str__(self):
        return f"TP({self.tp_size})-PP({self.pp_size})-DP({self.dp_size})-Rank({self.rank})"

    __repr__ = __str__
