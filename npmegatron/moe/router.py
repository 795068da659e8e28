"""The router of a mixture-of-experts layer (Megatron-Core's TopKRouter): each token's logits
over the experts, the k experts it goes to, their weights, and the load-balancing losses.

Routing follows Megatron-Core's `topk_routing_with_score_function`:
- softmax: the top k logits, then a softmax over those k (Mixtral's weights, renormalised); with
  --moe-router-pre-softmax a softmax over all experts, then its top k (Qwen2-MoE without
  norm_topk_prob);
- sigmoid (DeepSeek-V3): the top k of sigmoid(logits) (plus the expert bias, which chooses the
  experts but does not weigh them), normalised to sum to one when k > 1;
- group-limited routing picks --moe-router-group-topk of --moe-router-num-groups expert groups by
  the sum of each group's top k / group-topk scores, then the top k inside them;
- --moe-router-topk-scaling-factor multiplies the weights.
The choice of experts carries no gradient; the weights do, through the chosen logits.

Losses (each added to the training objective through `aux_loss.attach`, as Megatron's
MoEAuxLossAutoScaler does, so a pipeline stage needs no loss of its own):
- aux_loss (Switch Transformer): E * sum_i f_i P_i * coeff, f_i the fraction of the k T choices
  that went to expert i, P_i the mean over tokens of expert i's score (softmax over all experts;
  sigmoid normalised per token);
- seq_aux_loss: the same per sequence, averaged over sequences (DeepSeek-V2/V3); under context
  parallelism both count the whole sequences' choices (balancing_loss);
- z-loss (ST-MoE): coeff * mean over tokens of logsumexp(logits)^2.
"""
import contextlib
import math

import numpy

from .. import autograd as ag
from .. import comm
from ..autograd import Function, precision
from ..module import Module, ParamSpec, parameter
from . import aux_loss

ROUTER_DTYPES = {"fp32": numpy.float32, "fp64": numpy.float64}


class TopKRouter(Module):
    """Router weight (experts, hidden), replicated; an expert bias (not a parameter: updated from
    the token counts, DeepSeek-V3's auxiliary-loss-free balancing) when enabled."""

    def __init__(self, cfg, xp, dtype, layer, cp_group=None):
        self.cfg, self.layer = cfg, layer
        self.cp_group = cp_group if cp_group is not None and cp_group.size > 1 else None
        self.weight = parameter(xp, (cfg.num_experts, cfg.hidden_size), dtype)
        self.specs = {"weight": ParamSpec(cfg.init_method_std, (cfg.num_experts, cfg.hidden_size))}
        self.expert_bias = xp.zeros(cfg.num_experts, numpy.float32) if cfg.moe_router_enable_expert_bias else None
        self.tokens_per_expert = None       # the last forward's counts
        self.step_tokens_per_expert = None  # summed over the step's forwards (the bias's update)
        self.interval_tokens_per_expert = None  # summed over the log interval's steps (the log)
        self.interval_dropped = 0           # choices dropped over capacity since the last log

    def forward(self, x, sequences=1):
        """x (tokens, hidden), `sequences` sequences of equal length one after the other -> (weights
        (tokens, k) Tensor, experts (tokens, k) host array, which of those choices are kept: a
        (tokens, k) host bool array under a capacity factor, else None). Under --moe-router-dtype
        the logits, the weights and the losses are computed in that dtype, unrounded under
        --fp16/--bf16 (Megatron-Core's router in FP32), the weights handed back in the model's."""
        cfg, weight = self.cfg, self.weight
        wide, model_dtype = router_dtype(cfg, x.dtype), numpy.result_type(x.dtype, numpy.float32)
        if wide:    # cast outside the block: the input's gradient is rounded as any activation's
            x, weight = _Cast.apply(x, dtype=wide), _Cast.apply(weight, dtype=wide)
        with precision.suspended() if wide else contextlib.nullcontext():
            logits = ag.linear(x, weight.T)
            if cfg.moe_z_loss_coeff and ag.is_grad_enabled():      # training (as Megatron), not evaluation
                logits = aux_loss.attach(logits, z_loss(logits), "z_loss", self.layer, cfg.moe_z_loss_coeff)
            weights, experts = route(logits, cfg, self.expert_bias)
            # the choice goes to the host once: the dispatch sorts and splits by it there (a GPU's one
            # synchronisation a layer, Megatron's too), the counts and the capacity read it there
            experts = ag.backend.to_numpy(experts)
            kept = self._kept(weights, experts)
            kind = cfg.moe_router_load_balancing_type
            if kind != "none" and cfg.moe_aux_loss_coeff and ag.is_grad_enabled():
                loss = balancing_loss(logits, cfg, kind, sequences, self.cp_group)
                weights = aux_loss.attach(weights, loss, "load_balancing_loss", self.layer, cfg.moe_aux_loss_coeff)
            if wide:    # a new array in the model's dtype: the ops after the router round their
                # outputs in place, and the router's saved arrays (the softmax's) must stay unrounded
                weights = _Cast.apply(weights, dtype=model_dtype)
        return weights, experts, kept

    def _kept(self, weights, experts):
        """Which choices the experts keep (None: all), and the counts kept for the bias and the log."""
        cfg = self.cfg
        kept = None
        if cfg.moe_expert_capacity_factor is not None:
            kept = within_capacity(weights.data, experts, cfg)
            if ag.is_grad_enabled():        # training's drops (not evaluation's, not recomputation's twice)
                self.interval_dropped += 0 if kept is None else int(kept.size - kept.sum())
        counts = _counts(experts if kept is None else experts[kept], cfg.num_experts)
        self.tokens_per_expert = counts
        if ag.is_grad_enabled():
            if self.expert_bias is not None:        # the step's counts: the bias's update only
                self.step_tokens_per_expert = _added(self.step_tokens_per_expert, counts)
            self.interval_tokens_per_expert = _added(self.interval_tokens_per_expert, counts)
        return kept

    def update_expert_bias(self, group=None):
        """DeepSeek-V3's update after a step: each expert's bias moves by the rate towards balance
        (up where it took fewer tokens than the mean, down where more), from the step's counts
        summed over `group` (the data-parallel replicas, as Megatron sums them), which every
        replica then agrees on. The counts start again from zero."""
        counts, self.step_tokens_per_expert = self.step_tokens_per_expert, None
        if self.expert_bias is None or counts is None:
            return
        if group is not None:
            counts = comm.all_reduce(numpy.asarray(counts, numpy.int64), group)
        xp = ag.get_array_module(self.expert_bias)
        counts = xp.asarray(counts, numpy.float32)
        self.expert_bias += numpy.float32(self.cfg.moe_router_bias_update_rate) * xp.sign(counts.mean() - counts)


