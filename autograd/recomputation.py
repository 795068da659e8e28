"""Activation recomputation (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost";
Megatron's full recomputation, which papers also call activation checkpointing; "checkpoint" here
means only a saved training state): recompute(run, x) keeps only x on the tape and runs `run`
again inside backward, where the graph it records is walked at once and dropped.

`replay` makes the second run equal the first bitwise: anything `run` reads besides x and the
parameters (the dropout generator's iteration and micro-batch, which a pipeline schedule has moved
on by the time this backward runs) is captured at forward and restored around the recomputation.
"""
import contextlib

from . import precision
from .engine import backward
from .function import Function
from .tensor import Tensor, enable_grad, no_grad


class Recompute(Function):
    @staticmethod
    def forward(ctx, x, run, replay):
        ctx.run, ctx.restore, ctx.storage = run, replay(), precision.active()
        ctx.save_for_backward(x)
        ctx.on_grid(0)
        with no_grad():
            return run(Tensor(x)).data

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved
        leaf = Tensor(x, requires_grad=True)
        with enable_grad(), ctx.restore(), precision.storage(ctx.storage):
            out = ctx.run(leaf)
            # The parameters `run` uses get their gradients here, from this inner backward.
            backward([out], [g])
        return leaf.grad


def _nothing_to_replay():
    return contextlib.nullcontext


def recompute(run, x, replay=_nothing_to_replay):
    """run(x) (a Tensor function of x and of parameters it holds), keeping only x for backward.
    replay(): called at forward, returns a context-manager factory that restores around the
    recomputation what `run` reads besides x and the parameters."""
    if not x.requires_grad:       # the parameters inside still need the node on the tape
        x = Tensor(x.data, requires_grad=True)
    return Recompute.apply(x, run=run, replay=replay)
