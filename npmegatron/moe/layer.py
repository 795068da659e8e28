"""The mixture-of-experts layer in place of a block's MLP (Megatron-Core's MoELayer): the router
picks each token's k experts and their weights, the tokens go to their experts and come back
weighted (dispatch.py), and the shared expert, when there is one, adds its output for every
token, gated by sigmoid(x w) under --moe-shared-expert-gate (Qwen2-MoE). Dropless: every expert
takes every token sent to it, unless --moe-expert-capacity-factor caps its share (router.py).

Under tensor parallelism every TP rank routes the same tokens and sends them to the same experts;
the experts and the shared expert are split over the TP ranks as the dense MLP is. The experts
enter and leave the TP region together: one f on the layer's input, and one all-reduce of their
output rows' partial sums, before the second projection's bias and the router's weights. Under
sequence parallelism the layer first gathers the whole sequence (so the sequence-level balancing
loss sees whole sequences) and gives back its rank's block at the end: Megatron-Core's all-gather
dispatcher, but with the tokens' rows all-reduced and then split where it reduce-scatters them."""
from .. import autograd as ag
from ..comm import Group
from ..module import Module, ParamSpec, parameter
from ..tensor_parallel import copy_to_tp_region, gather_whole_sequence, reduce_from_tp_region, scatter_to_sp_region
from .dispatch import run_experts
from .expert_parallel import run_experts_parallel
from .experts import GroupedExperts, SharedExpertMLP
from .router import TopKRouter, expert_capacity, sigmoid


class MoELayer(Module):
    """ep_group: the expert-parallel group the experts are split over (expert_parallel.py), this
    rank holding experts r L ... (r + 1) L - 1, L = E / EP, r its rank in the group; None: all.
    tp_group: the tensor-parallel group (the shared expert's split, the sequence's under SP);
    expert_tp_group: the routed experts' split (the TP group, or a group of one: whole); cp_group:
    the context-parallel group, whose ranks hold parts of each sequence (the balancing loss's)."""

    def __init__(self, cfg, xp, dtype, layer, ep_group=None, tp_group=None, expert_tp_group=None, cp_group=None):
        self.router = TopKRouter(cfg, xp, dtype, layer, cp_group)
        self.tp_group = tp_group
        self.sequence_parallel = cfg.sequence_parallel and tp_group is not None and tp_group.size > 1
        self.ep_group = ep_group if ep_group is not None and ep_group.size > 1 else None
        local = cfg.num_experts // (self.ep_group.size if self.ep_group else 1)
        first = self.ep_group.rank * local if self.ep_group else 0
        self.expert_tp_group = expert_tp_group or Group.single("expert")
        self.experts = GroupedExperts(cfg, xp, dtype, first, local, self.expert_tp_group)
        self.shared_expert = None
        self.specs = {}
        if cfg.moe_shared_expert_intermediate_size:
            self.shared_expert = SharedExpertMLP(cfg, xp, dtype, cfg.moe_shared_expert_intermediate_size,
                                                 group=tp_group)
            if cfg.moe_shared_expert_gate:
                self.shared_expert_gate = parameter(xp, (1, cfg.hidden_size), dtype)
                self.specs["shared_expert_gate"] = ParamSpec(cfg.init_method_std, (1, cfg.hidden_size))

    def forward(self, x):
        """x (batch, seq, hidden) -> (the layer's output, None: no bias left for the block to add)."""
        if self.sequence_parallel:
            x = gather_whole_sequence(x, self.tp_group)
        batch, seq, hidden = x.shape
        flat = ag.reshape(x, (batch * seq, hidden))
        weights, experts, kept = self.router(flat, sequences=batch)
        out = self._routed(flat, weights, experts, kept)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if "shared_expert_gate" in self.specs:
                shared = shared * sigmoid(ag.linear(flat, self.shared_expert_gate.T))
            out = out + shared
        out = ag.reshape(out, (batch, seq, hidden))
        return (scatter_to_sp_region(out, self.tp_group) if self.sequence_parallel else out), None

    def _routed(self, flat, weights, experts, kept):
        """The routed experts' weighted sum for each token. Experts split over the TP ranks enter
        the TP region through one f, each rank runs its share of every expert's columns, and the
        output rows' partial sums are all-reduced once for all experts before they are weighted
        (Megatron-Core's dispatchers reduce there too, so the router's weights get the whole
        output's gradient)."""
        finish = None
        if self.expert_tp_group.size > 1:   # the TP group's ranks: f once for every expert
            flat = copy_to_tp_region(flat, self.tp_group)
            finish = lambda rows: reduce_from_tp_region(rows, self.tp_group)  # noqa: E731
        run = lambda rows, blocks: self.experts(rows, blocks, finish)  # noqa: E731
        cfg = self.router.cfg
        # --moe-pad-expert-input-to-capacity: each expert runs on its capacity's rows from every
        # rank of its group, the most a capacity lets arrive
        pad_to = (expert_capacity(flat.shape[0], cfg) * (self.ep_group.size if self.ep_group else 1)
                  if cfg.moe_pad_expert_input_to_capacity else None)
        if self.ep_group is None:
            return run_experts(flat, weights, experts, run, cfg.num_experts, kept, pad_to)
        return run_experts_parallel(flat, weights, experts, run, cfg.num_experts, self.ep_group, kept, pad_to)
