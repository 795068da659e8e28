"""GPT-2 with the semantics of HF GPT2LMHeadModel, split over a tensor-parallel group the way
the Megatron paper does (§3): attention heads and MLP columns per rank, replicated LayerNorm,
vocabulary-parallel embedding tied to the output layer, fused vocab-parallel cross-entropy, and
optionally sequence parallelism. With a TP group of one rank it is the serial reference model.
"""
import math

import numpy

from . import autograd as ag
from . import comm
from .autograd import InputError
from .autograd.backend import array_module_for
from .autograd.gemm import enable_tf32
from .autograd.ops.nn import check_ids
from .config import GPTConfig, check_context_parallel_split, check_context_parallel_dropout
from .context_parallel import local_positions, ring_attention
from .module import Module, ParamSpec, parameter
from .moe import MoELayer
from .recompute import recompute_segments, run_layers
from .timers import NO_TIMERS, timed_layer
from .tensor_parallel import (DEFAULT, MODEL_PARALLEL, ColumnParallelLinear, RNGTracker,
                              RowParallelLinear, VocabParallelEmbedding, column_parallel_linear,
                              pad_vocab_size, parallel_gelu_mlp, vocab_parallel_cross_entropy)
from .tensor_parallel.random import site_number


class LayerNorm(Module):
    """Replicated on every TP rank; under sequence parallelism each rank normalises its own
    sequence shard, so its gradients are partial and summed over the TP group."""

    def __init__(self, xp, dtype, size, eps, sequence_parallel=False):
        self.weight = parameter(xp, (size,), dtype)
        self.bias = parameter(xp, (size,), dtype)
        self.eps = eps
        self.specs = {"weight": ParamSpec("ones", (size,), sp_partial=sequence_parallel),
                      "bias": ParamSpec("zeros", (size,), sp_partial=sequence_parallel)}

    def forward(self, x):
        return ag.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(Module):
    """The Llama family's normalisation: a gain and no bias, replicated like LayerNorm."""

    def __init__(self, xp, dtype, size, eps, sequence_parallel=False):
        self.weight = parameter(xp, (size,), dtype)
        self.eps = eps
        self.specs = {"weight": ParamSpec("ones", (size,), sp_partial=sequence_parallel)}

    def forward(self, x):
        return ag.rms_norm(x, self.weight, self.eps)


def normalization(cfg, xp, dtype):
    """The block's normalisation layer (--normalization), with this model's SP setting."""
    kind = RMSNorm if cfg.normalization == "RMSNorm" else LayerNorm
    return kind(xp, dtype, cfg.hidden_size, cfg.layernorm_epsilon, cfg.sequence_parallel)


class RotaryTable:
    """cos and sin of every position's rotary angles (max_position_embeddings, rotary / 2), made
    once in float64 on the host and kept on the model's device in its dtype; shared by the layers."""

    def __init__(self, cfg, xp, dtype):
        angles = ag.rotary_angles(range(cfg.max_position_embeddings), cfg.rotary_dim, cfg.rotary_base)
        self.cos = xp.asarray(numpy.cos(angles).astype(dtype))
        self.sin = xp.asarray(numpy.sin(angles).astype(dtype))
        self.minus_sin = -self.sin                       # backward's, made once

    def at(self, positions):
        """(cos, sin, -sin) of these positions: a slice, or the rows of an index array."""
        return self.cos[positions], self.sin[positions], self.minus_sin[positions]


