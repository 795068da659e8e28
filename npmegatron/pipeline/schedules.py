"""Pipeline schedules over M micro-batches, as lists of actions (forward or backward of one
virtual stage on one micro-batch) that one executor runs (run_schedule, stepping a ScheduleRun).

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
import contextlib
import weakref

import numpy

from .. import autograd as ag
from ..autograd import InputError
from ..autograd.memory import saved_bytes_by_function
from ..moe import aux_loss
from ..timers import BACKWARD as BACKWARD_COMPUTE, FORWARD as FORWARD_COMPUTE, NO_TIMERS, PIPELINE_WAIT
from .exchange import ACTIVATION, GRADIENT, deallocate
from .order import BACKWARD, FORWARD, ReceiveOrder

SCHEDULES = ("1f1b", "afab", "interleaved")


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


#: model -> {(value, dtype): the backward's seed on its device}: the same few every step, so a
#: step uploads none (a step captured in a CUDA graph may upload nothing)
_loss_seeds = weakref.WeakKeyDictionary()


def loss_seed(model, value, dtype):
    """The gradient backward starts the loss with: loss scale / micro-batches, on the model's device."""
    seeds = _loss_seeds.setdefault(model, {})
    key = (float(value), str(dtype))
    if key not in seeds:
        seeds[key] = model.xp.asarray(value, dtype=dtype)
    return seeds[key]


