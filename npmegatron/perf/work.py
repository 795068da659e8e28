"""A rank's compute time from the work it does, for a profile that measured this machine's rates
(`npmegatron plan calibrate`, the "measured" section of profiles.py):

- GEMMs at their per-rank shapes, each at the FLOP/s the calibration table gives for that shape
  (interpolated in log space between the measured shapes, clamped at the table's edges): a
  layer's QKV, projection and two MLP GEMMs, the output layer's on the last stage; forward
  (rows, inner, cols), backward the input gradient (rows, cols, inner) and the weight gradient
  (inner, rows, cols);
- attention's core at the measured seconds per score of the blockwise kernel forward and
  backward, by sequence length and head size (with and without its dropout);
- memory-bound work as bytes / bandwidth: what each op reads and writes (PASSES, layer_traffic
  below), on the full hidden size at every TP rank unless sequence parallelism shards it, at the
  bandwidth the engine's op of that kind achieved on arrays of that size;
- the engine's own cost, measured on a tiny model: seconds per layer and per micro-batch;
- an MoE layer as its own GEMMs (moe_layer_gemms: the router's, the rank's experts' on their
  share of the routed rows, balanced) and memory-bound ops (moe_layer_traffic: the experts'
  activations, their grouped bias passes and the dispatch's passes over the routed rows).

Each rank of a CPU layout gets max(1, cores // ranks) threads unless the shape says otherwise
(the tables measured with the nearest thread count), and the whole is slowed by ranks x threads /
cores where they outnumber the cores, times the loss measured for processes time-sliced two to a
core (`sharing_factor`).
"""
import math

from ..autograd.ops.attention import BLOCK_SIZE as ATTENTION_BLOCK_ROWS, query_blocks
from ..tensor_parallel import pad_vocab_size
from .memory import rank_layers, rank_parameters


def log_interpolate(grid_axes, values, point):
    """Values measured on a grid (nested lists, one axis per entry of grid_axes) at `point`,
    multilinear in log2 of the coordinates and of the values, clamped at the edges."""
    corners = [(values, 1.0)]
    for axis, x in zip(grid_axes, point):
        logs = [math.log2(a) for a in axis]
        lx = min(max(math.log2(max(x, 1)), logs[0]), logs[-1])
        i = max(0, min(len(logs) - 2, sum(1 for v in logs if v <= lx) - 1)) if len(logs) > 1 else 0
        frac = 0.0 if len(logs) == 1 else (lx - logs[i]) / (logs[i + 1] - logs[i])
        nxt = []
        for node, weight in corners:
            nxt.append((node[i], weight * (1 - frac)))
            if frac > 0:
                nxt.append((node[i + 1], weight * frac))
        corners = nxt
    return 2 ** sum(weight * math.log2(node) for node, weight in corners)