class ParallelAttention(Module):
    """Causal self-attention with this rank's heads: fused QKV column-parallel, softmax local,
    output projection row-parallel; one all-reduce forward (g) and one backward (f). The QKV
    columns are laid out group by group as (the group's query heads, its key head, its value head),
    Megatron's layout, so a contiguous column shard is whole key/value groups: with one query head
    per group (no grouped-query attention) that is GPT-2's (q, k, v) head by head."""

    def __init__(self, cfg, xp, dtype, group, rng, layer, rotary=None, cp_group=None):
        h, sp, d = cfg.hidden_size, cfg.sequence_parallel, cfg.head_dim
        self.cfg, self.rotary = cfg, rotary
        self.cp_group = cp_group if cp_group is not None and cp_group.size > 1 else None
        if cfg.num_query_groups % group.size:
            raise InputError(f"{cfg.num_query_groups} key/value groups (--num-query-groups) are not "
                             f"divisible by tensor-parallel size {group.size}; each rank needs whole "
                             "groups, so choose a TP size that divides them")
        # Inside the TP region each rank has different heads: a stream of its own (Appendix B.2).
        self.probs_dropout = rng.site(MODEL_PARALLEL, site_number(layer, 0))
        self.local_heads = cfg.num_attention_heads // group.size
        self.local_groups = cfg.num_query_groups // group.size
        width = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d
        # the bias's columns are sharded like the weight's: whole key/value groups on each rank
        self.qkv = ColumnParallelLinear(xp, dtype, h, width, cfg.init_method_std, group, sp, bias=cfg.qkv_bias)
        self.proj = RowParallelLinear(xp, dtype, h, h, cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
                                      group, sp, skip_bias_add=True, bias=cfg.add_bias_linear)

    def forward(self, x, cache=None):
        qkv = self.qkv(x)
        b, t, _ = qkv.shape
        heads, d = self.local_heads, self.cfg.head_dim
        # Blockwise: the (t, t) probabilities are never kept. The dropout position is frozen
        # now, because backward draws the masks again.
        scale, p = 1.0 / math.sqrt(d), self.cfg.attention_dropout
        site = self.probs_dropout.frozen() if self.training and p > 0 else None
        per_group = self.cfg.query_groups_size
        if self.cp_group is not None:      # context parallelism: this rank's tokens, keys passed round
            seq_length = t * self.cp_group.size
            q, k, v = self._heads(qkv, local_positions(seq_length, self.cp_group.rank, self.cp_group.size))
            y = ring_attention(q, k, v, scale, self.cp_group, seq_length)
        elif cache is None and self.rotary is None and per_group == 1:
            # GPT-2: q, k, v stay packed, and so does their gradient
            y = ag.causal_attention_packed(qkv.reshape(b, t, heads, 3, d), scale, p, site, self.training)
        else:
            start = 0 if cache is None else cache.owner.length
            q, k, v = self._heads(qkv, slice(start, start + t))
            if cache is not None:       # generation: attend to every earlier position, computed once
                k, v = cache.extend(k.data, v.data)        # each key/value group kept once
            y = ag.grouped_causal_attention(q, k, v, scale, p, site, self.training)
        y = y.transpose(0, 2, 1, 3).reshape(b, t, heads * d)
        return self.proj(y)                        # (output, bias): the block adds the bias

    def _heads(self, qkv, positions):
        """q (b, heads, t, d) and k, v (b, groups, t, d) of the tokens at `positions` (a slice, or
        context parallelism's index array), rotated when the model uses rotary embeddings."""
        b, t, _ = qkv.shape
        groups, per_group, d = self.local_groups, self.cfg.query_groups_size, self.cfg.head_dim
        q, k, v = ag.split(qkv.reshape(b, t, groups, per_group + 2, d), [per_group, per_group + 1], axis=3)
        q, k, v = q.reshape(b, t, groups * per_group, d), k.reshape(b, t, groups, d), v.reshape(b, t, groups, d)
        if self.rotary is not None:
            angles = self.rotary.at(positions)
            q, k = ag.rotary(q, *angles), ag.rotary(k, *angles)
        return tuple(part.transpose(0, 2, 1, 3) for part in (q, k, v))