class ScheduleRun:
    """The state of one schedule on this rank while its actions run: the posted receives, the
    stage inputs and outputs kept for backward, and the loss sum. A receive is described as
    (kind, stage, micro-batch, shape) and posted at most once, keyed by its first three."""

    def __init__(self, model, exchange, batches, overlap, deallocate_outputs, forward_only, order,
                 timers=None, loss_scale=1.0, outputs=None):
        self.model, self.exchange, self.batches, self.order = model, exchange, batches, order
        self.timers = timers or NO_TIMERS
        self.overlap, self.deallocate_outputs, self.forward_only = overlap, deallocate_outputs, forward_only
        self.posted = {}        # (kind, stage, micro-batch) -> a posted receive not yet waited on
        self.inputs = {}        # (chunk, micro-batch) -> received activation, None on the first stage
        self.outputs = {}       # (chunk, micro-batch) -> output sent on, or loss, to run backward from
        # Summed on the device in float64 (as Python floats were): reading each micro-batch's
        # loss on the host would synchronise a GPU M times a step.
        self.loss_sum = model.xp.zeros((), numpy.float64)
        self.loss_scale = loss_scale    # --fp16's loss scaling multiplies the loss gradient
        # MoE layers' auxiliary losses are seeded as the loss is, on every stage (moe/aux_loss.py)
        aux_loss.set_scale(loss_scale / len(batches))
        self.logits = outputs           # a list to collect the last stage's logits in, or None
        self.loss_seed = None           # loss_scale / M, made once in the loss's dtype

    def stage_of(self, chunk):
        """The global stage number of this rank's virtual stage `chunk`."""
        return chunk * self.model.grid.pp_size + self.model.grid.pp_rank

    def receive_for(self, action):
        """The receive `action` waits for, or None when its input is on this rank (token ids
        for the first stage's forward, the loss for the last stage's backward)."""
        kind, chunk, micro_batch = action
        spec = self.model.stage_specs[chunk]
        if kind == FORWARD and not spec.pre_process:
            return (ACTIVATION, self.stage_of(chunk), micro_batch, self.shape_of(micro_batch))
        if kind == BACKWARD and not spec.post_process:
            return (GRADIENT, self.stage_of(chunk), micro_batch, self.shape_of(micro_batch))
        return None

    def shape_of(self, micro_batch):
        """The shape of the activations and gradients `micro_batch` passes between stages."""
        return hidden_shape(self.model, self.batches[micro_batch][0])

    def sends_to(self, action):
        """The rank `action` sends its result to, or None when the result stays here."""
        kind, chunk, _ = action
        spec = self.model.stage_specs[chunk]
        if kind == FORWARD and not spec.post_process:
            return self.exchange.grid.pp_next_rank
        if kind == BACKWARD and not spec.pre_process:
            return self.exchange.grid.pp_prev_rank
        return None

    def receives_from(self, request):
        """The rank a receive comes from: activations from the previous, gradients the next."""
        grid = self.exchange.grid
        return grid.pp_prev_rank if request[0] == ACTIVATION else grid.pp_next_rank

    def post(self, request):
        """Post `request` unless it is posted already; the posted receive."""
        key = request[:3]
        if key not in self.posted:
            self.post_earlier(request)
            self.posted[key] = self.exchange.receive(*request)
        return self.posted[key]

    def post_earlier(self, request):
        """Post what the sender of `request` sends before it, in the sender's order: a pair's
        messages then match in order, as NCCL (no tags) and NPMEGATRON_P2P_ORDERED=1 match them."""
        for kind, stage, micro_batch in self.order.up_to(request[:3]):
            self.posted[kind, stage, micro_batch] = self.exchange.receive(
                kind, stage, micro_batch, self.shape_of(micro_batch))

    def take(self, request):
        """Wait for `request` (posting it now if it is not yet) and forget it: its array."""
        with self.timers(PIPELINE_WAIT):
            array = self.post(request).wait()
        self.posted.pop(request[:3])
        return array

    def post_next(self, action, following):
        """Post the receive of the action after `action`: now, so that it arrives while `action`
        computes (with overlap on), or, when it comes from the rank `action` sends to, together
        with that send as one exchange (the ring exchange): then it is returned, for send()."""
        upcoming = self.receive_for(following) if following is not None else None
        if upcoming is None:
            return None
        # Megatron's send_forward_recv_backward (and its mirror): in the steady state the rank we
        # send to is the one sending `upcoming`, so both go in one batched P2P call, not two.
        if self.sends_to(action) == self.receives_from(upcoming) and upcoming[:3] not in self.posted:
            return upcoming
        if self.overlap:
            self.post(upcoming)
        return None

    def send(self, kind, chunk, micro_batch, array, then_receive):
        """Send `array` (an activation forward, an input gradient backward) to the neighbour,
        with `then_receive` from that same neighbour posted in the same exchange."""
        with self.timers(PIPELINE_WAIT):
            if then_receive is not None:
                self.post_earlier(then_receive)
            incoming = self.exchange.send(kind, self.stage_of(chunk), micro_batch, array,
                                          then_receive=then_receive)
        if then_receive is not None:
            self.posted[then_receive[:3]] = incoming

    def forward_step(self, chunk, micro_batch, then_receive=None):
        """Virtual stage `chunk` forward on one micro-batch: its output is sent on, or its loss
        added to the sum; both are kept for backward unless the run is forward only."""
        spec, module = self.model.stage_specs[chunk], self.model.chunks[chunk]
        ids, targets = self.batches[micro_batch]
        # Dropout masks are keyed by the micro-batch's number over all DP replicas.
        self.model.rng.micro_batch = self.model.grid.dp_rank * len(self.batches) + micro_batch
        if spec.pre_process:
            x = ids
        else:
            received = self.take(self.receive_for((FORWARD, chunk, micro_batch)))
            x = ag.Tensor(received, requires_grad=not self.forward_only)
        with self.timers(FORWARD_COMPUTE, exclude_comm=True):
            with ag.no_grad() if self.forward_only else contextlib.nullcontext():
                out, loss = module(x, targets if spec.post_process else None)
            if spec.post_process and loss is not None:
                self.loss_sum += loss.data
            if spec.post_process and self.logits is not None:
                self.logits.append(out.data)
        if not self.forward_only:
            self.inputs[chunk, micro_batch] = None if spec.pre_process else x
            self.outputs[chunk, micro_batch] = loss if spec.post_process else out
        if not spec.post_process:
            self.send(ACTIVATION, chunk, micro_batch, out.data, then_receive)
            if self.deallocate_outputs and not self.forward_only:
                deallocate(out)

    def backward_step(self, chunk, micro_batch, then_receive=None):
        """Virtual stage `chunk` backward on one micro-batch, from its loss scaled by 1/M (times the
        loss scale) or from
        the gradient received for its output; the gradient of its input is sent back."""
        spec = self.model.stage_specs[chunk]
        result = self.outputs.pop((chunk, micro_batch))
        if spec.post_process:
            if self.loss_seed is None:
                self.loss_seed = loss_seed(self.model, self.loss_scale / len(self.batches), result.dtype)
            with self.timers(BACKWARD_COMPUTE, exclude_comm=True):
                ag.backward(result, self.loss_seed)
        else:
            grad = self.take(self.receive_for((BACKWARD, chunk, micro_batch)))
            with self.timers(BACKWARD_COMPUTE, exclude_comm=True):
                ag.backward([result], [grad])
        x = self.inputs.pop((chunk, micro_batch))
        if x is not None:
            self.send(GRADIENT, chunk, micro_batch, x.grad, then_receive)


