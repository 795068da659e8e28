"""Memory per rank of a model config on a shape (TP x PP x DP, virtual stages, micro-batch,
sequence, dtype, sequence parallelism, recomputation, expert parallelism).

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

An MoE layer (npmegatron/moe/) in place of a dense layer: its attention and norms as a dense
layer's; the router (E x h) and the shared expert's gate replicated, the shared expert split over
TP, E / EP whole experts each split over the experts' TP (ETP = TP) or whole (ETP = 1); their
AdamW state sharded over the DP x CP / EP ranks holding the same experts under the distributed
optimizer. Its activations, on the tape: the MLP input once (the router's), and per routed row
(k T of them, routing balanced, none dropped or padded) its expert's input, widths and output
row, its router weight and the permutation's int64 indices; the router's scores; the shared
expert's widths (moe_layer_activation_bytes).

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
    ep: int = 1                      # expert-parallel ranks, carved out of DP x CP: each E / EP experts
    etp: int = None                  # each expert split over TP ranks (None: TP, the default) or whole (1)
    cuda_graph: bool = False         # a GPU step replayed as one CUDA graph (the host issues nothing)

    @property
    def ranks(self):
        return self.tp * self.pp * self.dp * self.cp

    @property
    def local_seq(self):
        """Tokens of each sample one rank holds: the sequence, split over CP."""
        return self.seq // self.cp

    @property
    def expert_tp(self):
        """The ranks each expert is split over: TP, or 1 (whole experts)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self):
        """The ranks holding the same experts (their gradients summed, their optimizer state sharded)."""
        return self.dp * self.cp // self.ep

    @property
    def micro_batches(self):
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def pipeline_schedule(self):
        return self.schedule or ("interleaved" if self.virtual > 1 else "1f1b")

    def name(self):
        return (f"{self.tp}x{self.pp}x{self.dp}" + (f" cp{self.cp}" if self.cp > 1 else "")
                + (f" v{self.virtual}" if self.virtual > 1 else "") + (f" ep{self.ep}" if self.ep > 1 else "")
                + (" etp1" if self.expert_tp != self.tp else ""))


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
    _check_experts(cfg, shape)
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


def _check_experts(cfg, shape):
    """What training refuses of expert parallelism (config.check_expert_parallel and
    check_expert_tensor_parallel) and of the experts' splits (GroupedExperts' divide), one sentence each."""
    ep, etp, t = shape.ep, shape.expert_tp, shape.tp
    if cfg.num_experts is None:
        if ep > 1 or etp != t:
            flag = f"--expert-model-parallel-size {ep}" if ep > 1 else f"--expert-tensor-parallel-size {etp}"
            raise InputError(f"{flag} splits MoE layers' experts, but --num-experts is not given; add it or "
                             "drop the flag")
        return
    shared = cfg.moe_shared_expert_intermediate_size
    refusals = [
        (etp not in (1, t), f"expert tensor-parallel size {etp} is neither 1 nor TP {t}: splitting experts over "
                            f"a TP size of their own is not built; choose 1 or {t}"),
        (cfg.num_experts % ep, f"the {cfg.num_experts} experts do not split evenly over EP {ep} ranks; choose "
                               "an expert-parallel size dividing them"),
        ((shape.dp * shape.cp) % ep, f"expert-parallel size {ep} does not divide the data-parallel x "
                                     f"context-parallel size {shape.dp * shape.cp}, whose ranks it splits the "
                                     "experts over; choose a divisor of DP x CP"),
        (cfg.moe_ffn_hidden_size % etp, f"expert FFN size {cfg.moe_ffn_hidden_size} is not divisible by the "
                                        f"experts' TP {etp}; choose another TP size or whole experts "
                                        "(--expert-tensor-parallel-size 1)"),
        (shared and shared % t, f"shared expert size {shared} is not divisible by TP {t}; choose another TP size"),
    ]
    why = next((reason for refused, reason in refusals if refused), None)
    if why:
        raise InputError(why)


def stages_of(cfg, shape):
    """StageSpecs of every global stage (pipeline rank i holds stages i, i + PP, ...)."""
    text = default_layout(cfg.num_layers, shape.pp, shape.virtual)
    return plan_stages(parse_layout(text), cfg.num_layers, shape.pp, text)