def update_expert_biases(model, group=None):
    """Every MoE router's expert bias under `model` updated from its step's counts (TopKRouter)."""
    if getattr(model, "cfg", None) is not None and not model.cfg.moe_router_enable_expert_bias:
        return      # no bias to update: no walk over the modules each step
    for _, module in model.named_modules():
        if isinstance(module, TopKRouter):
            module.update_expert_bias(group)


def router_dtype(cfg, dtype):
    """The dtype --moe-router-dtype computes the router in (never narrower than the model's), or
    None: the model's own, rounded as every op under --fp16/--bf16."""
    if cfg.moe_router_dtype is None:
        return None
    return numpy.result_type(ROUTER_DTYPES[cfg.moe_router_dtype], numpy.result_type(dtype, numpy.float32))


class _Cast(Function):
    """x in another float dtype; backward: the gradient in x's compute dtype (float32 for a 16-bit
    x, whose gradient the tape then rounds as any activation's)."""
    reads_16_bit = True
    float32_output = True

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = numpy.result_type(x.dtype, numpy.float32)
        return x.astype(dtype)

    @staticmethod
    def backward(ctx, g):
        return g.astype(ctx.dtype)


def route(logits, cfg, expert_bias=None):
    """(each token's k weights, Tensor; its k experts, int array) from the router's logits."""
    k, data = cfg.moe_router_topk, logits.data
    xp = ag.get_array_module(data)
    rows = xp.arange(data.shape[0])[:, None]
    if cfg.moe_router_score_function == "softmax":
        if cfg.moe_router_pre_softmax:
            scores = ag.softmax(logits)
            experts = top_k(scores.data, k, cfg)
            weights = scores[rows, experts]
        else:
            experts = top_k(data, k, cfg)
            weights = ag.softmax(logits[rows, experts])
    else:
        scores = sigmoid(logits)
        choosing = scores.data if expert_bias is None else scores.data + expert_bias.astype(scores.dtype)
        experts = top_k(choosing, k, cfg)
        weights = scores[rows, experts]
        if k > 1:
            weights = weights / (ag.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if cfg.moe_router_topk_scaling_factor:
        weights = weights * cfg.moe_router_topk_scaling_factor
    return weights, experts


def within_capacity(weights, experts, cfg):
    """Which of the (tokens, k) choices their experts keep under --moe-expert-capacity-factor, as
    Megatron-Core's apply_router_token_dropping: an expert takes at most ceil(k T / E x factor)
    choices, those of its highest weights (probs; ties to the earlier token) or its earliest
    tokens (position); None where the capacity reaches the tokens (nothing can be dropped)."""
    tokens, k = experts.shape
    capacity = expert_capacity(tokens, cfg)
    if capacity >= tokens:
        return None
    flat = ag.backend.to_numpy(experts).reshape(-1)
    position = numpy.arange(flat.size)
    strength = -ag.backend.to_numpy(weights).reshape(-1) if cfg.moe_token_drop_policy == "probs" \
        else numpy.zeros(flat.size)
    order = numpy.lexsort((position, strength, flat))      # by expert, then weight, then position
    ranked = flat[order]
    rank = position - numpy.searchsorted(ranked, ranked, side="left")
    kept = numpy.zeros(flat.size, bool)
    kept[order] = rank < capacity
    return kept.reshape(tokens, k)


def expert_capacity(tokens, cfg):
    """The most choices of `tokens` tokens an expert takes: ceil(k T / E x factor)."""
    return math.ceil(tokens * cfg.moe_router_topk / cfg.num_experts * cfg.moe_expert_capacity_factor)


def top_k(scores, k, cfg):
    """The k highest-scoring experts of each row, best first; with group-limited routing only
    among the rows' chosen groups."""
    xp = ag.get_array_module(scores)
    groups, group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
    if group_topk:
        tokens, experts = scores.shape
        grouped = scores.reshape(tokens, groups, experts // groups)
        best = -xp.sort(-grouped, axis=-1)[..., :k // group_topk]
        chosen = xp.argsort(-best.sum(axis=-1), axis=-1)[:, :group_topk]
        keep = xp.zeros((tokens, groups), bool)
        keep[xp.arange(tokens)[:, None], chosen] = True
        scores = xp.where(xp.repeat(keep, experts // groups, axis=1), scores, -xp.inf)
    return xp.argsort(-scores, axis=-1)[:, :k]


class _Sigmoid(Function):
    """1 / (1 + exp(-x)) without overflow (exp of -|x| only); backward g s (1 - s)."""

    @staticmethod
    def forward(ctx, x):
        xp = ag.get_array_module(x)
        e = xp.exp(-xp.abs(x))
        s = xp.where(x >= 0, 1 / (1 + e), e / (1 + e))
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved
        return g * s * (1 - s)


def sigmoid(x):
    return _Sigmoid.apply(x)


def z_loss(logits):
    """mean over tokens of logsumexp(logits)^2, the row maximum taken out for stability."""
    shift = logits.data.max(axis=-1, keepdims=True)
    lse = ag.log(ag.sum(ag.exp(logits - shift), axis=-1)) + shift[:, 0]
    return ag.mean(lse * lse)


def _added(total, counts):
    return counts if total is None else total + counts


def _counts(experts, num_experts):
    """Tokens sent to each expert, from the host's choice (the dispatcher's splits need them there)."""
    return numpy.bincount(experts.reshape(-1), minlength=num_experts)


def balancing_loss(logits, cfg, kind, sequences=1, cp_group=None):
    """The Switch Transformer's load-balancing loss over this micro-batch's tokens (aux_loss), or
    per sequence, averaged (seq_aux_loss); without its coefficient. As Megatron-Core's
    compute_routing_scores_for_aux_loss, the tokens per expert are those of a plain top k of the
    scores (no expert bias, no group limit, no dropping).

    Under context parallelism (cp_group) each rank holds 1 / CP of every sequence: the counts are
    summed over the CP ranks (so f is the whole sequences'), the scores' sums stay the rank's own,
    and the loss is CP times the rank's share of the whole one. The data-parallel average over the
    CP ranks then gives the whole loss's gradient and, in the log, its value."""
    scores = ag.softmax(logits)
    if cfg.moe_router_score_function == "sigmoid":
        raw = sigmoid(logits)
        scores = raw / (ag.sum(raw, axis=-1, keepdims=True) + 1e-20)
    xp = ag.get_array_module(logits.data)
    chosen = xp.argsort(-scores.data, axis=-1)[:, :cfg.moe_router_topk]
    cp = cp_group.size if cp_group is not None else 1
    blocks = 1 if kind == "aux_loss" else sequences
    per_block = logits.shape[0] // blocks
    # each block's counts on the device, in one bincount (no synchronisation): block b's experts
    # counted as b E + e
    block = xp.arange(logits.shape[0])[:, None] // per_block
    counts = xp.bincount((chosen + block * cfg.num_experts).reshape(-1),
                         minlength=blocks * cfg.num_experts).reshape(blocks, cfg.num_experts)
    if cp > 1:
        counts = comm.all_reduce(counts, cp_group)
    losses = [_switch_loss(scores[b * per_block:(b + 1) * per_block], counts[b], per_block * cp, cfg)
              for b in range(blocks)]
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total * (cp / blocks) if cp > 1 or blocks > 1 else total


def _switch_loss(scores, counts, tokens, cfg):
    xp = ag.get_array_module(scores.data)
    f = xp.asarray(counts, scores.dtype)
    return ag.sum(ag.sum(scores, axis=0) * f) * (cfg.num_experts / (cfg.moe_router_topk * tokens * tokens))