class ParallelMLP(Module):
    """Column-parallel h -> 4h, GeLU on each rank's columns (no communication: the point of
    splitting the first GEMM by columns, paper §3), row-parallel 4h -> h. Under --swiglu the first
    layer is a gate and an up projection, each split by columns, so every rank holds the matching
    halves that silu(gate) * up multiplies; they enter the TP region as one GEMM (one f)."""

    def __init__(self, cfg, xp, dtype, group):
        sp, bias, h, f = cfg.sequence_parallel, cfg.add_bias_linear, cfg.hidden_size, cfg.ffn_hidden_size
        self.cfg = cfg
        first = lambda: ColumnParallelLinear(xp, dtype, h, f, cfg.init_method_std, group, sp,
                                             skip_bias_add=True, bias=bias)
        if cfg.swiglu:
            self.gate, self.up = first(), first()
        else:
            self.fc = first()
        self.proj = RowParallelLinear(xp, dtype, f, h, cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
                                      group, sp, skip_bias_add=True, bias=bias)

    def forward(self, x):
        # one fused chain each way; returns (output, bias): the block adds the bias
        if self.cfg.swiglu:
            return self.proj(self._swiglu(x))
        if self.fc.bias is not None and self.cfg.gelu == "tanh" and ag.precision.active() is not None:
            # 16-bit storage: both GEMMs and GeLU one Function, GeLU in their epilogues on a GPU
            return parallel_gelu_mlp(x, self.fc, self.proj)
        h, bias = self.fc(x)
        return self.proj(ag.gelu(h, self.cfg.gelu) if bias is None else ag.bias_gelu(h, bias, self.cfg.gelu))

    def _swiglu(self, x):
        pair = (self.gate, self.up)
        weight = ag.concatenate([part.weight for part in pair], axis=1)
        y = column_parallel_linear(x, weight, None, self.gate.group, self.gate.sequence_parallel)
        if self.gate.bias is not None:
            y = y + ag.concatenate([part.bias for part in pair], axis=0)
        return ag.swiglu(y)


class Block(Module):
    """x + drop(attn(ln_1(x))), then x + drop(mlp(ln_2(x))): GPT-2's pre-LayerNorm block. Each
    branch's output bias, dropout and residual add are one fused op (Megatron's bias_dropout_add)."""

    #: per-layer timers (--timing-log-level 2, set by the trainer); off by default
    layer_timers = NO_TIMERS

    def __init__(self, cfg, xp, dtype, group, rng, layer, rotary=None, cp_group=None, ep_group=None,
                 expert_tp_group=None):
        self.cfg, self.number = cfg, layer
        self.attn_dropout = rng.site(hidden_dropout_stream(cfg), site_number(layer, 1))
        self.mlp_dropout = rng.site(hidden_dropout_stream(cfg), site_number(layer, 2))
        self.ln_1 = normalization(cfg, xp, dtype)
        self.attn = ParallelAttention(cfg, xp, dtype, group, rng, layer, rotary, cp_group)
        self.ln_2 = normalization(cfg, xp, dtype)
        moe = cfg.is_moe_layer(layer)
        self.mlp = MoELayer(cfg, xp, dtype, layer, ep_group, group, expert_tp_group, cp_group) if moe else \
            ParallelMLP(cfg, xp, dtype, group)

    def forward(self, x, cache=None):
        # training steps only, as the phases they are held against (evaluation runs untimed)
        if cache is None and self.training and self.layer_timers.enabled:
            return timed_layer(self.layer_timers, self.number, self._layer, x)
        return self._layer(x, cache)

    def _layer(self, x, cache=None):
        x = self._branch_end(*self.attn(self.ln_1(x), cache), x, self.attn_dropout)
        return self._branch_end(*self.mlp(self.ln_2(x)), x, self.mlp_dropout)

    def _branch_end(self, y, bias, residual, site):
        p = self.cfg.hidden_dropout
        if bias is None:                # --disable-bias-linear
            return ag.dropout_add(y, residual, p, site, self.training)
        return ag.bias_dropout_add(y, bias, residual, p, site, self.training)


def dropout_rng(cfg, grid, xp):
    """The dropout streams of one pipeline rank (shared by its virtual stages). Seeded apart from
    the weights (seed + 1), so changing dropout never changes the initial weights. Megatron also
    seeds each pipeline stage apart (+100); here draws are keyed by the layer's global number
    instead, so a layer's masks are the same under every pipeline split."""
    return RNGTracker(cfg.seed + 1, grid.tp_rank, xp)


