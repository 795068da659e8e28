"""ProcessGrid(tp, pp, dp, cp): every group built from one rank grid, as Megatron's parallel_state.

TP varies fastest, then context parallelism, then data parallelism, then pipeline stages
(rank = tp + TP * (cp + CP * (dp + DP * pp))), so a tensor-parallel group is neighbouring ranks
(one node on a cluster), and a context-parallel group lies inside a data-parallel replica's
ranks as in Megatron-LM, where gradients are averaged over DP and CP together.
"""
from npmegatron.autograd.errors import InputError

from .backends import connect_nccl
from .group import Group
from .runtime import init


def grid_coordinates(rank, tp, dp, cp=1):
    """(tp_rank, dp_rank, pp_rank) of a global rank (its cp_rank is (rank // tp) % cp)."""
    return rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)


def grid_ranks(world_size, tp, pp, dp, cp=1, ep=1):
    """The rank lists of every group kind, computed without MPI (so 16-rank layouts are testable
    in one process): tp, cp, dp, dp_cp (the ranks gradients are averaged over), pp, mp (model
    parallel: TP x PP, one per DP and CP position), embd (first and last pipeline stage, for the
    tied embedding), ep (expert parallelism: EP neighbouring ranks of the DP x CP ranks, context
    ranks first, which split the experts, as Megatron-Core carves them) and edp (the ranks holding
    the same experts, over which their gradients are summed)."""
    for name, size in (("tensor", tp), ("pipeline", pp), ("data", dp), ("context", cp)):
        if size < 1:
            raise InputError(f"{name}-parallel size {size} must be a positive integer")
    if tp * pp * dp * cp != world_size:
        sizes, names = (tp, pp, dp) + ((cp,) if cp > 1 else ()), "TP x PP x DP" + (" x CP" if cp > 1 else "")
        raise InputError(f"world size {world_size} does not equal {names} = {' x '.join(map(str, sizes))} "
                         f"= {tp * pp * dp * cp}; launch {tp * pp * dp * cp} ranks or change the sizes")
    rank = lambda t, c, d, p: t + tp * (c + cp * (d + dp * p))
    place = lambda c, d: c + cp * d         # among the DP x CP ranks, in rank order
    every = [(t, c, d, p) for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)]

    def groups(key, member):
        """Ranks grouped by `key`, each group ordered by `member` (its rank in the group)."""
        out = {}
        for coords in every:
            out.setdefault(key(*coords), []).append((member(*coords), rank(*coords)))
        return [[r for _, r in sorted(members)] for _, members in sorted(out.items())]

    return {
        "tp": groups(lambda t, c, d, p: (p, d, c), lambda t, c, d, p: t),
        "cp": groups(lambda t, c, d, p: (p, d, t), lambda t, c, d, p: c),
        "dp": groups(lambda t, c, d, p: (p, c, t), lambda t, c, d, p: d),
        "dp_cp": groups(lambda t, c, d, p: (p, t), lambda t, c, d, p: (d, c)),
        "pp": groups(lambda t, c, d, p: (d, c, t), lambda t, c, d, p: p),
        "mp": groups(lambda t, c, d, p: (d, c), lambda t, c, d, p: (p, t)),
        "embd": [sorted({rank(t, c, d, 0), rank(t, c, d, pp - 1)}) for d in range(dp) for c in range(cp)
                 for t in range(tp)],
        "ep": groups(lambda t, c, d, p: (p, t, place(c, d) // ep), lambda t, c, d, p: place(c, d) % ep),
        "edp": groups(lambda t, c, d, p: (p, t, place(c, d) % ep), lambda t, c, d, p: place(c, d) // ep),
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
    """Tensor x context x data x pipeline parallel groups over the world, with axis-prefixed
    attributes; `dp_cp_group` is DP and CP together, the group gradients are averaged over (the
    DP group itself when CP is 1)."""

    def __init__(self, tp=1, pp=1, dp=None, world=None, nccl=False, cp=1, ep=1, etp=None):
        """nccl: the run computes on GPUs, so create every NCCL communicator now (connect_nccl);
        ep: expert-parallel size, dividing DP x CP; etp: expert-tensor-parallel size, TP (each expert
        split over the TP group, the default) or 1 (each TP rank holds its experts whole)."""
        world = world or init()
        if dp is None:
            if world.size % (tp * pp * cp):
                what = "TP x PP" + (" x CP" if cp > 1 else "")
                raise InputError(f"world size {world.size} is not divisible by {what} = {tp * pp * cp}; "
                                 f"launch a multiple of {what} ranks (mpirun -n N)")
            dp = world.size // (tp * pp * cp)
        if (dp * cp) % ep:
            raise InputError(f"expert-parallel size {ep} does not divide the data-parallel x context-parallel "
                             f"size {dp * cp}; choose a divisor of it")
        layout = grid_ranks(world.size, tp, pp, dp, cp, ep)
        self.world, self.rank, self.world_size = world, world.rank, world.size
        self.tp_size, self.pp_size, self.dp_size, self.cp_size = tp, pp, dp, cp
        self.tp_rank, self.dp_rank, self.pp_rank = grid_coordinates(world.rank, tp, dp, cp)
        self.cp_rank = (world.rank // tp) % cp
        self.tp_group = _split(world, "tp", layout["tp"])
        self.cp_group = _split(world, "cp", layout["cp"])
        self.dp_group = _split(world, "dp", layout["dp"])
        self.dp_cp_group = _split(world, "dp_cp", layout["dp_cp"]) if cp > 1 else self.dp_group
        self.pp_group = _split(world, "pp", layout["pp"])
        self.mp_group = _split(world, "mp", layout["mp"])
        self.embedding_group = _split(world, "embd", layout["embd"])
        self.ep_size = ep
        self.ep_group = _split(world, "ep", layout["ep"]) if ep > 1 else Group.single("ep")
        self.expert_dp_group = _split(world, "edp", layout["edp"]) if ep > 1 else self.dp_cp_group
        self.expert_tp_group = self.tp_group if etp in (None, tp) else Group.single("etp")
        ring = self.pp_group.ranks
        self.pp_next_rank = ring[(self.pp_rank + 1) % pp]     # global ranks, wrapping as Megatron
        self.pp_prev_rank = ring[(self.pp_rank - 1) % pp]
        if nccl:
            self.connect_nccl()

    def connect_nccl(self):
        """Every NCCL communicator this rank's collectives and point-to-point messages will use,
        made now in one order on every rank: TP, CP, DP, DP x CP, PP, model-parallel and embedding
        groups, then the pairs of the pipeline and of the context-parallel ring (a no-op where NCCL
        does not serve the GPU arrays). Groups of one rank have none: their collectives return at
        once. The world's collectives carry host arrays."""
        groups = [self.tp_group, self.cp_group, self.dp_group, self.pp_group, self.mp_group, self.embedding_group]
        if self.dp_cp_group is not self.dp_group:
            groups.insert(3, self.dp_cp_group)
        if self.ep_size > 1:
            groups += [self.ep_group, self.expert_dp_group]
        pairs = [g for g, size in ((self.pp_group, self.pp_size), (self.cp_group, self.cp_size)) if size > 1]
        connect_nccl([g for g in groups if g is not None and g.size > 1], pairs)

    @classmethod
    def single(cls):
        """The 1 x 1 x 1 x 1 grid of a serial run, without MPI."""
        grid = cls.__new__(cls)
        grid.world = Group.single("world")
        grid.rank, grid.world_size = 0, 1
        grid.tp_size = grid.pp_size = grid.dp_size = grid.cp_size = 1
        grid.tp_rank = grid.dp_rank = grid.pp_rank = grid.cp_rank = 0
        for name in ("tp", "cp", "dp", "pp", "mp"):
            setattr(grid, f"{name}_group", Group.single(name))
        grid.dp_cp_group = grid.dp_group
        grid.embedding_group = Group.single("embd")
        grid.ep_size, grid.ep_group, grid.expert_dp_group = 1, Group.single("ep"), grid.dp_group
        grid.expert_tp_group = grid.tp_group
        grid.pp_next_rank = grid.pp_prev_rank = 0
        return grid

    def __str__(self):
        cp = f"-CP({self.cp_size})" if self.cp_size > 1 else ""
        return f"TP({self.tp_size}){cp}-PP({self.pp_size})-DP({self.dp_size})-Rank({self.rank})"

    __repr__ = __str__