def layer_parameters(cfg, tp):
    """Elements of one transformer layer on one TP rank: sharded QKV, projection and MLP weights
    and column-parallel biases; replicated row-parallel biases and normalisation weights."""
    return _attention_parameters(cfg, tp) + _mlp_parameters(cfg, cfg.ffn_hidden_size, tp)


def _attention_parameters(cfg, tp):
    """A layer's part outside its MLP on one TP rank: sharded QKV and projection weights and QKV's
    bias; the projection's bias and both normalisations' weights replicated."""
    h = cfg.hidden_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim
    sharded = h * qkv + h * h + (qkv if cfg.qkv_bias else 0)
    return sharded // tp + (h if cfg.add_bias_linear else 0) + 2 * _norm_size(cfg)


def _mlp_parameters(cfg, ffn, split):
    """The family's MLP of inner size ffn on one of the `split` ranks it is split over: fc (SwiGLU:
    gate and up) by columns with its bias, proj by rows; proj's bias whole on every rank."""
    h, first = cfg.hidden_size, 2 * ffn if cfg.swiglu else ffn
    sharded = h * first + ffn * h + (first if cfg.add_bias_linear else 0)
    return sharded // split + (h if cfg.add_bias_linear else 0)


def moe_layer_parameters(cfg, shape):
    """Elements of one MoE layer on a rank (moe/layer.py): a dense layer's attention and norms; the
    router (E, h) and the shared expert's gate (1, h), replicated; the shared expert split over TP
    as the dense MLP; and the rank's routed experts (expert_parameters)."""
    h, shared = cfg.hidden_size, cfg.moe_shared_expert_intermediate_size
    count = _attention_parameters(cfg, shape.tp) + cfg.num_experts * h + expert_parameters(cfg, shape)
    if shared:
        count += _mlp_parameters(cfg, shared, shape.tp) + (h if cfg.moe_shared_expert_gate else 0)
    return count


def expert_parameters(cfg, shape):
    """Elements of one MoE layer's routed experts on a rank: E / EP whole experts (expert
    parallelism), each split over the experts' TP ranks (ETP = TP) or whole (ETP = 1)."""
    return cfg.num_experts // shape.ep * _mlp_parameters(cfg, cfg.moe_ffn_hidden_size, shape.expert_tp)


def _norm_size(cfg):
    """Elements of one normalisation layer: LayerNorm's gain and bias, RMSNorm's gain."""
    return cfg.hidden_size if cfg.normalization == "RMSNorm" else 2 * cfg.hidden_size


def rank_layers(cfg, shape, pp_rank):
    """The (global) numbers of the layers pipeline rank `pp_rank` holds, over its virtual stages."""
    return [layer for stage in stages_of(cfg, shape)[pp_rank::shape.pp] for layer in stage.layers]


