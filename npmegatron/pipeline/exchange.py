"""Point-to-point exchange between neighbouring pipeline stages, on top of comm (so GPU arrays
go through NCCL where each rank has its own GPU).

Every message is tagged with (what, stage, micro-batch), and every send is non-blocking and
waited only later. A receive therefore matches its send whatever order either side posts them,
and a rank blocks only on data it needs now. No schedule can deadlock on a posting order, and
shape headers (variable sequence lengths) add no ordering constraint (the deadlock of
NVIDIA/Megatron-LM#5100 came from a fixed posting order).
"""
import numpy

from .. import comm
from ..autograd import InputError

ACTIVATION, GRADIENT, ACTIVATION_SHAPE, GRADIENT_SHAPE = range(4)
_SHAPE_OF = {ACTIVATION: ACTIVATION_SHAPE, GRADIENT: GRADIENT_SHAPE}


class _Incoming:
    """A posted receive; with variable shapes its header arrives first, then the data is posted."""

    def __init__(self, exchange, kind, stage, micro_batch, peer, shape):
        self.exchange, self.kind, self.stage, self.mb, self.peer = exchange, kind, stage, micro_batch, peer
        self.header = self.data = None
        if exchange.variable_seq_lengths:
            self.header = comm.irecv(peer, (3,), numpy.int64, tag=exchange.tag(_SHAPE_OF[kind], stage, micro_batch))
        else:
            self.post_data(shape)

    def post_data(self, shape):
        ex = self.exchange
        self.data = comm.irecv(self.peer, shape, ex.dtype, tag=ex.tag(self.kind, self.stage, self.mb), xp=ex.xp)

    def wait(self):
        if self.data is None:
            self.post_data(tuple(int(n) for n in self.header.wait()))
        return self.data.wait()


class StageExchange:
    """This rank's sends and receives to its pipeline neighbours, for one schedule's M micro-batches."""

    def __init__(self, grid, dtype, xp, num_micro_batches, variable_seq_lengths=False):
        self.grid, self.dtype, self.xp = grid, numpy.dtype(dtype), xp
        self.num_micro_batches = num_micro_batches
        self.variable_seq_lengths = variable_seq_lengths
        self.sends = []     # sends not yet seen to finish; finish() waits on the rest

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
        peer = self.grid.pp_next_rank if kind == ACTIVATION else self.grid.pp_prev_rank
        target = stage + 1 if kind == ACTIVATION else stage - 1
        ops = []
        if self.variable_seq_lengths:
            ops.append(comm.P2POp("send", peer, array=numpy.array(array.shape, numpy.int64),
                                  tag=self.tag(_SHAPE_OF[kind], target, micro_batch)))
        ops.append(comm.P2POp("send", peer, array=array, tag=self.tag(kind, target, micro_batch)))
        incoming = None
        if then_receive is not None and not self.variable_seq_lengths:
            r_kind, r_stage, r_mb, r_shape = then_receive
            ops.append(comm.P2POp("recv", peer, shape=r_shape, dtype=self.dtype, xp=self.xp,
                                  tag=self.tag(r_kind, r_stage, r_mb)))
        requests = comm.batch_isend_irecv(ops)
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