def hidden_dropout_stream(cfg):
    """Replicated activations share masks across TP ranks; sequence shards need their own."""
    return MODEL_PARALLEL if cfg.sequence_parallel else DEFAULT


class GPT(Module):
    """The whole GPT, or (for pipeline parallelism) the part one stage holds: the transformer
    layers numbered `layers`, with the embedding when `pre_process` and the final LayerNorm,
    tied output layer and loss when `post_process` (Megatron's names). Layers keep their global
    numbers in parameter names, so every split starts from the serial model's weights."""

    def __init__(self, cfg: GPTConfig, grid=None, layers=None, pre_process=True, post_process=True,
                 rng=None, wte=None):
        self.cfg = cfg
        self.grid = grid or comm.ProcessGrid.single()
        self.pre_process, self.post_process = pre_process, post_process
        group = self.tp_group = self.grid.tp_group
        self.cp_group = getattr(self.grid, "cp_group", None)
        if self.cp_size > 1:
            check_context_parallel_dropout(cfg, self.cp_size)
        if cfg.num_attention_heads % group.size:
            raise InputError(f"{cfg.num_attention_heads} attention heads are not divisible by "
                             f"tensor-parallel size {group.size}; choose a TP size that divides the "
                             "number of heads")
        self.xp = xp = array_module_for(cfg.device)
        if cfg.tf32:
            enable_tf32()
        dtype = numpy.dtype(cfg.dtype)
        sp = cfg.sequence_parallel
        self.rng = rng or dropout_rng(cfg, self.grid, xp)
        self.padded_vocab_size = pad_vocab_size(cfg.vocab_size, group.size, cfg.make_vocab_size_divisible_by)
        self.specs = {}
        vocab_parallel = lambda: VocabParallelEmbedding(xp, dtype, cfg.vocab_size, self.padded_vocab_size,
                                                        cfg.hidden_size, cfg.init_method_std, group, sp)
        tied = not cfg.untie_embeddings_and_output_weights
        if pre_process or (post_process and tied):
            # The last stage's copy of the word embedding (its output layer) is initialised from
            # the same master as the first stage's; `wte` shares one already on this rank.
            self.wte = wte or vocab_parallel()
        if post_process and not tied:
            self.output_layer = vocab_parallel()     # the same vocabulary-parallel layout, its own weight
        if pre_process and cfg.position_embedding_type == "learned_absolute":
            self.wpe = parameter(xp, (cfg.max_position_embeddings, cfg.hidden_size), dtype)
            self.specs["wpe"] = ParamSpec(cfg.init_method_std, tuple(self.wpe.shape), sp_partial=sp)
        self.rotary = RotaryTable(cfg, xp, dtype) if cfg.position_embedding_type == "rope" else None
        layers = range(cfg.num_layers) if layers is None else layers
        experts = getattr(self.grid, "ep_group", None), getattr(self.grid, "expert_tp_group", group)
        self.blocks = {i: Block(cfg, xp, dtype, group, self.rng, i, self.rotary, self.cp_group, *experts)
                       for i in layers}
        self.recompute_segments = recompute_segments(cfg, len(self.blocks))
        self.embedding_dropout = self.rng.site(hidden_dropout_stream(cfg), site_number())
        if post_process:
            self.ln_f = normalization(cfg, xp, dtype)
        self.initialize(cfg.seed, cfg.storage_format)

    @property
    def cp_size(self):
        return self.cp_group.size if self.cp_group is not None else 1

    def local_tokens(self, array):
        """The columns of a (batch, seq) array that this context-parallel rank holds (all of them
        without context parallelism): split.local_positions' balanced causal split."""
        if self.cp_size == 1:
            return array
        return array[:, local_positions(array.shape[1], self.cp_group.rank, self.cp_size)]

    @property
    def output(self):
        """The vocabulary-parallel layer whose transpose gives the logits: the word embedding
        (tied, GPT-2) or the output layer (--untie-embeddings-and-output-weights)."""
        return getattr(self, "output_layer", None) or self.wte

    def _check(self, ids, offset=0):
        if ids.ndim != 2:
            raise InputError(f"token ids must have shape (batch, seq), got {tuple(ids.shape)}")
        t = ids.shape[1] + offset
        if t > self.cfg.max_position_embeddings:
            raise InputError(f"sequence length {t} is longer than the position table "
                             f"({self.cfg.max_position_embeddings}); use shorter sequences or a "
                             "larger max_position_embeddings")
        check_ids(ids, self.cfg.vocab_size, "token id",
                  "tokenize with the model's vocabulary or build the model with a larger vocab_size")
        if self.cp_size == 1 and self.cfg.sequence_parallel and t % self.tp_group.size:
            raise InputError(f"sequence length {t} is not divisible by the tensor-parallel size "
                             f"{self.tp_group.size}, as sequence parallelism needs; use a multiple of it")
        if self.cp_size > 1:
            check_context_parallel_split(t, self.cp_size)
            if self.cfg.sequence_parallel and t // self.cp_size % self.tp_group.size:
                multiple = 2 * self.cp_size * self.tp_group.size
                raise InputError(f"each context-parallel rank's {t // self.cp_size} tokens are not divisible by "
                                 f"the tensor-parallel size {self.tp_group.size}, as sequence parallelism needs; "
                                 f"use a sequence length that is a multiple of {multiple}")

    def embed(self, ids, offset=0):
        # Token ids are checked while still on the host, where it costs no GPU synchronisation.
        ids = ids if hasattr(ids, "ndim") else numpy.asarray(ids)
        self._check(ids, offset)
        positions = self._positions(ids.shape[1], offset)
        ids = self.xp.asarray(self.local_tokens(ids))
        x = self.wte(ids)
        # positions are in range: nothing to check. Under --fp16/--bf16 the add and the dropout
        # are one Function (one 16-bit kernel each way on a GPU)
        table = self.wpe if self.cfg.position_embedding_type == "learned_absolute" else None
        return ag.add_rows_dropout(x, table, positions, self.cfg.hidden_dropout, self.embedding_dropout, self.training)

    def _positions(self, t, offset):
        """The positions of the tokens whose embeddings this rank computes: a slice, or under
        context parallelism an index array; under sequence parallelism this TP rank's share."""
        if self.cp_size > 1:
            positions = local_positions(t, self.cp_group.rank, self.cp_size)
            if self.cfg.sequence_parallel:
                block = len(positions) // self.tp_group.size
                positions = positions[self.tp_group.rank * block:(self.tp_group.rank + 1) * block]
            return positions
        start, stop = offset, offset + t
        if self.cfg.sequence_parallel:
            block = t // self.tp_group.size
            start, stop = offset + self.tp_group.rank * block, offset + (self.tp_group.rank + 1) * block
        return slice(start, stop)

    def forward(self, ids, targets=None, cache=None):
        """ids (batch, seq) -> (this rank's vocabulary shard of the logits, mean loss or None).
        Use full_logits() for the whole vocabulary. With a KVCache (generation.py) the ids
        continue the cached sequence: each new token costs one position, not the whole prefix.
        A stage without pre_process takes the previous stage's hidden states instead of ids;
        one without post_process returns (its hidden states, None)."""
        if cache is not None and (self.cfg.sequence_parallel or self.cp_size > 1):
            raise InputError("a key/value cache needs sequence and context parallelism off (one new token "
                             "cannot be split over ranks); build the model without them for generation")
        with ag.precision.storage(self.cfg.storage_format):     # --fp16/--bf16: 16-bit values
            return self._forward(ids, targets, cache)

    def _forward(self, ids, targets, cache):
        x = self.embed(ids, 0 if cache is None else cache.length) if self.pre_process else ids
        blocks = list(self.blocks.values())
        if cache is not None:
            for i, block in enumerate(blocks):
                x = block(x, cache.layer(i))
            cache.length += x.shape[1]        # (no sequence parallelism with a cache)
        elif self.training and ag.is_grad_enabled():
            x = run_layers(blocks, x, self.recompute_segments, self.rng)   # recompute.py
        else:
            for block in blocks:
                x = block(x)
        if not self.post_process:
            return x, None
        logits = self.output.logits(self.ln_f(x))
        loss = None
        if targets is not None:    # under context parallelism: the mean over this rank's tokens
            targets = self.local_tokens(targets if hasattr(targets, "ndim") else numpy.asarray(targets))
            loss = vocab_parallel_cross_entropy(logits, targets, self.tp_group,
                                                self.output.vocab_start, self.cfg.vocab_size)
        return logits, loss

    def full_logits(self, logits):
        """All TP ranks' vocabulary shards joined, padding columns dropped: (batch, seq, vocab)."""
        data = logits.data if isinstance(logits, ag.Tensor) else logits
        if ag.precision.format_of(data.dtype):      # a GPU's 16-bit GEMM output: exact in float32
            data = ag.precision.to_float32(data)
        return comm.all_gather(data, self.tp_group, axis=-1)[..., :self.cfg.vocab_size]

    def finalize_grads(self):
        """Under sequence parallelism, sum the partial gradients of the replicated parameters
        (LayerNorm, row-parallel biases, positions) over the TP group (Megatron does the same)."""
        if not self.cfg.sequence_parallel:
            return
        for _, param, spec in self.named_specs():
            if spec.sp_partial and param.grad is not None:
                param.grad = comm.all_reduce(param.grad, self.tp_group)

    def num_parameters(self):
        """Parameters of the whole (unsharded, unpadded) model, whatever part this object holds."""
        return gpt_num_parameters(self.cfg)


