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
from .config import GPTConfig
from .module import Module, ParamSpec, parameter
from .recompute import recompute_segments, run_layers
from .timers import NO_TIMERS, timed_layer
from .tensor_parallel import (DEFAULT, MODEL_PARALLEL, ColumnParallelLinear, RNGTracker,
                              RowParallelLinear, VocabParallelEmbedding, pad_vocab_size,
                              vocab_parallel_cross_entropy)
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


class ParallelAttention(Module):
    """Causal self-attention with this rank's heads: fused QKV column-parallel, softmax local,
    output projection row-parallel; one all-reduce forward (g) and one backward (f). The QKV
    columns are laid out head by head as (q, k, v), so a contiguous column shard is whole heads."""

    def __init__(self, cfg, xp, dtype, group, rng, layer):
        h, sp = cfg.hidden_size, cfg.sequence_parallel
        self.cfg = cfg
        # Inside the TP region each rank has different heads: a stream of its own (Appendix B.2).
        self.probs_dropout = rng.site(MODEL_PARALLEL, site_number(layer, 0))
        self.local_heads = cfg.num_attention_heads // group.size
        self.qkv = ColumnParallelLinear(xp, dtype, h, 3 * h, cfg.init_method_std, group, sp)
        self.proj = RowParallelLinear(xp, dtype, h, h, cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
                                      group, sp, skip_bias_add=True)

    def forward(self, x, cache=None):
        qkv = self.qkv(x)
        b, t, _ = qkv.shape
        heads, d = self.local_heads, self.cfg.head_dim
        qkv = qkv.reshape(b, t, heads, 3, d)
        # Blockwise: the (t, t) probabilities are never kept. The dropout position is frozen
        # now, because backward draws the masks again.
        scale, p = 1.0 / math.sqrt(d), self.cfg.attention_dropout
        site = self.probs_dropout.frozen() if self.training and p > 0 else None
        if cache is None:          # training: q, k, v stay packed, and so does their gradient
            y = ag.causal_attention_packed(qkv, scale, p, site, self.training)
        else:                      # generation: attend to every earlier position, computed once
            q, k, v = (part.reshape(b, t, heads, d).transpose(0, 2, 1, 3) for part in ag.split(qkv, 3, axis=3))
            k, v = cache.extend(k.data, v.data)
            y = ag.causal_attention(q, k, v, scale, p, site, self.training)
        y = y.transpose(0, 2, 1, 3).reshape(b, t, heads * d)
        return self.proj(y)                        # (output, bias): the block adds the bias


class ParallelMLP(Module):
    """Column-parallel h -> 4h, GeLU on each rank's columns (no communication: the point of
    splitting the first GEMM by columns, paper §3), row-parallel 4h -> h."""

    def __init__(self, cfg, xp, dtype, group):
        sp = cfg.sequence_parallel
        self.cfg = cfg
        self.fc = ColumnParallelLinear(xp, dtype, cfg.hidden_size, cfg.ffn_hidden_size,
                                       cfg.init_method_std, group, sp, skip_bias_add=True)
        self.proj = RowParallelLinear(xp, dtype, cfg.ffn_hidden_size, cfg.hidden_size,
                                      cfg.init_method_std / math.sqrt(2 * cfg.num_layers), group, sp,
                                      skip_bias_add=True)

    def forward(self, x):
        h, bias = self.fc(x)
        # one fused chain each way; returns (output, bias): the block adds the bias
        return self.proj(ag.bias_gelu(h, bias, self.cfg.gelu))