def layer_gemms(cfg, shape):
    """(rows, inner, cols) of one layer's forward GEMMs on one TP rank for one micro-batch: the
    rows are the micro-batch's tokens on this rank (all of them under SP, which gathers them)."""
    m, h, t = shape.micro_batch * shape.local_seq, cfg.hidden_size, shape.tp
    query = cfg.num_attention_heads * cfg.head_dim
    qkv = (query + 2 * cfg.num_query_groups * cfg.head_dim) // t
    ffn = cfg.ffn_hidden_size // t
    return [(m, h, qkv), (m, query // t, h), (m, h, 2 * ffn if cfg.swiglu else ffn), (m, ffn, h)]


def moe_layer_gemms(cfg, shape):
    """(rows, inner, cols) of one MoE layer's forward GEMMs on one rank for one micro-batch: its
    attention's two; the router's; each of the rank's E / EP experts on its share of the k T rows
    the rank receives, routing balanced (k T EP / E rows an expert), its columns split over ETP;
    the shared expert's and its gate's on the T tokens (the whole sequence, under SP too)."""
    tokens, h, t = shape.micro_batch * shape.local_seq, cfg.hidden_size, shape.tp
    rows = cfg.moe_router_topk * tokens * shape.ep / cfg.num_experts
    gemms = layer_gemms(cfg, shape)[:2] + [(tokens, h, cfg.num_experts)]
    # moe/experts.py: SwiGLU's gate and up joined; the grouped GEMM's blocks counted one an expert
    expert = _mlp_gemms(cfg, rows, cfg.moe_ffn_hidden_size // shape.expert_tp, cfg.swiglu)
    gemms += expert * (cfg.num_experts // shape.ep)
    shared = cfg.moe_shared_expert_intermediate_size
    if shared:
        gemms += _mlp_gemms(cfg, tokens, shared // t, False)
    if cfg.moe_shared_expert_gate:
        gemms.append((tokens, h, 1))
    return gemms


def _mlp_gemms(cfg, rows, ffn, joined):
    """An expert's GEMMs on `rows` rows, ffn its columns on this rank: fc (SwiGLU: gate and up, one
    GEMM where `joined`) and proj."""
    h = cfg.hidden_size
    first = [(rows, h, 2 * ffn)] if joined else [(rows, h, ffn)] * (2 if cfg.swiglu else 1)
    return first + [(rows, ffn, h)]


def gemm_seconds(rates, m, k, n):
    """Seconds of an (m x k) @ (k x n) product at the table's rate for (rows m, cols n, inner k)."""
    rate = log_interpolate([rates["dims"]] * 3, rates["flops"], (m, n, k))
    return 2.0 * m * k * n / rate


def forward_backward(seconds, gemms):
    """(forward, backward) seconds of forward GEMMs (m, k, n) and their two backward products
    each, the input's gradient (m, n, k) and the weight's (k, m, n), `seconds(m, k, n)` apiece."""
    forward = sum(seconds(m, k, n) for m, k, n in gemms)
    backward = sum(seconds(m, n, k) + seconds(k, m, n) for m, k, n in gemms)
    return forward, backward


def gemms_seconds(rates, gemms):
    """(forward, backward) seconds of forward GEMMs at the calibration table's rates."""
    return forward_backward(lambda m, k, n: gemm_seconds(rates, m, k, n), gemms)


def attention_scores(seq):
    """Scores the CPU's blockwise attention computes for one head of one sample: each block of
    query rows sees the keys up to its last row (the causal part computed and masked)."""
    return sum((stop - first) * seen for first, stop, seen in query_blocks(seq, seq, ATTENTION_BLOCK_ROWS))


def attention_seconds(cfg, shape, measured):
    """(forward, backward) seconds of one layer's attention core on a rank for one micro-batch."""
    heads = cfg.num_attention_heads // shape.tp
    if shape.cp > 1:        # the ring: CP full blocks of local queries x local keys per head
        scores, seq = shape.cp * shape.local_seq ** 2, shape.local_seq
    else:
        scores, seq = attention_scores(shape.seq), shape.seq
    table = measured["attention"]
    kind = "dropout" if cfg.attention_dropout > 0 and shape.cp == 1 else "none"
    axes = [table["seqs"], table["head_dims"]]
    per_score = [log_interpolate(axes, table[f"{kind}_{way}"], (seq, cfg.head_dim))
                 for way in ("forward", "backward")]
    work = shape.micro_batch * heads * scores
    return work * per_score[0], work * per_score[1]


#: Elements each kind of memory-bound op reads and writes per element of its array, (forward,
#: backward), w bytes each:
#:   norm: forward reads x, writes y and x-hat; backward reads dy and x-hat, writes dx (and sums
#:     the gain's gradient from them);
#:   activation: GeLU reads its input, writes its output and keeps tanh; backward reads the
#:     gradient, input and tanh, writes the gradient; SwiGLU per element of its output: reads the
#:     gate and up halves, writes one; backward reads the gradient and both halves, writes two;
#:   residual: the branch's bias added, dropout and the residual add (forward reads y, bias'd y,
#:     residual, writes the sum; backward passes the gradient through the mask and sums the
#:     residual's and the bias's gradients); a dropout mask adds 1 byte each way;
#:   stream: a bias added or a rotation (read and write; the bias's gradient summed), and each
#:     parameter's gradient summed into the accumulated one (read twice, written once: 3 backward);
#:   embedding: forward reads and writes its rows; backward reads the gradient and reads and
#:     writes the table's rows it scatters into;
#:   loss: three passes over the logits forward (the row maximum, then exp and its sum), two
#:     backward (the gradient written in place);
#:   dispatch (MoE, per element of the k T routed rows of h): forward the rows gathered from their
#:     tokens (read, write), multiplied by their router weights (read, write) and added back into
#:     their tokens (read the row, read and write the sum); backward the gradient gathered (2),
#:     the row's gradient (read, write) and the weight's (read the gradient and the row), and the
#:     gradient scattered back to the tokens (3);
#:   regroup (MoE under EP): the arrived rows put in expert order and back (a gather each way
#:     forward, a scatter-add each backward).
DISPATCH_PASSES = {"dispatch": (7, 9), "regroup": (4, 6)}
PASSES = {"norm": (3, 4), "activation": (3, 4), "swiglu": (3, 5), "residual": (5, 4), "stream": (2, 1),
          "embedding": (2, 3), "loss": (3, 2), **DISPATCH_PASSES}


def op_bytes(kind, elements, w, mask=False):
    """(forward, backward) bytes of a memory-bound op of this kind over `elements` numbers."""
    extra = elements if mask else 0
    forward, backward = PASSES[kind]
    return elements * forward * w + extra, elements * backward * w + extra


def layer_traffic(cfg, shape, w):
    """The memory-bound ops of one layer on a rank for one micro-batch: [(kind, elements of its
    array, forward bytes, backward bytes)]. The norms and residual branches run on the full
    hidden size at every TP rank ('whole'), a 1 / TP shard of it under SP; QKV's bias, the MLP's
    activation and rotary on this rank's columns."""
    t, h, tokens = shape.tp, cfg.hidden_size, shape.micro_batch * shape.local_seq
    whole = tokens * h // (t if shape.sequence_parallel else 1)
    query = cfg.num_attention_heads * cfg.head_dim
    qkv = tokens * (query + 2 * cfg.num_query_groups * cfg.head_dim) // t
    ffn = tokens * cfg.ffn_hidden_size // t
    ops = [("norm", whole), ("norm", whole), ("residual", whole), ("residual", whole),
           ("swiglu", ffn) if cfg.swiglu else ("activation", ffn)]
    if cfg.qkv_bias:
        ops.append(("stream", qkv))
    if cfg.position_embedding_type == "rope":
        ops.append(("stream", tokens * (query + cfg.num_query_groups * cfg.head_dim) // t))
    return [(kind, n) + op_bytes(kind, n, w, kind == "residual" and cfg.hidden_dropout > 0) for kind, n in ops]


def moe_layer_traffic(cfg, shape, w):
    """The memory-bound ops of one MoE layer on a rank for one micro-batch: a dense layer's but its
    MLP's activation; the experts' activations on the k T routed rows (their columns split over
    ETP), the shared expert's on the tokens; the dispatch over the routed rows of h (and the
    regroup under EP); with biases, the experts' two grouped bias passes (moe/experts.py), each
    added apart: the first projection's on its columns (fc's before the fused GeLU, or gate's and
    up's before SwiGLU) and the output projection's on h."""
    tokens, h = shape.micro_batch * shape.local_seq, cfg.hidden_size
    rows, kind = cfg.moe_router_topk * tokens, "swiglu" if cfg.swiglu else "activation"
    columns = rows * cfg.moe_ffn_hidden_size // shape.expert_tp
    ops = [(kind, columns), ("dispatch", rows * h)]
    ops += [("regroup", rows * h)] if shape.ep > 1 else []
    if cfg.add_bias_linear:
        ops += [("stream", 2 * columns if cfg.swiglu else columns), ("stream", rows * h)]
    if cfg.moe_shared_expert_intermediate_size:
        ops.append((kind, tokens * cfg.moe_shared_expert_intermediate_size // shape.tp))
    attention = [op for op in layer_traffic(cfg, shape, w) if op[0] not in ("activation", "swiglu")]
    return attention + [(kind, n) + op_bytes(kind, n, w) for kind, n in ops]


def traffic_seconds(measured, traffic, way):
    """Seconds of [(kind, elements, forward bytes, backward bytes)] forward (way 0) or backward
    (way 1), each at the bandwidth its kind achieved on arrays of that size (`plan calibrate`
    times the engine's own ops; kinds it did not time use the blocked add's)."""
    tables = measured["bandwidth"]
    seconds = 0.0
    for kind, elements, *nbytes in traffic:
        table = tables.get(kind, tables["stream"])
        seconds += nbytes[way] / log_interpolate([table["elements"]], table["bytes_per_s"], (elements,))
    return seconds


def end_seconds(cfg, shape, measured, w):
    """Seconds of the first stage's embedding and of the last stage's output layer and loss, for
    one micro-batch, by part: (first stage, last stage). The embedding reads and writes its rows
    and scatters their gradient back; the positions are added and dropped out as a residual
    branch is; the final norm is one more norm; the loss passes over the logits three times
    forward (the row maximum, then exp and its sum) and twice backward (the gradient written in
    place)."""
    tokens, h = shape.micro_batch * shape.local_seq, cfg.hidden_size
    vocab = pad_vocab_size(cfg.vocab_size, shape.tp, cfg.make_vocab_size_divisible_by) // shape.tp
    last = [("norm", tokens * h) + op_bytes("norm", tokens * h, w),
            ("loss", tokens * vocab) + op_bytes("loss", tokens * vocab, w)]
    first = [("embedding", tokens * h) + op_bytes("embedding", tokens * h, w),
             ("residual", tokens * h) + op_bytes("residual", tokens * h, w, cfg.hidden_dropout > 0)]
    both = lambda traffic: sum(traffic_seconds(measured, traffic, way) for way in (0, 1))
    return {"memory_bound": both(first)}, {"gemm": sum(gemms_seconds(measured["gemm"], [(tokens, h, vocab)])),
                                           "memory_bound": both(last)}


#: The parts of a measured profile's compute (stage_seconds), as step_time reports them.
COMPUTE_PARTS = ("gemm", "attention", "memory_bound", "engine")


def stage_seconds(cfg, shape, measured, again, w):
    """Compute seconds of one micro-batch on each pipeline rank, by part (COMPUTE_PARTS): its
    layers (dense or MoE), its ends, the engine's cost per layer and per micro-batch, and the sum
    of each parameter's gradient into the accumulated one (a stream of its parameters, read twice
    and written once)."""
    layer = layer_seconds(cfg, shape, measured, again, layer_gemms(cfg, shape), layer_traffic(cfg, shape, w))
    moe = None
    if cfg.num_experts:
        moe = layer_seconds(cfg, shape, measured, again, moe_layer_gemms(cfg, shape), moe_layer_traffic(cfg, shape, w))
    stages = pipeline_stages(cfg, shape, layer, *end_seconds(cfg, shape, measured, w), moe_layer=moe)
    for parts, params in stages:
        parts["memory_bound"] += traffic_seconds(measured, [("stream", params, 0, 3 * params * w)], 1)
        parts["engine"] += measured["micro_batch_overhead_s"]
    return [parts for parts, _ in stages]


def layer_seconds(cfg, shape, measured, again, gemms, traffic):
    """{part: seconds} of one layer of these GEMMs and memory-bound ops and the attention core for
    one micro-batch, the recomputed share's forward twice. The engine's cost is the measured dense
    layer's (an MoE layer's extra Python calls, its router's and dispatch's, are not counted)."""
    gemm_f, gemm_b = gemms_seconds(measured["gemm"], gemms)
    attn_f, attn_b = attention_seconds(cfg, shape, measured)
    bytes_f, bytes_b = (traffic_seconds(measured, traffic, way) for way in (0, 1))
    overhead = measured["layer_overhead_s"]
    return {"gemm": gemm_f + gemm_b + again * gemm_f, "attention": attn_f + attn_b + again * attn_f,
            "memory_bound": bytes_f + bytes_b + again * bytes_f, "engine": overhead * (1 + again / 2)}


def pipeline_stages(cfg, shape, layer, first, last, moe_layer=None):
    """[(seconds by part, parameters)] of one micro-batch on each pipeline rank: its dense layers at
    `layer`'s seconds each and its MoE layers at `moe_layer`'s, the first stage's ends `first` and
    the last's `last` ({part: s})."""
    stages = []
    for rank in range(shape.pp):
        layers = rank_layers(cfg, shape, rank)
        moe = sum(cfg.is_moe_layer(number) for number in layers)
        parts = {part: (len(layers) - moe) * seconds + (moe * moe_layer[part] if moe else 0.0)
                 for part, seconds in layer.items()}
        for ends, holds in ((first, rank == 0), (last, rank == shape.pp - 1)):
            for part, seconds in ends.items():
                parts[part] += seconds if holds else 0.0
        stages.append((parts, rank_parameters(cfg, shape, rank)))
    return stages


def busiest_stage(stages, shape, slowdown=1.0):
    """(compute, bubble, compute by part) seconds of a step from each pipeline rank's seconds of
    one micro-batch by part: M micro-batches on the busiest rank, and the pipeline's fill and
    drain, in which each other stage's micro-batch runs once alone: (sum of the stages' - the
    busiest's) / V. With equal stages this is the (PP - 1) / (M V) x compute of time_model.py."""
    totals = [sum(parts.values()) * slowdown for parts in stages]
    busiest = stages[totals.index(max(totals))]
    parts = {part: shape.micro_batches * seconds * slowdown for part, seconds in busiest.items()}
    return shape.micro_batches * max(totals), (sum(totals) - max(totals)) / shape.virtual, parts


def nearest_count(by_threads, threads):
    """The key of {"threads": ...} measured with the thread count nearest `threads` (the
    fewer on a tie)."""
    return min(by_threads, key=lambda n: (abs(int(n) - threads), int(n)))


def measured_rates(profile, shape):
    """The profile's measurements at the thread count a rank of `shape` gets, and how much
    slower the ranks run for sharing the cores."""
    cores = profile["devices_per_node"]
    threads = shape.threads_per_rank or max(1, cores // shape.ranks)
    by_threads = profile["measured"]["threads"]
    nearest = nearest_count(by_threads, threads)
    sharing = shape.ranks * threads / cores if profile.get("ranks_share_flops") else 1.0
    if sharing > 1:         # time-sliced ranks lose more than their share (measure.sharing_factor)
        sharing *= profile["measured"].get("sharing_factor", 1.0)
    return by_threads[nearest], max(1.0, sharing)


def measured_compute(cfg, shape, profile, again, w):
    """(compute, bubble, compute by part) seconds of a step (busiest_stage), at this machine's
    measured rates slowed by ranks sharing its cores."""
    measured, slowdown = measured_rates(profile, shape)
    return busiest_stage(stage_seconds(cfg, shape, measured, again, w), shape, slowdown)