def run_schedule(model, exchange, batches, schedule="1f1b", on_last_backward=None,
                 deallocate_outputs=True, overlap=True, forward_only=False, memory=None, timers=None,
                 loss_scale=1.0, outputs=None):
    """Forward (and backward) every micro-batch through this rank's stages. `batches` is the
    list of M (inputs, targets) for this data-parallel rank; every pipeline rank passes the same.
    `on_last_backward(params)` is called right before the backward that gives `params` their
    last gradient contribution (final_contributions): data parallelism reduces their buckets
    from there on. `timers` (npmegatron/timers.py) splits the time into forward
    and backward compute, TP communication inside them, and pipeline waits. Returns the sum of
    the micro-batch losses on the rank holding the loss, else zero: a float64 array of shape ()
    on the model's device. `loss_scale` multiplies the gradient backward starts from (--fp16).
    `outputs`: a list the last stage appends each micro-batch's logits (this TP rank's vocabulary
    shard) to; targets may then be None (no loss)."""
    grid, virtual, num_micro_batches = model.grid, model.virtual_size, len(batches)
    timers = timers or NO_TIMERS

    def actions_of(pp_rank):
        if forward_only:
            return [(FORWARD, chunk, i) for chunk in range(virtual) for i in range(num_micro_batches)]
        return build_actions(schedule, pp_rank, grid.pp_size, virtual, num_micro_batches)

    actions = actions_of(grid.pp_rank)
    finishing = final_contributions(model, actions) if on_last_backward is not None else {}
    order = ReceiveOrder(actions_of, grid.pp_rank, grid.pp_size, virtual)
    run = ScheduleRun(model, exchange, batches, overlap, deallocate_outputs, forward_only, order, timers,
                      loss_scale, outputs)
    for k, (kind, chunk, micro_batch) in enumerate(actions):
        following = actions[k + 1] if k + 1 < len(actions) else None
        with timers(PIPELINE_WAIT):
            then_receive = run.post_next(actions[k], following)
        if kind == FORWARD:
            run.forward_step(chunk, micro_batch, then_receive)
        else:
            if k in finishing:
                on_last_backward(finishing[k])
            run.backward_step(chunk, micro_batch, then_receive)
        if memory is not None:
            memory.measure(run.inputs, run.outputs)
    with timers(PIPELINE_WAIT):
        exchange.finish()
    return run.loss_sum


def final_contributions(model, actions):
    """{index of an action: the parameters whose last gradient contribution that backward
    makes}: each virtual stage's last backward, for the parameters of no stage that runs
    backward later (the word embedding shared by a rank's first and last stage). Under 1F1B it
    is the last backward, for all; under the interleaved schedule a stage that finishes early
    lets data parallelism reduce its gradients while the rank's other stages still compute.
    Remembered per model and schedule: a step would otherwise walk every module again for the
    same answer (a model's parameters are fixed once it is built)."""
    known = _final_contributions.setdefault(model, {})
    key = tuple(actions)
    if key not in known:
        known[key] = _final_contributions_of(model, actions)
    return known[key]


#: model -> {actions: final_contributions}, for as long as the model lives
_final_contributions = weakref.WeakKeyDictionary()


def _final_contributions_of(model, actions):
    last = {chunk: k for k, (kind, chunk, _) in enumerate(actions) if kind == BACKWARD}
    finishing, later = {}, set()
    for k, chunk in sorted(((k, chunk) for chunk, k in last.items()), reverse=True):
        params = [p for p in model.chunks[chunk].parameters() if id(p) not in later]
        later.update(id(p) for p in params)
        finishing[k] = params
    return finishing


def hidden_shape(model, ids):
    """The (micro-batch, local sequence, hidden) shape passed between stages."""
    b, t = ids.shape
    t //= model.grid.cp_size                    # context parallelism: this rank's tokens
    if model.cfg.sequence_parallel:
        t //= model.grid.tp_size
    return (b, t, model.cfg.hidden_size)
