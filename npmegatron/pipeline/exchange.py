"""Point-to-point exchange between neighbouring pipeline stages, on top of comm (so GPU arrays
go through NCCL where each rank has its own GPU).

Every send is non-blocking and waited only later, and a rank blocks only on data it needs now.
Receives from each neighbour are posted in the order that neighbour sends (the executor sees to
it, order.py), so messages match without tags, as NCCL matches them; under MPI each message is
still tagged with (what, stage, micro-batch), and NPMEGATRON_P2P_ORDERED=1 drops the tags to prove
the order. A shape header (variable sequence lengths) goes right before its data, both ways.
"""
import numpy

from .. import comm
from ..autograd import InputError, precision
from ..autograd.backend import to_numpy

ACTIVATION, GRADIENT, ACTIVATION_SHAPE, GRADIENT_SHAPE = range(4)
_SHAPE_OF = {ACTIVATION: ACTIVATION_SHAPE, GRADIENT: GRADIENT_SHAPE}


class _Incoming:
    """A posted receive. With variable shapes its header is posted first and the data right
    behind it, so a pair's messages keep the sender's order (NCCL matches in order, without
    tags); the header then checks the shape this rank expects from the micro-batch."""

    def __init__(self, exchange, kind, stage, micro_batch, peer, shape):
        tag, group, peer = exchange.tag, exchange.grid.pp_group, exchange.group_rank(peer)
        self.shape, self.header = tuple(shape), None
        if exchange.variable_seq_lengths:
            self.header = comm.irecv(peer, (len(shape),), numpy.int64, group,
                                     tag=tag(_SHAPE_OF[kind], stage, micro_batch), xp=exchange.xp)
        self.data = comm.irecv(peer, shape, exchange.dtype, group, tag=tag(kind, stage, micro_batch),
                               xp=exchange.xp)

    def wait(self):
        if self.header is not None:
            sent = tuple(int(n) for n in to_numpy(self.header.wait()))
            if sent != self.shape:
                raise InputError(f"a pipeline neighbour sent shape {sent} where this stage expects "
                                 f"{self.shape}; every pipeline rank must get the same micro-batches")
        return self.data.wait()


class StageExchange:
    """This rank's sends and receives to its pipeline neighbours, for one schedule's M micro-batches."""

    def __init__(self, grid, dtype, xp, num_micro_batches, variable_seq_lengths=False):
        self.grid, self.dtype, self.xp = grid, numpy.dtype(dtype), xp
        self.num_micro_batches = num_micro_batches
        self.variable_seq_lengths = variable_seq_lengths
        self.sends = []     # sends not yet seen to finish; finish() waits on the rest

    def group_rank(self, rank):
        """A neighbour's rank in the pipeline group (messages go over the pipeline group: on
        GPUs its NCCL pair communicators, see comm.backends.NCCLBackend._pair)."""
        return self.grid.pp_group.ranks.index(rank)

    def tag(self, kind, stage, micro_batch):
        return kind + 4 * (micro_batch + self.num_micro_batches * stage)

    def receive(self, kind, stage, micro_batch, shape):
        """Post the receive of `kind` for `stage` (from the stage before it for activations,
        after it for gradients); wait() on the result gives the array."""
        peer = self.grid.pp_prev_rank if kind == ACTIVATION else self.grid.pp_next_rank
        return _Incoming(self, kind, stage, micro_batch, peer, shape)

    def send(self, kind, stage, micro_batch, array, then_receive=None):
        """Send `array` (the activation of `stage` forward, or its input gradient backward).
        `then_receive` = (kind, stage, micro_batch, shape) of a receive from the same neighbour,
        posted with the send as one exchange (the ring exchange of the steady state)."""
        peer = self.group_rank(self.grid.pp_next_rank if kind == ACTIVATION else self.grid.pp_prev_rank)
        target = stage + 1 if kind == ACTIVATION else stage - 1
        if array.dtype != self.dtype and precision.format_of(array.dtype):
            # a GPU's 16-bit residual stream (exact in the exchange's float32): the receiving
            # stage's first block reads float32 as the stream's start, as after the embedding
            array = precision.to_float32(array).astype(self.dtype, copy=False)
        ops = []
        if self.variable_seq_lengths:
            ops.append(comm.P2POp("send", peer, array=self.xp.asarray(array.shape, dtype=numpy.int64),
                                  tag=self.tag(_SHAPE_OF[kind], target, micro_batch)))
        ops.append(comm.P2POp("send", peer, array=array, tag=self.tag(kind, target, micro_batch)))
        incoming = None
        if then_receive is not None and not self.variable_seq_lengths:
            r_kind, r_stage, r_mb, r_shape = then_receive
            ops.append(comm.P2POp("recv", peer, shape=r_shape, dtype=self.dtype, xp=self.xp,
                                  tag=self.tag(r_kind, r_stage, r_mb)))
        requests = comm.batch_isend_irecv(ops, self.grid.pp_group)
        if ops[-1].kind == "recv":
            incoming = requests.pop()
        elif then_receive is not None:       # shapes first: the receive posts its own header
            incoming = self.receive(*then_receive)
        self.sends.extend(requests)
        self.sends = [r for r in self.sends if not r.test()]   # let finished sends go
        return incoming

    def finish(self):
        for r in self.sends:
            r.wait()
        self.sends = []


def deallocate(tensor):
    """Megatron's deallocate_output_tensor: once sent, an output's data is not needed (backward
    through it uses the explicit-gradient form), so keep its graph and drop its data."""
    data = tensor.data
    if getattr(data, "base", None) is not None:
        raise InputError("refusing to deallocate a pipeline output that is a view of another array: "
                         "freeing it would free nothing and break the array it views")
    tensor.data = tensor.xp.empty(1, data.dtype)
