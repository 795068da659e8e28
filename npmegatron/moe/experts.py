"""The experts of an MoE layer: each the model family's MLP (GeLU with biases for GPT-2, SwiGLU
for the Llama family), at --moe-ffn-hidden-size; and the shared expert, the same MLP at
--moe-shared-expert-intermediate-size, which every token goes through (Qwen2-MoE, DeepSeek).

The routed experts a rank holds are one module with their weights stacked (Megatron-Core's
GroupedMLP): gate, up or fc (experts, h, f), proj (experts, f, h), each parameter the rank's slice
of the serial model's (E, h, f). Expert parallelism splits the first axis over the EP ranks, whole
experts each. Each expert is split over the tensor-parallel ranks as the dense MLP is
(--expert-tensor-parallel-size = --tp: columns, then rows), or kept whole (a group of one:
--expert-tensor-parallel-size 1). They run as grouped GEMMs on their blocks of rows
(autograd/ops/grouped.py): one GEMM a projection for all of them, not one an expert."""
import math

from .. import autograd as ag
from ..comm import Group
from ..autograd.ops.arithmetic import constant_vector
from ..module import Module, ParamSpec, parameter
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.layers import divide


class _Stacked(Module):
    """One projection of every local expert: weight (experts, in, out), bias (experts, out) where
    the model has biases, each the slice `index` of the serial model's stack."""

    def __init__(self, xp, dtype, shape, index, tp_axis, std, bias):
        local = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape)) + shape[len(index):]
        self.weight = parameter(xp, local, dtype)
        self.specs = {"weight": ParamSpec(std, shape, index, tp_axis=tp_axis, expert=True)}
        self.bias = None
        if bias:        # columns split where the weight's are; rows split: whole, added after the sum
            bias_index = (index[0], index[2]) if len(index) > 2 else index[:1]
            self.bias = parameter(xp, (local[0], local[2]), dtype, decayed=False)   # a bias an expert
            self.specs["bias"] = ParamSpec("zeros", (shape[0], shape[2]), bias_index,
                                           tp_axis=1 if tp_axis == 2 else None, expert=True)


class GroupedExperts(Module):
    """The routed experts numbered first ... first + count - 1, their weights stacked (module
    docstring); group: the tensor-parallel ranks each expert is split over (size one: whole)."""

    def __init__(self, cfg, xp, dtype, first, count, group):
        h, ffn, experts = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts
        local = divide(ffn, group.size, "expert FFN size (--moe-ffn-hidden-size)")
        mine, split = slice(first, first + count), group.size > 1
        cols = slice(group.rank * local, (group.rank + 1) * local)
        bias, std = cfg.add_bias_linear, cfg.init_method_std
        first_layer = lambda: _Stacked(xp, dtype, (experts, h, ffn), (mine, slice(None), cols),  # noqa: E731
                                       2 if split else None, std, bias)
        self.swiglu, self.gelu = cfg.swiglu, cfg.gelu
        if cfg.swiglu:
            self.gate, self.up = first_layer(), first_layer()
        else:
            self.fc = first_layer()
        self.proj = _Stacked(xp, dtype, (experts, ffn, h), (mine, cols), 1 if split else None,
                             std / math.sqrt(2 * cfg.num_layers), bias)

    def forward(self, rows, blocks, finish=None):
        """rows (n, h) in one block an expert (ag.RowBlocks) -> each block through its expert.
        finish: applied to the second projection's output before its bias (the TP ranks' partial
        sums reduced, once for every expert). No rows: the rows themselves, still on the tape."""
        if blocks.rows == 0:
            return rows
        if self.swiglu:
            both = ag.concatenate([self.gate.weight, self.up.weight], axis=-1)
            hidden = ag.grouped_matmul(rows, both, blocks)
            if self.gate.bias is not None:  # (--swiglu with biases) gate's and up's, the columns' order
                hidden = ag.grouped_bias(hidden, ag.concatenate([self.gate.bias, self.up.bias], axis=-1), blocks)
            hidden = ag.swiglu(hidden)
        else:
            hidden = ag.grouped_matmul(rows, self.fc.weight, blocks)
            if self.fc.bias is None:
                hidden = ag.gelu(hidden, self.gelu)
            else:   # the fused bias + GeLU keeps one 16-bit input and recomputes tanh, as the dense MLP's
                no_bias = ag.Tensor(constant_vector(hidden.data, hidden.shape[1], self.fc.bias.dtype, 0))
                hidden = ag.bias_gelu(ag.grouped_bias(hidden, self.fc.bias, blocks), no_bias, self.gelu)
        out = ag.grouped_matmul(hidden, self.proj.weight, blocks)
        out = finish(out) if finish else out
        return out if self.proj.bias is None else ag.grouped_bias(out, self.proj.bias, blocks)


class SharedExpertMLP(Module):
    """The shared expert, h -> ffn -> h: fc (or gate and up), the activation, proj; biases where
    the model has them. A dense weight every rank holds, reduced over data parallelism and split
    over the tensor-parallel `group` as the dense MLP is (None: whole). Its input is the whole
    sequence on every rank, under sequence parallelism too (layer.py gathers it)."""

    def __init__(self, cfg, xp, dtype, ffn, group=None):
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

    def forward(self, x):
        if self.swiglu:
            parts = [_biased(*linear(x)) for linear in (self.gate, self.up)]
            hidden = ag.swiglu(ag.concatenate(parts, axis=-1))
        else:
            h, bias = self.fc(x)
            hidden = ag.gelu(h, self.gelu) if bias is None else ag.bias_gelu(h, bias, self.gelu)
        return _biased(*self.proj(hidden))


def _biased(y, bias):
    return y if bias is None else y + bias
