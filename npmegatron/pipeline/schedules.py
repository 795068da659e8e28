"""Pipeline schedules over M micro-batches, as lists of actions (forward or backward of one
virtual stage on one micro-batch) that one executor runs.

- afab: all forwards, then all backwards (GPipe). Holds every micro-batch's activations.
- 1f1b: warm-up of min(PP - rank - 1, M) forwards, then one forward and one backward in turn,
  then the remaining backwards (PipeDream-Flush; Megatron's default). At PP = 1 it is plain
  gradient accumulation, forward and backward per micro-batch.
- interleaved: 1F1B over V virtual stages per rank, micro-batches in groups of PP (Narayanan et
  al., 2021): warm-up (PP - rank - 1) * 2 + (V - 1) * PP forwards.

The loss of each micro-batch is divided by M. Receives for the next action are posted before
the current compute (overlap), except when the next action's data comes from the neighbour the
current action sends to: then send and receive go as one exchange (ring exchange).
"""
from .. import autograd as ag
from ..autograd import InputError
from ..autograd.memory import saved_bytes_by_function
from .exchange import ACTIVATION, GRADIENT, deallocate

SCHEDULES = ("1f1b", "afab", "interleaved")
FORWARD, BACKWARD = "F", "B"


def build_actions(schedule, pp_rank, pp, virtual, num_micro_batches):
    """[(FORWARD or BACKWARD, virtual stage index on this rank, micro-batch)] for one rank."""
    m, v = num_micro_batches, virtual
    if schedule not in SCHEDULES:
        raise InputError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if schedule == "afab":
        forwards = [(FORWARD, c, i) for c in range(v) for i in range(m)]
        return forwards + [(BACKWARD, c, i) for c in reversed(range(v)) for i in range(m)]
    if v > 1 and schedule == "1f1b":
        raise InputError(f"the 1f1b schedule runs one stage per rank, but this layout gives each rank "
                         f"{v}; use the interleaved (or afab) schedule")
    if v > 1 and m % pp:
        raise InputError(f"the interleaved schedule needs the micro-batches ({m}) to be a multiple of "
                         f"the pipeline size {pp}; change num_micro_batches")
    total = m * v

    def order(k, backward):
        chunk = (k // pp) % v
        return (BACKWARD if backward else FORWARD, v - 1 - chunk if backward else chunk,
                (k // (pp * v)) * pp + k % pp)

    warmup = min((pp - pp_rank - 1) * 2 + (v - 1) * pp, total) if v > 1 else min(pp - pp_rank - 1, m)
    actions = [order(k, False) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [order(warmup + k, False), order(k, True)]
    return actions + [order(k, True) for k in range(total - warmup, total)]


class MemoryProbe:
    """Peak bytes held for backward by this rank: arrays saved on the live tapes plus the live
    stage inputs and outputs (autograd/memory.py's count; CuPy's pool is not counted here)."""

    def __init__(self):
        self.peak = 0

    def measure(self, inputs, outputs):
        live = [t for t in outputs.values() if t is not None]
        tape = sum(saved_bytes_by_function(live).values())
        held = sum(t.data.nbytes for t in live) + sum(t.data.nbytes for t in inputs.values() if t is not None)
        self.peak = max(self.peak, tape + held)


def run_schedule(model, exchange, batches, schedule="1f1b", buckets=None, deallocate_outputs=True,
                 overlap=True, forward_only=False, memory=None):
    """Forward (and backward) every micro-batch through this rank's stages. `batches` is the
    list of M (inputs, targets) for this data-parallel rank; every pipeline rank passes the same.
    Returns the sum of the micro-batch losses on the rank holding the loss, else 0.0."""
    pp, rank = model.grid.pp_size, model.grid.pp_rank
    m = len(batches)
    if forward_only:
        actions = [(FORWARD, c, i) for c in range(model.virtual_size) for i in range(m)]
    else:
        actions = build_actions(schedule, rank, pp, model.virtual_size, m)
    last_backward = max((k for k, a in enumerate(actions) if a[0] == BACKWARD), default=None)
    inputs, outputs, posted = {}, {}, {}
    loss_sum = 0.0
    scale = None

    def stage_of(chunk):
        return chunk * pp + rank

    def needs(action):
        """The receive an action waits for: (kind, stage, micro-batch, shape) or None."""
        kind, c, i = action
        spec = model.specs[c]
        if kind == FORWARD and not spec.pre_process:
            return (ACTIVATION, stage_of(c), i, hidden_shape(model, batches[i][0]))
        if kind == BACKWARD and not spec.post_process:
            return (GRADIENT, stage_of(c), i, hidden_shape(model, batches[i][0]))
        return None

    def post(request):
        key = request[:3]
        if key not in posted:
            posted[key] = exchange.receive(*request)
        return posted[key]

    for k, action in enumerate(actions):
        kind, c, i = action
        chunk, spec = model.chunks[c], model.specs[c]
        nxt = needs(actions[k + 1]) if k + 1 < len(actions) else None
        sends_to = None
        if kind == FORWARD and not spec.post_process:
            sends_to = exchange.grid.pp_next_rank
        elif kind == BACKWARD and not spec.pre_process:
            sends_to = exchange.grid.pp_prev_rank
        nxt_from = None
        if nxt is not None:
            nxt_from = exchange.grid.pp_prev_rank if nxt[0] == ACTIVATION else exchange.grid.pp_next_rank
        ring = nxt is not None and sends_to is not None and nxt_from == sends_to and nxt[:3] not in posted
        if overlap and nxt is not None and not ring:
            post(nxt)                                    # arrives while this action computes
        need = needs(action)
        if kind == FORWARD:
            ids, targets = batches[i]
            if spec.pre_process:
                x = ids
            else:
                x = ag.Tensor(post(need).wait(), requires_grad=not forward_only)
                posted.pop(need[:3])
            if forward_only:
                with ag.no_grad():
                    out, loss = chunk(x, targets if spec.post_process else None)
            else:
                out, loss = chunk(x, targets if spec.post_process else None)
            if spec.post_process:
                loss_sum += loss.item()
                result = loss
            else:
                result = out
            if not forward_only:
                inputs[c, i] = x if not spec.pre_process else None
                outputs[c, i] = result
            if not spec.post_process:
                incoming = exchange.send(ACTIVATION, stage_of(c), i, out.data,
                                         then_receive=nxt if ring else None)
                if ring:
                    posted[nxt[:3]] = incoming
                if deallocate_outputs and not forward_only:
                    deallocate(out)
        else:
            result = outputs.pop((c, i))
            if k == last_backward and buckets is not None:
                buckets.start_sync()        # the DP sync starts with this rank's last backward
            if spec.post_process:
                if scale is None:
                    scale = model.xp.asarray(1.0 / m, dtype=result.dtype)
                ag.backward(result, scale)
            else:
                grad = post(need).wait()
                posted.pop(need[:3])
                ag.backward([result], [grad])
            x = inputs.pop((c, i))
            if x is not None:
                incoming = exchange.send(GRADIENT, stage_of(c), i, x.grad,
                                         then_receive=nxt if ring else None)
                if ring:
                    posted[nxt[:3]] = incoming
        if memory is not None:
            memory.measure(inputs, outputs)
    exchange.finish()
    return loss_sum


def hidden_shape(model, ids):
    """The (micro-batch, local sequence, hidden) shape passed between stages."""
    b, t = ids.shape
    if model.cfg.sequence_parallel:
        t //= model.grid.tp_size
    return (b, t, model.cfg.hidden_size)
