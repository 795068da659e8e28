"""The experts of an MoE layer: each the model family's MLP (GeLU with biases for GPT-2, SwiGLU
for the Llama family), at --moe-ffn-hidden-size; and the shared expert, the same MLP at
--moe-shared-expert-intermediate-size, which every token goes through (Qwen2-MoE, DeepSeek).
Expert parallelism places whole experts on ranks; on a rank each expert is split over the
tensor-parallel group as the dense MLP is (--expert-tensor-parallel-size = --tp, columns then rows,
joined by f and g), or whole (a group of one: --expert-tensor-parallel-size 1)."""
import dataclasses
import math

from .. import autograd as ag
from ..comm import Group
from ..module import Module
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear


class ExpertMLP(Module):
    """h -> ffn -> h: fc (or gate and up), the activation, proj; biases where the model has them."""

    def __init__(self, cfg, xp, dtype, ffn, routed=True, group=None):
        """routed: a routed expert (split over the expert-parallel ranks); False: the shared
        expert, a dense weight every rank holds and reduces over data parallelism. group: the
        tensor-parallel ranks the expert is split over (None: whole). Its input is the whole
        sequence on every rank, under sequence parallelism too (layer.py gathers it)."""
        group, bias, h = group or Group.single("expert"), cfg.add_bias_linear, cfg.hidden_size
        first = lambda: ColumnParallelLinear(xp, dtype, h, ffn, cfg.init_method_std, group, skip_bias_add=True,
                                             bias=bias)
        self.swiglu, self.gelu = cfg.swiglu, cfg.gelu
        if cfg.swiglu:
            self.gate, self.up = first(), first()
        else:
            self.fc = first()
        self.proj = RowParallelLinear(xp, dtype, ffn, h, cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
                                      group, skip_bias_add=True, bias=bias)
        for linear in ((self.gate, self.up) if cfg.swiglu else (self.fc,)) + (self.proj,):
            _marked(linear, routed, split=group.size > 1)

    def forward(self, x):
        if self.swiglu:
            parts = [_biased(*linear(x)) for linear in (self.gate, self.up)]
            hidden = ag.swiglu(ag.concatenate(parts, axis=-1))
        else:
            h, bias = self.fc(x)
            hidden = ag.gelu(h, self.gelu) if bias is None else ag.bias_gelu(h, bias, self.gelu)
        return _biased(*self.proj(hidden))


    def partial(self, x):
        """This rank's share of the expert, without f and g: x already inside the TP region, the
        output a partial sum over the TP ranks, which the MoE layer reduces once for all its
        experts (layer.py; experts without biases)."""
        if self.swiglu:
            hidden = ag.swiglu(ag.linear(x, ag.concatenate([self.gate.weight, self.up.weight], axis=1)))
        else:
            hidden = ag.gelu(ag.linear(x, self.fc.weight), self.gelu)
        return ag.linear(hidden, self.proj.weight)


def _marked(linear, routed, split):
    """A routed expert's parameters marked as an expert's (reduced over the expert-data-parallel
    ranks under expert parallelism); a whole expert's also as replicated on every tensor-parallel
    rank, so checkpoints, the gradient norm and resharding treat them so."""
    linear.specs = {name: dataclasses.replace(spec, expert=routed, **({} if split else {"tp_axis": None}))
                    for name, spec in linear.specs.items()}


def _biased(y, bias):
    return y if bias is None else y + bias
