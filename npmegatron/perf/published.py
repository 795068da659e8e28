"""A GPU rank's compute time from published rates and a counted implementation (a profile's
"published" section, as the shipped dgx2h profile has), for machines this project cannot measure:

- GEMMs at the FLOP/s that a published benchmark measured at the shapes nearest in log space
  (cuBLAS's M, N, K; interpolated_rate) in the step's element width, and never faster than
  their minimum traffic (both inputs read and the output written once) at the device's memory
  bandwidth. A batched
  GEMM looks its rate up with the batch's rows stacked: its products fill the device together;
  its traffic is every product's;
- attention as the 2019 implementation ran it, unfused: the score and context GEMMs over every
  score of a b x heads x s x s tensor (batched), and the elementwise kernels between them as
  passes over that tensor;
- every other memory-bound kernel as passes over the tensor it touches, at the bandwidth: the
  published section's counts per tensor (the hidden size, which TP leaves whole on every rank
  unless sequence parallelism shards it, QKV, the attention output and the MLP's 4h on this
  rank's columns), plus a dropout's passes where the model drops out;
- the output layer's GEMM and the loss's bytes per logit on the last stage, the embedding's
  passes on the first, and each parameter's gradient accumulated (read twice, written once);
- an MoE layer, which the 2019 implementation did not have, with this project's GEMMs and
  dispatch (work.moe_layer_gemms, DISPATCH_PASSES) and its experts' inner tensors passed over as
  the dense MLP's.

No engine cost is added for launching kernels: a GPU's kernels run asynchronously behind the host,
and at these shapes each lasts far longer than its launch. What the host cannot hide is where the
modelled code waits for the device, and a profile's optional host section times those (host_seconds,
optimizer_round_trips), as the 2019 code has them:

- the CUDA random-number generator's state read and written around attention's dropout (the
  model-parallel RNG tracker's fork) and by each checkpointed layer (mpu/random.py): PyTorch's state
  then held 200 MTGP32 generators on the device, and every read or write was a synchronous copy of
  them over the host's link (rng_state_bytes at host_link_bytes_per_s), after which the device
  waits a round trip (host_round_trip_s) for its next kernel;
- the fp16 optimizer's loops over the parameters that read a number back per tensor (the overflow
  check's sum, the gradient norm): two round trips and one launch more a tensor;
- the data-parallel gradients copied into a flat buffer, averaged and copied back
  (ddp_bytes_per_parameter over the bandwidth, once a step), in both DistributedDataParallels the
  2019 code could run.

Where the gradients' all-reduce overlaps backward (torch's DistributedDataParallel), NCCL's kernel
holds some of the device's SMs while it runs, and the backward's GEMMs run on the rest
(overlap_contention_seconds, from the profile's sm_count and nccl_channels).
"""
import math

from ..autograd import InputError
from ..tensor_parallel import pad_vocab_size
from .memory import rank_layers, rank_parameters
from .work import DISPATCH_PASSES, busiest_stage, forward_backward, layer_gemms, moe_layer_gemms, pipeline_stages


NEIGHBOURS = 4


def interpolated_rate(points, M, N, K):
    """FLOP/s of a cuBLAS GEMM whose column-major output is M x N with inner size K, from the
    published [M, N, K, TFLOP/s] points: the NEIGHBOURS nearest in log2 space of the shape, their
    log rates weighted by 1 / distance^2 (a modified Shepard interpolation: smooth between points,
    exact at one, and blind to points far off). Each coordinate is first clamped to the range
    the points cover: no rate is extrapolated past what was measured."""
    logs = [[math.log2(p[axis]) for p in points] for axis in range(3)]
    want = [min(max(math.log2(max(1, x)), min(axis)), max(axis)) for x, axis in zip((M, N, K), logs)]
    scored = sorted((sum((math.log2(a) - b) ** 2 for a, b in zip(p[:3], want)), p[3]) for p in points)
    nearest = scored[:NEIGHBOURS]
    if nearest[0][0] == 0:
        return nearest[0][1] * 1e12
    weights = [1 / d2 for d2, _ in nearest]
    return 2 ** (sum(wt * math.log2(rate) for wt, (_, rate) in zip(weights, nearest)) / sum(weights)) * 1e12


def gemm_seconds(published, bandwidth, w, m, k, n, batch=1):
    """Seconds of `batch` row-major (m x k) @ (k x n) products in elements of w bytes. cuBLAS,
    column-major, computes each as the transposed product: M = n, N = m (DeepBench's N is the
    minibatch, as m, the tokens, is here)."""
    rate = interpolated_rate(published["gemm"][str(w)], n, batch * m, k)
    traffic = batch * (m * k + k * n + m * n) * w
    return max(2.0 * batch * m * k * n / rate, traffic / bandwidth)