class Block(Module):
    """x + drop(attn(ln_1(x))), then x + drop(mlp(ln_2(x))): GPT-2's pre-LayerNorm block. Each
    branch's output bias, dropout and residual add are one fused op (Megatron's bias_dropout_add)."""

    #: per-layer timers (--timing-log-level 2, set by the trainer); off by default
    layer_timers = NO_TIMERS

    def __init__(self, cfg, xp, dtype, group, rng, layer):
        sp = cfg.sequence_parallel
        self.cfg, self.number = cfg, layer
        self.attn_dropout = rng.site(hidden_dropout_stream(cfg), site_number(layer, 1))
        self.mlp_dropout = rng.site(hidden_dropout_stream(cfg), site_number(layer, 2))
        self.ln_1 = LayerNorm(xp, dtype, cfg.hidden_size, cfg.layernorm_epsilon, sp)
        self.attn = ParallelAttention(cfg, xp, dtype, group, rng, layer)
        self.ln_2 = LayerNorm(xp, dtype, cfg.hidden_size, cfg.layernorm_epsilon, sp)
        self.mlp = ParallelMLP(cfg, xp, dtype, group)

    def forward(self, x, cache=None):
        if cache is None and self.layer_timers.enabled:
            return timed_layer(self.layer_timers, self.number, self._layer, x)
        return self._layer(x, cache)

    def _layer(self, x, cache=None):
        p = self.cfg.hidden_dropout
        x = ag.bias_dropout_add(*self.attn(self.ln_1(x), cache), x, p, self.attn_dropout, self.training)
        return ag.bias_dropout_add(*self.mlp(self.ln_2(x)), x, p, self.mlp_dropout, self.training)


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
        if pre_process or post_process:
            # The last stage's copy of the word embedding (its output layer) is initialised from
            # the same master as the first stage's; `wte` shares one already on this rank.
            self.wte = wte or VocabParallelEmbedding(xp, dtype, cfg.vocab_size, self.padded_vocab_size,
                                                     cfg.hidden_size, cfg.init_method_std, group, sp)
        if pre_process:
            self.wpe = parameter(xp, (cfg.max_position_embeddings, cfg.hidden_size), dtype)
            self.specs["wpe"] = ParamSpec(cfg.init_method_std, tuple(self.wpe.shape), sp_partial=sp)
        layers = range(cfg.num_layers) if layers is None else layers
        self.blocks = {i: Block(cfg, xp, dtype, group, self.rng, i) for i in layers}
        self.recompute_segments = recompute_segments(cfg, len(self.blocks))
        self.embedding_dropout = self.rng.site(hidden_dropout_stream(cfg), site_number())
        if post_process:
            self.ln_f = LayerNorm(xp, dtype, cfg.hidden_size, cfg.layernorm_epsilon, sp)
        self.initialize(cfg.seed, cfg.storage_format)

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
        if self.cfg.sequence_parallel and t % self.tp_group.size:
            raise InputError(f"sequence length {t} is not divisible by the tensor-parallel size "
                             f"{self.tp_group.size}, as sequence parallelism needs; use a multiple of it")

    def embed(self, ids, offset=0):
        # Token ids are checked while still on the host, where it costs no GPU synchronisation.
        ids = ids if hasattr(ids, "ndim") else numpy.asarray(ids)
        self._check(ids, offset)
        ids = self.xp.asarray(ids)
        t = ids.shape[1]
        start, stop = offset, offset + t
        if self.cfg.sequence_parallel:
            block = t // self.tp_group.size
            start, stop = offset + self.tp_group.rank * block, offset + (self.tp_group.rank + 1) * block
        x = self.wte(ids) + self.wpe[start:stop]      # positions are a slice: nothing to check
        return ag.dropout(x, self.cfg.hidden_dropout, self.embedding_dropout, self.training)

    def forward(self, ids, targets=None, cache=None):
        """ids (batch, seq) -> (this rank's vocabulary shard of the logits, mean loss or None).
        Use full_logits() for the whole vocabulary. With a KVCache (generation.py) the ids
        continue the cached sequence: each new token costs one position, not the whole prefix.
        A stage without pre_process takes the previous stage's hidden states instead of ids;
        one without post_process returns (its hidden states, None)."""
        if cache is not None and self.cfg.sequence_parallel:
            raise InputError("a key/value cache needs sequence parallelism off (one new token cannot "
                             "be split over ranks); build the model without it for generation")
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
        logits = self.wte.logits(self.ln_f(x))   # output layer tied to the token embedding
        loss = None
        if targets is not None:
            loss = vocab_parallel_cross_entropy(logits, targets, self.tp_group,
                                                self.wte.vocab_start, self.cfg.vocab_size)
        return logits, loss

    def full_logits(self, logits):
        """All TP ranks' vocabulary shards joined, padding columns dropped: (batch, seq, vocab)."""
        data = logits.data if isinstance(logits, ag.Tensor) else logits
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


def gpt_num_parameters(cfg):
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    per_layer = 4 * h * h + 2 * h * f + f + 9 * h   # 2 LayerNorms, QKV, projection, MLP, biases
    return (cfg.vocab_size + cfg.max_position_embeddings) * h + cfg.num_layers * per_layer + 2 * h


def model_flops(cfg, num_params, batch, seq):
    """FLOPs of one forward + backward: 6 * params * tokens for the GEMMs with weights, plus
    12 * layers * batch * seq^2 * hidden for the attention scores and their use (the paper's count
    without its vocabulary term, which 6 * params already includes through the tied embedding)."""
    return 6 * num_params * batch * seq + 12 * cfg.num_layers * batch * seq * seq * cfg.hidden_size
