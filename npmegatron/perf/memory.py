"""Memory per rank of a model config on a shape (TP x PP x DP, virtual stages, micro-batch,
sequence, dtype, sequence parallelism, recomputation).

Parameters, gradients and optimizer state are exact: they count the tensors this project
allocates (GPT, PipelineModel and AdamW), shard by shard, with the padded vocabulary on the first
and last pipeline stage and the replicated LayerNorms and row-parallel biases on every TP rank.

Activations follow Korthikanti et al. 2022 (Reducing Activation Recomputation in Large
Transformer Models), whose per-layer count in 16-bit is s*b*h*(34 + 5*a*s/h) bytes, split here
into what it is made of so it converts to this project's dtype honestly:

    per layer = s*b*h * [ (4 w + 2 m) / (t if SP else 1)       LayerNorm inputs x2, QKV input,
                                                                MLP input; 2 dropout masks
                        + 12 w / t ]                            Q, K, V, projection input,
                                                                GeLU input and output (4h)
              + a*s^2*b * (2 w + m) / t                         softmax output, dropout mask
                                                                and output
with w the bytes of an activation element (2 in the paper) and m of a dropout mask (1). At w = 2,
m = 1: s*b*h*(10 + 24/t) + 5*a*s^2*b/t without SP, s*b*h*(34 + 5*a*s/h)/t with SP, the paper's
formulas. This project keeps masks as NumPy bool (1 byte), and none at all when a dropout
probability is 0 (then the attention term is one saved softmax, a*s^2*b*w/t). Selective
recomputation drops the a*s^2*b term; full recomputation keeps the layer input only (s*b*h*w,
/t with SP) plus one layer's full activations while it is recomputed. Not counted: the embedding
and logits buffers, the loss, and temporary workspace.

What this project's autograd keeps differs from that count, and the plan uses its own tape
(accounting="project", checked against saved_bytes_by_function in the tests):

    per layer = s*b*h * [ (2 w + 2 m) / (t if SP else 1)       LayerNorm x-hat x2; 2 dropout masks
                        + 2 w                                   QKV and MLP inputs, kept whole by
                                                                Linear (gathered under SP)
                        + 16 w / t ]                            Q, K, V, attention output (also the
                                                                projection input: one buffer),
                                                                bias-GeLU input and tanh (4h each),
                                                                second projection input (4h)
              + a*s*b * w / t                                   log-sum-exp per query and head

less the tanh (4 w / t) where the float32 CPU kernel runs bias-GeLU (autograd/ops/_gelu_cpu.py,
inputs of COMPILED_GELU_SIZE elements or more): it recomputes tanh in backward. There is
no a*s^2*b term: blockwise attention (autograd/ops/attention.py) recomputes the probabilities
and draws their dropout masks again in backward, so selective recomputation changes nothing here.

Activations are multiplied by the layers a rank holds and the peak number of its stage-chunks in
flight, taken from the schedule itself (pipeline.schedules.build_actions): AFAB holds M, 1F1B
holds PP - rank, interleaved (PP - rank - 1) * 2 + (V - 1) * PP + 1 chunks.
"""
from dataclasses import dataclass, replace

import numpy

from ..autograd import InputError
from ..autograd.ops.elementwise import compiled_gelu
from ..config import ParallelConfig, field_default
from ..pipeline_layout import default_layout, parse_layout, plan_stages
from ..pipeline.schedules import BACKWARD, build_actions
from ..recompute import recompute_segments
from ..tensor_parallel import pad_vocab_size

RECOMPUTE = ("none", "selective", "full")
MIXED_PRECISION_BYTES_PER_PARAM = 16     # fp16 param 2 + fp16 grad 2 + fp32 master, m, v 12