def gpt_num_parameters(cfg, active=False):
    """Parameters of the whole model, unpadded: GPT-2's, or the Llama family's parts; with MoE
    layers all their experts, or with `active` the k experts a token uses."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d
    norm = h if cfg.normalization == "RMSNorm" else 2 * h
    attention = h * qkv + h * h + (qkv if cfg.qkv_bias else 0) + (h if cfg.add_bias_linear else 0)
    mlps = sum(_mlp_parameters(cfg, active, layer) for layer in range(cfg.num_layers))
    positions = cfg.max_position_embeddings * h if cfg.position_embedding_type == "learned_absolute" else 0
    output = cfg.vocab_size * h if cfg.untie_embeddings_and_output_weights else 0
    return cfg.vocab_size * h + positions + output + cfg.num_layers * (attention + 2 * norm) + mlps + norm


def _mlp_parameters(cfg, active, layer):
    """One layer's MLP, or its MoE layer's router, experts (all, or the k a token uses) and
    shared expert."""
    h = cfg.hidden_size

    def mlp(f):
        first = 2 * f if cfg.swiglu else f                   # SwiGLU: gate and up
        return h * first + f * h + ((first + h) if cfg.add_bias_linear else 0)

    if not cfg.is_moe_layer(layer):
        return mlp(cfg.ffn_hidden_size)
    experts = cfg.moe_router_topk if active else cfg.num_experts
    shared = cfg.moe_shared_expert_intermediate_size
    return (cfg.num_experts * h + experts * mlp(cfg.moe_ffn_hidden_size) + (mlp(shared) if shared else 0)
            + (h if cfg.moe_shared_expert_gate else 0))


def model_flops(cfg, num_params, batch, seq):
    """FLOPs of one forward + backward: 6 * params * tokens for the GEMMs with weights (of an MoE
    layer, its router's, the k experts a token uses and the shared expert), plus
    12 * layers * batch * seq^2 * hidden for the attention scores and their use (the paper's count
    without its vocabulary term, which 6 * params already includes through the tied embedding).
    An untied model's input embedding is a lookup, not a GEMM: its parameters are left out."""
    lookup = cfg.vocab_size * cfg.hidden_size if cfg.untie_embeddings_and_output_weights else 0
    idle = gpt_num_parameters(cfg) - gpt_num_parameters(cfg, active=True)   # experts a token skips
    return 6 * (num_params - lookup - idle) * batch * seq + 12 * cfg.num_layers * batch * seq * seq * cfg.hidden_size