def passes_seconds(published, bandwidth, w, tensors, way):
    """Seconds of the passes over [(tensor name, elements)] forward (way 0) or backward (1); an MoE
    layer's dispatch, which the 2019 implementation did not have, as this project's (work.py)."""
    passes = {**DISPATCH_PASSES, **published["passes"]}
    return sum(passes[name][way] * elements * w for name, elements in tensors) / bandwidth


def layer_tensors(cfg, shape, moe=False):
    """([(pass-table name, elements)] over attention's scores, [...] over everything else): one
    layer's memory-bound kernels on a rank for one micro-batch; an MoE layer's MLP part as its
    experts' (moe_tensors)."""
    t, h, tokens = shape.tp, cfg.hidden_size, shape.micro_batch * shape.local_seq
    whole = tokens * h // (t if shape.sequence_parallel else 1)
    query = cfg.num_attention_heads * cfg.head_dim
    qkv = tokens * (query + 2 * cfg.num_query_groups * cfg.head_dim) // t
    scores = shape.micro_batch * cfg.num_attention_heads // t * shape.local_seq * shape.seq
    on_scores = [("scores", scores)] + ([("dropout", scores)] if cfg.attention_dropout > 0 else [])
    mlp = moe_tensors(cfg, shape) if moe else [("ffn", tokens * cfg.ffn_hidden_size // t)]
    others = [("hidden", whole), ("qkv", qkv), ("context", tokens * query // t)] + mlp
    if cfg.hidden_dropout > 0:
        others += [("dropout", whole), ("dropout", whole)]
    return on_scores, others


def moe_tensors(cfg, shape):
    """An MoE layer's MLP part: its experts' inner tensors over the k T routed rows (balanced, their
    columns split over ETP) and the shared expert's over the tokens, passed over as the dense MLP's
    "ffn"; the dispatch's passes over the routed rows of h (and the regroup under EP)."""
    tokens, h = shape.micro_batch * shape.local_seq, cfg.hidden_size
    rows = cfg.moe_router_topk * tokens
    tensors = [("ffn", rows * cfg.moe_ffn_hidden_size // shape.expert_tp), ("dispatch", rows * h)]
    tensors += [("regroup", rows * h)] if shape.ep > 1 else []
    shared = cfg.moe_shared_expert_intermediate_size
    return tensors + ([("ffn", tokens * shared // shape.tp)] if shared else [])


def layer_seconds(cfg, shape, published, bandwidth, w, moe=False):
    """{part: (forward, backward) seconds} of one layer (moe: an MoE layer) on a rank for one
    micro-batch."""
    one = lambda m, k, n: gemm_seconds(published, bandwidth, w, m, k, n)
    seq, d = shape.local_seq, cfg.head_dim
    batch = shape.micro_batch * cfg.num_attention_heads // shape.tp
    batched = lambda m, k, n: gemm_seconds(published, bandwidth, w, m, k, n, batch)
    on_scores, others = layer_tensors(cfg, shape, moe)
    passes = lambda tensors, way: passes_seconds(published, bandwidth, w, tensors, way)
    scores = forward_backward(batched, [(seq, d, shape.seq), (seq, shape.seq, d)])
    return {"gemm": forward_backward(one, moe_layer_gemms(cfg, shape) if moe else layer_gemms(cfg, shape)),
            "attention": tuple(scores[way] + passes(on_scores, way) for way in (0, 1)),
            "memory_bound": tuple(passes(others, way) for way in (0, 1))}


def end_seconds(cfg, shape, published, bandwidth, w):
    """{part: seconds} of one micro-batch's embedding (first stage) and of the final norm, the
    output layer and the loss (last stage)."""
    tokens, h = shape.micro_batch * shape.local_seq, cfg.hidden_size
    sharded = tokens * h // (shape.tp if shape.sequence_parallel else 1)      # what SP scatters
    vocab = pad_vocab_size(cfg.vocab_size, shape.tp, cfg.make_vocab_size_divisible_by) // shape.tp
    both = lambda tensors: sum(passes_seconds(published, bandwidth, w, tensors, way) for way in (0, 1))
    one = lambda m, k, n: gemm_seconds(published, bandwidth, w, m, k, n)
    loss = sum(published["loss_bytes_per_logit"]) * tokens * vocab / bandwidth
    embedding = [("embedding", tokens * h)] + ([("dropout", sharded)] if cfg.hidden_dropout > 0 else [])
    first = {"memory_bound": both(embedding)}
    last = {"gemm": sum(forward_backward(one, [(tokens, h, vocab)])),
            "memory_bound": both([("norm", sharded)]) + loss}
    return first, last


def stage_seconds(cfg, shape, profile, again, w):
    """Compute seconds of one micro-batch on each pipeline rank, by part (no engine part: see the
    module docstring): its layers (the recomputed share's forward twice), its ends, and its
    parameters' gradients accumulated."""
    published, bandwidth = profile["published"], profile["memory_bandwidth_bytes_per_s"]
    if str(w) not in published["gemm"]:
        raise InputError(f"profile {profile['name']!r} publishes GEMM rates for {' and '.join(sorted(published['gemm']))}"
                         f"-byte elements, not this model's {w}; plan it in one of those widths (e.g. --fp16) "
                         f"or add published.gemm.\"{w}\" to the profile")

    def per_layer(moe):
        seconds = layer_seconds(cfg, shape, published, bandwidth, w, moe)
        parts = {part: forward + backward + again * forward for part, (forward, backward) in seconds.items()}
        return parts | ({"host": host_seconds(published, again)} if "rng_state_bytes" in published else {})

    moe_layer = per_layer(True) if cfg.num_experts else None
    stages = pipeline_stages(cfg, shape, per_layer(False), *end_seconds(cfg, shape, published, bandwidth, w),
                             moe_layer=moe_layer)
    for parts, params in stages:
        parts["memory_bound"] += 3 * params * w / bandwidth
    return [parts for parts, _ in stages]


#: Copies of the CUDA generator's state per layer and micro-batch in the 2019 code (mpu/random.py):
#: the RNG tracker's fork around attention's dropout reads it, writes the tracker's, reads that back
#: and writes the first back (4), in the forward and again in a recomputed one; a checkpointed layer
#: also reads it forward, and backward reads it, writes the forward's and writes it back (4).
FORK_COPIES, CHECKPOINT_COPIES = 4, 4


def host_seconds(published, again):
    """Seconds one layer's micro-batch waits for the generator's state to cross the host's link, the
    recomputed share (`again`) forking twice and checkpointing (FORK_COPIES, CHECKPOINT_COPIES)."""
    copies = FORK_COPIES * (1 + again) + CHECKPOINT_COPIES * again
    one = published["rng_state_bytes"] / published["host_link_bytes_per_s"] + published["host_round_trip_s"]
    return copies * one


def parameter_tensors(cfg, shape):
    """The most parameter tensors a pipeline rank holds: each layer's two norms (gain, and bias for
    LayerNorm) and four linears (weight, and bias where the model has them; an MoE layer counted
    as a dense one), the first stage's embedding tables, the last's final norm and untied output."""
    norm = 1 if cfg.normalization == "RMSNorm" else 2
    per_layer = 2 * norm + 4 * (2 if cfg.add_bias_linear else 1)
    tables = 1 + (cfg.position_embedding_type == "learned_absolute")
    ends = [tables * (rank == 0) + (norm + cfg.untie_embeddings_and_output_weights) * (rank == shape.pp - 1)
            for rank in range(shape.pp)]
    return max(per_layer * len(rank_layers(cfg, shape, rank)) + ends[rank] for rank in range(shape.pp))


def optimizer_round_trips(cfg, shape, published):
    """Seconds the fp16 optimizer's per-tensor reads of a number add (abe36e2 fp16/loss_scaler.py's
    overflow check, float(x.float().sum()) for each gradient; mpu/grads.py's clip_grad_norm,
    norm().item() for each): two round trips and the cast's launch a tensor."""
    if "host_round_trip_s" not in published:
        return 0.0
    return parameter_tensors(cfg, shape) * (2 * published["host_round_trip_s"] + published["launch_s"])


def ddp_seconds(cfg, shape, published, bandwidth):
    """Seconds a step's data-parallel gradients spend copied into the flat buffer, averaged and
    copied back, on the rank with the most parameters (0 without DP)."""
    if shape.dp * shape.cp == 1:
        return 0.0
    params = max(rank_parameters(cfg, shape, rank) for rank in range(shape.pp))
    return params * published.get("ddp_bytes_per_parameter", 0) / bandwidth


def overlap_contention_seconds(published, overlapped, parts):
    """Seconds the backward loses to a data-parallel all-reduce it overlaps for `overlapped` seconds
    (0 without the profile's SM figures): NCCL runs a collective as one kernel of a block a channel,
    each held on its own SM for as long as the all-reduce lasts, and the backward's GEMMs (their
    share of the compute, `parts`) run on the device's other SMs meanwhile, so that share takes
    sm_count / (sm_count - nccl_channels) as long (a whole SM charged for each block: the profile's
    description says why). The memory-bound kernels, which the all-reduce's own traffic slows, and
    attention's batched products are not charged."""
    if "nccl_channels" not in published or overlapped <= 0:
        return 0.0
    channels, sms = published["nccl_channels"], published["sm_count"]
    gemm_share = parts.get("gemm", 0.0) / sum(parts.values())
    return overlapped * gemm_share * channels / (sms - channels)


def published_compute(cfg, shape, profile, again, w):
    """(compute, bubble, compute by part) seconds of a step (work.busiest_stage), with the
    data-parallel gradients' copies once a step."""
    compute, bubble, parts = busiest_stage(stage_seconds(cfg, shape, profile, again, w), shape)
    copies = ddp_seconds(cfg, shape, profile["published"], profile["memory_bandwidth_bytes_per_s"])
    parts["memory_bound"] += copies
    return compute + copies, bubble, parts
