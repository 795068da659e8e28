"""The experts of an MoE layer: each the model family's MLP (GeLU with biases for GPT-2, SwiGLU
for the Llama family), at --moe-ffn-hidden-size; and the shared expert, the same MLP at
--moe-shared-expert-intermediate-size, which every token goes through (Qwen2-MoE, DeepSeek).
Each expert is whole on its rank (its own group of one): expert parallelism places whole experts
on ranks."""
import dataclasses
import math

from .. import autograd as ag
from ..comm import Group
from ..module import Module
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear


class ExpertMLP(Module):
    """h -> ffn -> h: fc (or gate and up), the activation, proj; biases where the model has them."""

    def __init__(self, cfg, xp, dtype, ffn, routed=True):
        """routed: a routed expert (split over the expert-parallel ranks); False: the shared
        expert, a dense weight every rank holds and reduces over data parallelism."""
        whole, bias, h = Group.single("expert"), cfg.add_bias_linear, cfg.hidden_size
        first = lambda: ColumnParallelLinear(xp, dtype, h, ffn, cfg.init_method_std, whole, skip_bias_add=True,
                                             bias=bias)
        self.swiglu, self.gelu = cfg.swiglu, cfg.gelu
        if cfg.swiglu:
            self.gate, self.up = first(), first()
        else:
            self.fc = first()
        self.proj = RowParallelLinear(xp, dtype, ffn, h, cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
                                      whole, skip_bias_add=True, bias=bias)
        for linear in ((self.gate, self.up) if cfg.swiglu else (self.fc,)) + (self.proj,):
            _replicated(linear, routed)

    def forward(self, x):
        if self.swiglu:
            parts = [_biased(*linear(x)) for linear in (self.gate, self.up)]
            hidden = ag.swiglu(ag.concatenate(parts, axis=-1))
        else:
            h, bias = self.fc(x)
            hidden = ag.gelu(h, self.gelu) if bias is None else ag.bias_gelu(h, bias, self.gelu)
        return _biased(*self.proj(hidden))


def _replicated(linear, routed):
    """The layer's parameters marked whole on every tensor-parallel rank (each TP rank holds every
    expert here), so checkpoints, the gradient norm and resharding treat them as replicated, and
    a routed expert's as an expert's (reduced over the expert-data-parallel ranks under expert
    parallelism)."""
    linear.specs = {name: dataclasses.replace(spec, tp_axis=None, expert=routed) for name, spec in linear.specs.items()}


def _biased(y, bias):
    return y if bias is None else y + bias