def rank_parameters(cfg, shape, pp_rank):
    """Elements this (TP rank, pipeline rank) allocates: its layers (dense or MoE), the padded
    vocabulary shard once if it holds the first or the last stage (one shared tensor when both,
    tied), or twice where an untied output layer is on the same rank as the embedding; the position
    table (learned positions) on the first stage and the final normalisation on the last."""
    stages = stages_of(cfg, shape)[pp_rank::shape.pp]
    h = cfg.hidden_size
    padded = pad_vocab_size(cfg.vocab_size, shape.tp, cfg.make_vocab_size_divisible_by)
    count = sum(moe_layer_parameters(cfg, shape) if cfg.is_moe_layer(layer) else layer_parameters(cfg, shape.tp)
                for layer in rank_layers(cfg, shape, pp_rank))
    first, last = any(s.pre_process for s in stages), any(s.post_process for s in stages)
    vocabulary_tables = (first + last) if cfg.untie_embeddings_and_output_weights else (first or last)
    count += vocabulary_tables * (padded // shape.tp * h)
    if first and cfg.position_embedding_type == "learned_absolute":
        count += cfg.max_position_embeddings * h
    if last:
        count += _norm_size(cfg)
    return count


def rank_expert_parameters(cfg, shape, pp_rank):
    """Of rank_parameters, the routed experts' elements: their gradients are summed over the
    expert-data-parallel ranks, and the distributed optimizer shards their state over those."""
    moe_layers = sum(cfg.is_moe_layer(layer) for layer in rank_layers(cfg, shape, pp_rank))
    return moe_layers * expert_parameters(cfg, shape) if moe_layers else 0


def optimizer_parameters(shape, params, experts):
    """Parameters whose optimizer state a rank holds, of `params` of which `experts` are routed
    experts': all, or under the distributed optimizer the dense ones' 1 / (DP x CP) share and the
    experts' 1 / (DP x CP / EP) share (data_parallel/expert_parallel.py)."""
    if not shape.distributed_optimizer:
        return params
    return (params - experts) / (shape.dp * shape.cp) + experts / shape.expert_dp


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
        elements = s * b * cfg.ffn_hidden_size // t
        per_head_share = (_attention_widths(cfg, shape) + _mlp_widths(cfg, cfg.ffn_hidden_size, elements, w)) * w / t
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


def _mlp_widths(cfg, ffn, elements, w):
    """What an MLP of inner size ffn keeps per row, in units of h: the first layer's output
    (SwiGLU: gate and up; GeLU: its input, and tanh unless the CPU kernel recomputes it, which
    depends on the `elements` its activation runs on) and the second layer's input."""
    f = ffn / cfg.hidden_size
    if cfg.swiglu:
        return 3 * f
    return (3 if _gelu_keeps_tanh(cfg, elements, w) else 2) * f


def _gelu_keeps_tanh(cfg, elements, w):
    """Whether bias-GeLU keeps tanh for backward: the chains do; the float32 CPU kernel does not."""
    return not (w == 4 and compiled_gelu(cfg.gelu, cfg.dtype, elements, cfg.device == "cpu"))


def moe_layer_activation_bytes(cfg, shape, w, recompute=None):
    """Bytes one MoE layer keeps for backward for one micro-batch, this project's tape: a dense
    layer's without its MLP's widths (the MLP's input stays, kept once by the router and the shared
    expert), the routed rows' (moe_routed_bytes), the router's scores, and the shared expert's
    widths and its gate's output and sigmoid. Full recomputation keeps the layer input alone."""
    recompute = recompute or shape.recompute
    if recompute == "full":
        return layer_activation_bytes(cfg, shape, w, "full")
    tokens, h, t = shape.local_seq * shape.micro_batch, cfg.hidden_size, shape.tp
    dense_mlp = _mlp_widths(cfg, cfg.ffn_hidden_size, tokens * cfg.ffn_hidden_size // t, w) * w / t
    total = layer_activation_bytes(cfg, shape, w, recompute) - tokens * h * dense_mlp
    total += moe_routed_bytes(cfg, shape, w) + tokens * _router_widths(cfg) * w
    shared = cfg.moe_shared_expert_intermediate_size
    if shared:
        total += tokens * h * _mlp_widths(cfg, shared, tokens * shared // t, w) * w / t
        total += tokens * (h + 1) * w if cfg.moe_shared_expert_gate else 0
    return total


def moe_routed_bytes(cfg, shape, w):
    """What the k T routed rows keep (T the micro-batch's tokens on the rank: the whole sequence
    under SP, which the layer gathers), balanced over the experts and none dropped or padded: each
    row's expert input (whole: split experts all read it), its expert's widths (split over ETP),
    the output row the router's weight multiplies and the weight; the permutation's int64 indices
    (the gather and the scatter-add, and under EP the regroup and its inverse). SwiGLU experts run
    on gate and up joined: the joined weights are kept too."""
    k, h, etp = cfg.moe_router_topk, cfg.hidden_size, shape.expert_tp
    rows = k * shape.local_seq * shape.micro_batch
    local = cfg.num_experts // shape.ep
    ffn = cfg.moe_ffn_hidden_size
    widths = _mlp_widths(cfg, ffn, rows * shape.ep // cfg.num_experts * ffn // etp, w) / etp
    total = rows * (h * (2 + widths) + 1) * w + rows * 8 * (4 if shape.ep > 1 else 2)
    if cfg.swiglu:          # moe/experts.py: the grouped GEMM's joined gate and up weights
        total += local * h * 2 * ffn // etp * w
    return total


def _router_widths(cfg):
    """Elements per token the router keeps: the softmax over each token's top k (over every expert
    with --moe-router-pre-softmax; sigmoid's scores, and with k > 1 the normalised weights and
    their sum), the balancing loss's scores over every expert (sigmoid's normalised, and their
    sum), the z-loss's exp, log-sum-exp and its square's input."""
    k, e = cfg.moe_router_topk, cfg.num_experts
    sigmoid = cfg.moe_router_score_function == "sigmoid"
    widths = e if sigmoid or cfg.moe_router_pre_softmax else k
    widths += k + 1 if sigmoid and k > 1 else 0
    if cfg.moe_router_load_balancing_type != "none" and cfg.moe_aux_loss_coeff:
        widths += e + 1 if sigmoid else e
    return widths + (e + 2 if cfg.moe_z_loss_coeff else 0)


def _recompute_config(cfg, shape):
    return replace(cfg, recompute_granularity="full", recompute_method=shape.recompute_method,
                   recompute_num_layers=shape.recompute_num_layers)


def chunk_activation_bytes(cfg, shape, w, layers, first=0):
    """(bytes one model chunk of `layers` layers, numbered from `first`, keeps for one micro-batch,
    bytes of the segment being recomputed in backward, held once): full recomputation keeps one
    layer input per recomputed segment (recompute.py: chunks of N layers, or the first N alone)."""
    numbers = range(first, first + layers)
    if shape.recompute != "full":
        return sum(_layer_bytes(cfg, shape, w, n) for n in numbers), 0
    whole = [_layer_bytes(cfg, shape, w, n, "none") for n in numbers]
    segments = recompute_segments(_recompute_config(cfg, shape), layers)
    kept = sum(layer_activation_bytes(cfg, shape, w, "full") if again else sum(whole[start:stop])
               for start, stop, again in segments)
    workspace = max(sum(whole[start:stop]) for start, stop, again in segments if again)
    return kept, workspace


def _layer_bytes(cfg, shape, w, layer, recompute=None):
    """Activation bytes of layer number `layer`: an MoE layer's or a dense one's."""
    if cfg.is_moe_layer(layer):
        return moe_layer_activation_bytes(cfg, shape, w, recompute)
    return layer_activation_bytes(cfg, shape, w, recompute)


def rank_activation_bytes(cfg, shape, w, pp_rank):
    """Activations a pipeline rank holds at its peak: its chunks in flight, each charged as its
    heaviest model chunk (all alike unless MoE layers fall unevenly), plus one recomputed segment."""
    chunks = [chunk_activation_bytes(cfg, shape, w, len(s.layers), s.layers[0])
              for s in stages_of(cfg, shape)[pp_rank::shape.pp]]
    return in_flight_chunks(shape, pp_rank) * max(c[0] for c in chunks) + max(c[1] for c in chunks)


def element_bytes(cfg, shape):
    """Bytes of a parameter or activation: 2 under --fp16/--bf16, else the model's dtype's."""
    return shape.element_bytes or (2 if cfg.storage_format else numpy.dtype(cfg.dtype).itemsize)


def rank_memory(cfg, shape, pp_rank):
    """{'parameters', 'gradients', 'optimizer', 'activations', 'total', ...} in bytes for one rank;
    'experts': its routed experts' share of the parameters, gradients and optimizer state."""
    w = element_bytes(cfg, shape)
    params = rank_parameters(cfg, shape, pp_rank)
    experts = rank_expert_parameters(cfg, shape, pp_rank)
    activations = rank_activation_bytes(cfg, shape, w, pp_rank)
    # --fp16/--bf16: gradients accumulate in float32 (Megatron's main_grad), and the optimizer
    # keeps float32 master weights beside m and v; else all in the parameters' dtype.
    grad_w, optimizer_w = (4, 12) if cfg.storage_format else (w, 2 * w)
    result = {
        "pp_rank": pp_rank, "layers": len(rank_layers(cfg, shape, pp_rank)),
        "parameter_count": params, "parameters": params * w, "gradients": params * grad_w,
        # sharded over DP x CP (the experts' over DP x CP / EP) with the distributed optimizer
        "optimizer": optimizer_parameters(shape, params, experts) * optimizer_w,
        "chunks_in_flight": in_flight_chunks(shape, pp_rank), "activations": activations,
        "expert_parameter_count": experts,
        "experts": experts * (w + grad_w) + optimizer_parameters(shape, experts, experts) * optimizer_w,
    }
    result["total"] = result["parameters"] + result["gradients"] + result["optimizer"] + activations
    # 16-bit parameter and gradient (4 B), fp32 master weights, m and v (12 B, sharded over DP by
    # the distributed optimizer)
    result["mixed_precision_states"] = 4 * params + (MIXED_PRECISION_BYTES_PER_PARAM - 4) * optimizer_parameters(
        shape, params, experts)
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