@dataclass
class ParallelShape:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1                      # context-parallel ranks: each holds seq / cp of every sample
    virtual: int = 1                 # virtual stages per pipeline rank
    micro_batch: int = 1
    global_batch: int = 1
    seq: int = 128
    sequence_parallel: bool = False
    recompute: str = "none"
    recompute_method: str = "uniform"    # with full: as --recompute-method
    recompute_num_layers: int = 1        # with full: as --recompute-num-layers
    distributed_optimizer: bool = False  # optimizer state sharded over DP (--use-distributed-optimizer)
    overlap_grad_reduce: bool = True     # DP all-reduce hidden behind backward (Megatron's flag)
    bucket_elements: int = field_default(ParallelConfig, "ddp_bucket_size")   # gradients per DP all-reduce
    schedule: str = None             # default: 1f1b, interleaved when virtual > 1
    element_bytes: int = None        # default: the model's dtype; 2 for the paper's fp16
    mask_bytes: int = 1
    threads_per_rank: int = None     # a CPU rank's threads (default: the cores shared among the ranks)

    @property
    def ranks(self):
        return self.tp * self.pp * self.dp * self.cp

    @property
    def local_seq(self):
        """Tokens of each sample one rank holds: the sequence, split over CP."""
        return self.seq // self.cp

    @property
    def micro_batches(self):
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def pipeline_schedule(self):
        return self.schedule or ("interleaved" if self.virtual > 1 else "1f1b")

    def name(self):
        return (f"{self.tp}x{self.pp}x{self.dp}" + (f" cp{self.cp}" if self.cp > 1 else "")
                + (f" v{self.virtual}" if self.virtual > 1 else ""))


def check_shape(cfg, shape):
    """InputError (one sentence) when the model cannot run on this shape."""
    t, p, v = shape.tp, shape.pp, shape.virtual
    if shape.recompute not in RECOMPUTE:
        raise InputError(f"recompute {shape.recompute!r} is unknown; use one of {', '.join(RECOMPUTE)}")
    if shape.recompute == "full":
        recompute_segments(_recompute_config(cfg, shape), cfg.num_layers // (p * v))
    if cfg.num_query_groups % t:
        raise InputError(f"{cfg.num_query_groups} key/value groups are not divisible by TP {t}; "
                         "choose a TP size that divides them")
    if shape.cp > 1 and shape.seq % (2 * shape.cp):
        raise InputError(f"sequence length {shape.seq} is not divisible by 2 x CP {shape.cp}, as the "
                         "balanced causal split needs; use a multiple of it")
    if cfg.ffn_hidden_size % t:
        raise InputError(f"FFN size {cfg.ffn_hidden_size} is not divisible by TP {t}; choose another TP size")
    if cfg.num_layers % (p * v):
        raise InputError(f"{cfg.num_layers} layers do not split evenly over PP {p} x {v} virtual "
                         "stages; choose a PP size (and virtual stages) dividing the layers")
    if shape.sequence_parallel and shape.local_seq % t:
        if shape.cp == 1:
            raise InputError(f"sequence length {shape.seq} is not divisible by TP {t}, as sequence "
                             "parallelism needs; use a multiple of it")
        raise InputError(f"each context-parallel rank's {shape.local_seq} tokens are not divisible by TP {t}, "
                         f"as sequence parallelism needs; use a sequence length that is a multiple of "
                         f"{2 * shape.cp * t}")
    per_step = shape.micro_batch * shape.dp
    if shape.global_batch % per_step:
        raise InputError(f"global batch {shape.global_batch} is not divisible by micro-batch x DP = "
                         f"{shape.micro_batch} x {shape.dp} = {per_step}; use a multiple of {per_step}")
    if shape.pipeline_schedule == "interleaved" and shape.micro_batches % p:
        raise InputError(f"the interleaved schedule needs the micro-batches ({shape.micro_batches}) "
                         f"to be a multiple of PP {p}; change the global batch")
    if v > 1 and shape.pipeline_schedule == "1f1b":
        raise InputError(f"the 1f1b schedule runs one stage per rank, but this layout gives each rank "
                         f"{v}; use the interleaved (or afab) schedule")
    if shape.seq > cfg.max_position_embeddings:
        raise InputError(f"sequence length {shape.seq} is longer than the position table "
                         f"({cfg.max_position_embeddings}); raise max_position_embeddings")


def stages_of(cfg, shape):
    """StageSpecs of every global stage (pipeline rank i holds stages i, i + PP, ...)."""
    text = default_layout(cfg.num_layers, shape.pp, shape.virtual)
    return plan_stages(parse_layout(text), cfg.num_layers, shape.pp, text)


def layer_parameters(cfg, tp):
    """Elements of one transformer layer on one TP rank: sharded QKV, projection and MLP weights
    and column-parallel biases; replicated row-parallel biases and normalisation weights."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim
    first = 2 * f if cfg.swiglu else f
    sharded = h * qkv + h * h + h * first + f * h + ((qkv + first) if cfg.add_bias_linear else 0)
    replicated = (2 * h if cfg.add_bias_linear else 0) + 2 * _norm_size(cfg)
    return sharded // tp + replicated


def _norm_size(cfg):
    """Elements of one normalisation layer: LayerNorm's gain and bias, RMSNorm's gain."""
    return cfg.hidden_size if cfg.normalization == "RMSNorm" else 2 * cfg.hidden_size


def rank_parameters(cfg, shape, pp_rank):
    """Elements this (TP rank, pipeline rank) allocates: its layers, the padded vocabulary shard
    once if it holds the first or the last stage (one shared tensor when both, tied), or twice
    where an untied output layer is on the same rank as the embedding; the position table (learned
    positions) on the first stage and the final normalisation on the last."""
    stages = stages_of(cfg, shape)[pp_rank::shape.pp]
    h = cfg.hidden_size
    padded = pad_vocab_size(cfg.vocab_size, shape.tp, cfg.make_vocab_size_divisible_by)
    count = sum(len(s.layers) for s in stages) * layer_parameters(cfg, shape.tp)
    first, last = any(s.pre_process for s in stages), any(s.post_process for s in stages)
    vocabulary_tables = (first + last) if cfg.untie_embeddings_and_output_weights else (first or last)
    count += vocabulary_tables * (padded // shape.tp * h)
    if first and cfg.position_embedding_type == "learned_absolute":
        count += cfg.max_position_embeddings * h
    if last:
        count += _norm_size(cfg)
    return count


def in_flight_chunks(shape, pp_rank):
    """Peak stage-chunks whose activations this rank holds at once, from the schedule's actions."""
    m = shape.micro_batches
    actions = build_actions(shape.pipeline_schedule, pp_rank, shape.pp, shape.virtual, m)
    held = peak = 0
    for kind, _, _ in actions:
        held += -1 if kind == BACKWARD else 1
        peak = max(peak, held)
    return peak


def layer_activation_bytes(cfg, shape, w, recompute=None, accounting="project"):
    """Bytes one transformer layer keeps for backward for one micro-batch (module docstring):
    `accounting` "project" counts this project's autograd tape, "korthikanti" the paper's."""
    s, b, h, a, t = shape.local_seq, shape.micro_batch, cfg.hidden_size, cfg.num_attention_heads, shape.tp
    recompute = recompute or shape.recompute
    sp_div = t if shape.sequence_parallel else 1
    if recompute == "full":
        return s * b * h * w / sp_div
    hidden_masks = 2 * shape.mask_bytes if cfg.hidden_dropout > 0 else 0
    if accounting != "korthikanti":
        log_sum_exp = a * s * b * w / t
        per_head_share = (_attention_widths(cfg, shape) + _mlp_widths(cfg, shape, w)) * w / t
        return s * b * h * ((2 * w + hidden_masks) / sp_div + 2 * w + per_head_share) + log_sum_exp
    per_sbh = (4 * w + hidden_masks) / sp_div + 12 * w / t
    attn_dropout = cfg.attention_dropout > 0
    scores = (w * (2 if attn_dropout else 1) + (shape.mask_bytes if attn_dropout else 0)) / t
    total = s * b * h * per_sbh
    if recompute == "none":
        total += a * s * s * b * scores
    return total


def _attention_widths(cfg, shape):
    """What attention keeps per token, in units of h: q, k, v and the output (GPT-2's packed QKV;
    under grouped-query attention k and v repeated to every query head); under context parallelism
    ring attention keeps k and v with their groups' heads only."""
    if shape.cp == 1:
        return 4
    return 2 + 2 * cfg.num_query_groups / cfg.num_attention_heads


def _mlp_widths(cfg, shape, w):
    """What the MLP keeps per token, in units of h: the first layer's output (SwiGLU: gate and up;
    GeLU: its input, and tanh unless the CPU kernel recomputes it) and the second layer's input."""
    f = cfg.ffn_hidden_size / cfg.hidden_size
    if cfg.swiglu:
        return 3 * f
    return (3 if _gelu_keeps_tanh(cfg, shape, w) else 2) * f


def _gelu_keeps_tanh(cfg, shape, w):
    """Whether bias-GeLU keeps tanh for backward: the chains do; the float32 CPU kernel does not."""
    elements = shape.local_seq * shape.micro_batch * cfg.ffn_hidden_size // shape.tp
    return not (w == 4 and compiled_gelu(cfg.gelu, cfg.dtype, elements, cfg.device == "cpu"))


def _recompute_config(cfg, shape):
    return replace(cfg, recompute_granularity="full", recompute_method=shape.recompute_method,
                   recompute_num_layers=shape.recompute_num_layers)


def chunk_activation_bytes(cfg, shape, w, layers):
    """(bytes one model chunk of `layers` layers keeps for one micro-batch, bytes of the segment
    being recomputed in backward, held once): full recomputation keeps one layer input per
    recomputed segment (recompute.py: chunks of N layers, or the first N layers alone)."""
    whole = layer_activation_bytes(cfg, shape, w, "none")
    if shape.recompute != "full":
        return layers * layer_activation_bytes(cfg, shape, w), 0
    segments = recompute_segments(_recompute_config(cfg, shape), layers)
    kept = sum(layer_activation_bytes(cfg, shape, w, "full") if again else (stop - first) * whole
               for first, stop, again in segments)
    workspace = max((stop - first) * whole for first, stop, again in segments if again)
    return kept, workspace


def element_bytes(cfg, shape):
    """Bytes of a parameter or activation: 2 under --fp16/--bf16, else the model's dtype's."""
    return shape.element_bytes or (2 if cfg.storage_format else numpy.dtype(cfg.dtype).itemsize)


def rank_memory(cfg, shape, pp_rank):
    """{'parameters', 'gradients', 'optimizer', 'activations', 'total', ...} in bytes for one rank."""
    w = element_bytes(cfg, shape)
    params = rank_parameters(cfg, shape, pp_rank)
    stages = stages_of(cfg, shape)[pp_rank::shape.pp]
    layers_per_chunk = cfg.num_layers // (shape.pp * shape.virtual)
    chunks = in_flight_chunks(shape, pp_rank)
    kept, workspace = chunk_activation_bytes(cfg, shape, w, layers_per_chunk)
    activations = chunks * kept + workspace
    # --fp16/--bf16: gradients accumulate in float32 (Megatron's main_grad), and the optimizer
    # keeps float32 master weights beside m and v; else all in the parameters' dtype.
    grad_w, optimizer_w = (4, 12) if cfg.storage_format else (w, 2 * w)
    result = {
        "pp_rank": pp_rank, "layers": sum(len(s.layers) for s in stages),
        "parameter_count": params, "parameters": params * w, "gradients": params * grad_w,
        # 1/(DP x CP) of the optimizer state with the distributed optimizer
        "optimizer": params * optimizer_w / (shape.dp * shape.cp if shape.distributed_optimizer else 1),
        "chunks_in_flight": chunks, "activations": activations,
    }
    result["total"] = result["parameters"] + result["gradients"] + result["optimizer"] + activations
    # 16-bit parameter and gradient (4 B), fp32 master weights, m and v (12 B, sharded over DP by
    # the distributed optimizer)
    shard = shape.dp * shape.cp if shape.distributed_optimizer else 1
    result["mixed_precision_states"] = params * (4 + (MIXED_PRECISION_BYTES_PER_PARAM - 4) / shard)
    result["mixed_precision_total"] = result["mixed_precision_states"] + activations * 2 / w
    return result


def memory_plan(cfg, shape, device_memory=None):
    """Memory of every pipeline rank; 'peak' is the largest total, 'fits' compares it with
    device_memory (bytes; None: not judged)."""
    check_shape(cfg, shape)
    ranks = [rank_memory(cfg, shape, r) for r in range(shape.pp)]
    peak = max(ranks, key=lambda r: r["total"])
    return {"ranks": ranks, "peak": peak["total"], "peak_pp_rank": peak["pp_rank"],
            "device_memory": device_memory,
            "fits": None if device_memory is None else peak["total"] <= device_memory}
