"""Step time from an alpha-beta + roofline model.

Ring costs, for n ranks and a buffer of S bytes (alpha per ring step, beta per byte one device
sends, base a collective call's own latency, 0 unless the profile gives one: NCCL's model has
one):  all-reduce base + 2(n-1) alpha + 2(n-1)/n S beta;  all-gather / reduce-scatter (S the
full buffer) base + (n-1) alpha + (n-1)/n S beta;  point-to-point base + alpha + S beta;
all-to-all (S each rank's buffer, S/n to each peer) as the all-gather of S: a rank sends the same
(n-1)/n S bytes in n-1 messages, each a step's alpha, on the all-gather link (a profile measures no
all-to-all of its own). Across nodes it gets no ring's sharing (beta / k below): every member
sends its own off-node share through its own part of the node's network.

A step on one rank, M micro-batches, V virtual stages, L layers on the rank:
- compute, for a profile with this machine's measured rates ("measured", from `plan calibrate`):
  the busiest stage's GEMMs, attention, memory-bound bytes and engine overhead (work.py); for a
  GPU profile with published rates ("published", as dgx2h has): the same parts from a published
  GEMM benchmark, the device's bandwidth and the modelled implementation's kernels (published.py);
  for a GPU profile with measured rates ("device", as h200 has): this engine's counted work on a
  GPU at the card's measured GEMM rates, copy bandwidth and launch costs (device.py);
  otherwise model_flops(global batch) / (TP PP DP) / one rank's FLOP/s (the profile's, or on a
  CPU profile its share of the machine: rank_flops), times 4/3 for full
  recomputation (one more forward) unless the profile's rate was measured with it; model FLOPs
  count an MoE model's active parameters (a token's k experts), and whole experts under TP
  (ETP 1) add their FLOPs repeated on every TP rank;
- TP comm (TP > 1): per layer and micro-batch 4 all-reduces of s*b*h elements (2 forward,
  2 backward; 6 with full recomputation), or with SP as many all-gathers plus reduce-scatters;
  an MoE layer half of those (its attention's) and its MLP part's (moe_tp_collectives); plus
  the embedding's and the output layer's all-reduce, 2 per micro-batch, and the vocabulary-parallel
  loss's three of one float32 number a token (the rows' maximum, the target's logit, the sum of
  exponentials), spread over the PP ranks;
- EP comm (EP > 1): per MoE layer and micro-batch 2 all-to-alls of the k T routed rows forward
  and 2 backward, and 1 of the E counts forward (3 more forward for a recomputed layer), exposed;
  routing is taken as balanced: each rank receives as many rows as it sends, k T EP / E an
  expert, and no expert's rows are dropped or padded to a capacity;
- CP comm (CP > 1): the ring's key/value blocks (context_parallel_time), exposed; every other
  term counts a rank's seq / CP tokens, and gradients are averaged over DP x CP;
- PP comm (PP > 1): per micro-batch and virtual stage one activation sent forward and one
  gradient back, s*b*h elements (/TP with SP: the sequence shard), counted as exposed;
- bubble = (PP-1)/(M V) x (compute + TP, EP, CP and PP comm); with measured rates the compute's part
  is each other stage's micro-batch once (work.measured_compute), which is the same for equal
  stages and less where the busiest stage is the last's output layer;
- DP comm exposed = max(all-reduce of the last bucket, all-reduce of this rank's gradients -
  dp_overlap x the last micro-batch's backward (2/3 of its compute)): gradients are reduced once
  per step, overlapped with the backward of the last micro-batch, and the last bucket starts only
  when that backward ends (last_bucket_elements: at least the embedding's tables); the
  whole all-reduce without overlap_grad_reduce (Megatron's --no-overlap-grad-reduce, and what
  the 2019 implementation did); under EP the dense gradients over DP x CP and the experts' over
  their DP x CP / EP ranks; a published profile with SM figures adds what the overlapped part
  takes from backward's GEMMs (published.overlap_contention_seconds); plus, with PP > 1, the
  tied embedding's all-reduce between the first and last stage, exposed;
- optimizer = the bytes AdamW reads and writes per parameter this rank updates / the profile's
  memory_bandwidth_bytes_per_s (memory bound; 0 for a profile without one): float32 reads the
  parameter, gradient and two moments and writes three (28 B); under --fp16/--bf16 the float32
  master, gradient and moments and the 16-bit parameter written back (30 B); a "published"
  profile gives its implementation's own count, and the round trips its per-tensor loops make
  (published.optimizer_round_trips).

Which link parameters a group uses: ranks are ordered TP fastest, then CP, then DP, then PP
(comm/grid.py), filling nodes of `devices_per_node`. A group within one node uses "intra". A
group spanning nodes uses "inter", whose beta is one device's share of the node's network; k
members of a ring on one node cross the node boundary once between them, so their ring runs at
k shares: beta / k.
"""
from collections import Counter

from ..model import gpt_num_parameters, model_flops
from ..recompute import recompute_segments
from ..tensor_parallel import pad_vocab_size
from .memory import (_mlp_parameters, _recompute_config, check_shape, element_bytes, optimizer_parameters,
                     rank_expert_parameters, rank_layers, rank_parameters)
from .device import device_compute, optimizer_seconds as device_optimizer_seconds
from .published import optimizer_round_trips, overlap_contention_seconds, published_compute
from .work import measured_compute, measured_rates, nearest_count

RECOMPUTE_COST = {"none": 1.0, "selective": 1.0, "full": 4.0 / 3.0}


def all_reduce_time(n, nbytes, alpha, beta, base=0.0):
    return 0.0 if n <= 1 else base + 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


def all_gather_time(n, nbytes, alpha, beta, base=0.0):
    return 0.0 if n <= 1 else base + (n - 1) * alpha + (n - 1) / n * nbytes * beta


reduce_scatter_time = all_gather_time


def p2p_time(nbytes, alpha, beta, base=0.0):
    return base + alpha + nbytes * beta


def all_to_all_time(n, nbytes, alpha, beta, base=0.0):
    """n ranks, each holding nbytes of which it sends nbytes / n to each of its n - 1 peers: the
    per-rank bytes and messages of an all-gather of nbytes (module docstring)."""
    return all_gather_time(n, nbytes, alpha, beta, base)


def group_links(profile, op, span, members_per_node):
    """(alpha, beta, base) of a group whose ranks cover `span` consecutive rank positions."""
    if span <= profile["devices_per_node"]:
        link = profile["intra"][op]
        return link["alpha_s"], link["beta_s_per_byte"], link["base_s"]
    link = profile["inter"][op]
    return link["alpha_s"], link["beta_s_per_byte"] / max(1, members_per_node), link["base_s"]


def placement(shape, profile):
    """Span and members per node of the TP group, the CP ring, the DP x CP group, pipeline
    neighbours, the EP group and the experts' data-parallel group (ranks ordered TP, CP, DP, PP)."""
    dpn, t, c, d, p = profile["devices_per_node"], shape.tp, shape.cp, shape.dp, shape.pp

    def strided(count, stride):
        """`count` members `stride` ranks apart."""
        return stride * (count - 1) + 1, 1 if stride >= dpn else max(1, min(count, dpn // stride))

    # EP: neighbouring ranks of the DP x CP ranks; the experts' data-parallel ranks: every EP-th
    # of them (comm/grid.py)
    expert_dp = Counter(t * q // dpn for q in range(0, d * c, shape.ep))
    return {"tp": (t, min(t, dpn)), "cp": strided(c, t), "dp": strided(d * c, t),
            "pp": (t * c * d * p if p > 1 else 1, 1), "ep": strided(shape.ep, t),
            "edp": (t * (d * c - shape.ep) + 1, max(expert_dp.values()))}


def rank_flops(profile, shape):
    """One rank's FLOP/s. On a CPU profile (`ranks_share_flops`) the shape's ranks all run on the
    one machine: each gets max(1, cores // ranks) BLAS threads (as bench scaling sets them) and
    the rate measured with that many threads (`flops_by_threads`, the nearest count measured),
    shared further when ranks outnumber the cores."""
    if not profile.get("ranks_share_flops"):
        return profile["flops"]
    cores = profile["devices_per_node"]
    threads = max(1, cores // shape.ranks)
    rates = profile.get("flops_by_threads") or {str(cores): profile["flops"]}
    return rates[nearest_count(rates, threads)] * min(1.0, cores / shape.ranks)


def recomputed_share(cfg, shape):
    """The share of layers whose forward runs twice (recompute.py's segments of one model chunk)."""
    if shape.recompute != "full":
        return 0.0
    layers = cfg.num_layers // (shape.pp * shape.virtual)
    segments = recompute_segments(_recompute_config(cfg, shape), layers)
    return sum(stop - first for first, stop, again in segments if again) / layers


def context_parallel_time(cfg, shape, profile, w, again, place):
    """The CP ring's messages in one step, counted as exposed: per layer and micro-batch each rank
    sends CP - 1 key/value blocks forward (again for a recomputed layer) and 2 CP - 1 backward (the
    blocks and their gradients), a block being k and v of the local tokens' key/value groups on
    this TP rank."""
    c = shape.cp
    if c == 1:
        return 0.0
    block = 2 * shape.micro_batch * shape.local_seq * cfg.num_query_groups * cfg.head_dim // shape.tp * w
    messages = (c - 1) * (1 + again) + (2 * c - 1)
    one = p2p_time(block, *group_links(profile, "sendrecv", *place["cp"]))
    return shape.micro_batches * cfg.num_layers // shape.pp * messages * one


def optimizer_time(cfg, shape, profile):
    """AdamW's update on the rank with the most parameters, memory bound (module docstring)."""
    if "device" in profile:
        return device_optimizer_seconds(cfg, shape, profile)
    bandwidth = profile.get("memory_bandwidth_bytes_per_s")
    if "measured" in profile:
        bandwidth = measured_rates(profile, shape)[0]["bandwidth_bytes_per_s"]
    if not bandwidth:
        return 0.0
    per_parameter = 30 if cfg.storage_format or shape.element_bytes == 2 else 28
    round_trips = 0.0
    if "published" in profile:
        per_parameter = profile["published"]["optimizer_bytes_per_parameter"]
        # and the 2019 code's two numbers all-reduced over the model-parallel group before it reads
        # them back: the overflow flag and the squared gradient norm
        scalar = all_reduce_time(shape.tp, 4, *group_links(profile, "all_reduce", *placement(shape, profile)["tp"]))
        round_trips = optimizer_round_trips(cfg, shape, profile["published"]) + 2 * scalar
    params = max(optimizer_parameters(shape, rank_parameters(cfg, shape, r), rank_expert_parameters(cfg, shape, r))
                 for r in range(shape.pp))
    return params * per_parameter / bandwidth + round_trips


def last_bucket_elements(cfg, shape, grad_elements, bucket_elements):
    """Gradients all-reduced only after backward ends. Buckets are cut from the parameters in
    reverse order and launched in that order (data_parallel/buckets.py; PyTorch's DDP, which the
    2019 code used, orders them the same way), so the last ones hold the embedding's tables,
    whose gradients are complete only when backward reaches the lookup, its last op; without
    PP, an untied output layer, first in that order, shares a bucket with the first layer's
    last gradients. Those tables are a lower bound; a model whose tables are smaller than a
    bucket is charged one bucket's worth (at most every gradient)."""
    vocabulary = pad_vocab_size(cfg.vocab_size, shape.tp, cfg.make_vocab_size_divisible_by) // shape.tp
    tables = vocabulary * cfg.hidden_size
    if cfg.position_embedding_type == "learned_absolute":
        tables += cfg.max_position_embeddings * cfg.hidden_size
    if cfg.untie_embeddings_and_output_weights and shape.pp == 1:
        tables += vocabulary * cfg.hidden_size
    return max(min(bucket_elements, grad_elements), tables)


def layer_counts(cfg, shape):
    """(dense layers, MoE layers) of each pipeline rank."""
    counts = []
    for rank in range(shape.pp):
        layers = rank_layers(cfg, shape, rank)
        moe = sum(cfg.is_moe_layer(layer) for layer in layers)
        counts.append((len(layers) - moe, moe))
    return counts


def tensor_parallel_time(cfg, shape, profile, w, again, place):
    """TP communication in one step on the busiest pipeline rank (module docstring): a dense layer's
    two collectives forward (again when recomputed) and two backward; an MoE layer's attention's one
    and one, and its MLP part's (moe_tp_collectives); the embedding's and output layer's."""
    t = shape.tp
    if t == 1:
        return 0.0
    sbh = shape.local_seq * shape.micro_batch * cfg.hidden_size * w
    if shape.sequence_parallel:
        one = (all_gather_time(t, sbh, *group_links(profile, "all_gather", *place["tp"]))
               + reduce_scatter_time(t, sbh, *group_links(profile, "reduce_scatter", *place["tp"])))
    else:
        one = all_reduce_time(t, sbh, *group_links(profile, "all_reduce", *place["tp"]))
    per_layer_count = 2 + 2 * again + 2       # forward's two, the recomputation's two, backward's two
    moe_layer = per_layer_count / 2 * one
    for op, nbytes, forward, backward in moe_tp_collectives(cfg, shape, w):
        timed = all_gather_time if op == "all_gather" else all_reduce_time
        moe_layer += (forward * (1 + again) + backward) * timed(t, nbytes, *group_links(profile, op, *place["tp"]))
    busiest = max(dense * per_layer_count * one + moe * moe_layer for dense, moe in layer_counts(cfg, shape))
    loss = all_reduce_time(t, shape.local_seq * shape.micro_batch * 4,
                           *group_links(profile, "all_reduce", *place["tp"]))
    return shape.micro_batches * (busiest + (2 * one + 3 * loss) / shape.pp)


def moe_tp_collectives(cfg, shape, w):
    """[(collective, bytes, calls forward, calls backward)] of an MoE layer's MLP part in the TP group
    for one micro-batch (moe/layer.py), T tokens of h elements (the whole sequence) and k T routed
    rows, balanced over the experts: under SP the sequence gathered forward and the gradient of the
    rank's block gathered backward; the shared expert's own g and f (two f's for SwiGLU's gate and
    up); experts split over the TP ranks one g of all routed rows and one f of the tokens (their
    biases, where they have them, added after the g); whole experts (ETP 1) none."""
    if shape.tp == 1 or cfg.num_experts is None:
        return []
    tokens = shape.local_seq * shape.micro_batch * cfg.hidden_size * w
    rows = cfg.moe_router_topk * tokens
    firsts = 2 if cfg.swiglu else 1     # SwiGLU's gate and up: two column-parallel linears, two f's
    collectives = [("all_gather", tokens, 1, 1)] if shape.sequence_parallel else []
    if cfg.moe_shared_expert_intermediate_size:
        collectives.append(("all_reduce", tokens, 1, firsts))
    if shape.expert_tp > 1:
        collectives += [("all_reduce", rows, 1, 0), ("all_reduce", tokens, 0, 1)]
    return collectives


def dispatch_bytes(cfg, shape, w):
    """{collective: (calls, bytes in all)} of the dispatcher in one MoE layer for one micro-batch,
    as comm.stats() counts them (each call its input buffer; moe/expert_parallel.py): four
    all_to_all_v of k T rows of h elements (the rows out and home forward, their gradients back),
    each rank receiving as many rows as it sends under balanced routing, and one all_to_all of the
    E int64 counts."""
    rows = cfg.moe_router_topk * shape.local_seq * shape.micro_batch * cfg.hidden_size * w
    return {"all_to_all_v": (4, 4 * rows), "all_to_all": (1, cfg.num_experts * 8)}


def expert_parallel_time(cfg, shape, profile, w, again, place):
    """The dispatcher's all-to-alls in one step on the busiest pipeline rank, exposed: per MoE layer
    and micro-batch dispatch_bytes' calls, the forward's three again for a recomputed layer. Each
    is timed as an all-gather of its per-rank bytes on the all-gather link; a group spanning nodes
    gets no ring's sharing of a node's network (module docstring)."""
    if shape.ep == 1:
        return 0.0
    links = group_links(profile, "all_gather", place["ep"][0], 1)
    sent = dispatch_bytes(cfg, shape, w)
    calls, nbytes = sent["all_to_all_v"]
    rows = all_to_all_time(shape.ep, nbytes / calls, *links)
    counts = all_to_all_time(shape.ep, sent["all_to_all"][1], *links)
    per_layer = (4 + 2 * again) * rows + (1 + again) * counts
    return shape.micro_batches * max(moe for _, moe in layer_counts(cfg, shape)) * per_layer


def data_parallel_time(cfg, shape, profile, w, compute, place):
    """(whole, exposed) seconds of the gradients' all-reduce (module docstring): over DP x CP, or
    under EP the dense gradients over DP x CP and the experts' over their DP x CP / EP ranks."""
    d, links = shape.dp * shape.cp, group_links(profile, "all_reduce", *place["dp"])
    if d == 1:
        return 0.0, 0.0
    held = [(rank_parameters(cfg, shape, r), rank_expert_parameters(cfg, shape, r) if shape.ep > 1 else 0)
            for r in range(shape.pp)]
    dense = max(p - e for p, e in held) * w
    whole = all_reduce_time(d, dense, *links)
    if shape.ep > 1:            # the experts' own all-reduce (none where EP takes all of DP x CP)
        experts = max(e for _, e in held) * w
        whole += all_reduce_time(shape.expert_dp, experts, *group_links(profile, "all_reduce", *place["edp"]))
    if not shape.overlap_grad_reduce:
        return whole, whole
    bucket = last_bucket_elements(cfg, shape, dense // w, shape.bucket_elements) * w
    last_backward = compute * 2 / 3 / shape.micro_batches
    return whole, max(all_reduce_time(d, bucket, *links), whole - profile["dp_overlap"] * last_backward)


def flat_compute(cfg, shape, profile, flops, again):
    """Compute from one FLOP rate (a profile without measured or published rates): the model FLOPs
    shared by the ranks, plus, for whole experts (ETP 1) under TP, the experts' FLOPs every TP
    rank repeats on the same rows."""
    factor = (1 + (RECOMPUTE_COST["full"] - 1) * again) / RECOMPUTE_COST[profile["flops_recompute"]]
    repeated = 0.0
    if cfg.num_experts and shape.expert_tp < shape.tp:
        expert = _mlp_parameters(cfg, cfg.moe_ffn_hidden_size, 1)
        tokens = shape.global_batch * shape.seq * cfg.moe_router_topk
        repeated = 6 * expert * tokens * sum(cfg.moe_layers) * (shape.tp - 1)
    return (flops + repeated) / shape.ranks / rank_flops(profile, shape) * factor


def step_time(cfg, shape, profile):
    """{'compute', 'tp_comm', 'ep_comm', 'pp_comm', 'bubble', 'dp_comm_exposed', 'total', ...} in seconds."""
    check_shape(cfg, shape)
    w = element_bytes(cfg, shape)
    t, p, v, m = shape.tp, shape.pp, shape.virtual, shape.micro_batches
    place = placement(shape, profile)
    # model FLOPs count the active parameters: model_flops leaves out the experts a token skips
    flops = model_flops(cfg, gpt_num_parameters(cfg), shape.global_batch, shape.seq)
    again = recomputed_share(cfg, shape)
    modelled = None                  # the 2019 implementation's published figures, where they time compute
    if "measured" in profile:        # this machine's rates by kind of work (work.py)
        compute, compute_bubble, parts = measured_compute(cfg, shape, profile, again, w)
    elif "published" in profile:     # a GPU's published rates and the counted kernels (published.py)
        compute, compute_bubble, parts = published_compute(cfg, shape, profile, again, w)
        modelled = profile["published"]
    elif "device" in profile:        # a GPU's measured rates and this engine's counted work (device.py)
        compute, compute_bubble, parts = device_compute(cfg, shape, profile, again, w)
    else:
        compute = flat_compute(cfg, shape, profile, flops, again)
        compute_bubble = (p - 1) / (m * v) * compute
        parts = {}

    tp_comm = tensor_parallel_time(cfg, shape, profile, w, again, place)
    ep_comm = expert_parallel_time(cfg, shape, profile, w, again, place)
    pp_comm = 0.0
    if p > 1:
        nbytes = shape.local_seq * shape.micro_batch * cfg.hidden_size * w / (t if shape.sequence_parallel else 1)
        pp_comm = 2 * m * v * p2p_time(nbytes, *group_links(profile, "sendrecv", *place["pp"]))

    cp_comm = context_parallel_time(cfg, shape, profile, w, again, place)
    exchanged = tp_comm + ep_comm + pp_comm + cp_comm
    bubble = compute_bubble + (p - 1) / (m * v) * exchanged
    dp_total, dp_exposed = data_parallel_time(cfg, shape, profile, w, compute, place)
    if modelled:                     # the SMs NCCL's kernel holds while the overlapped part runs
        dp_exposed += overlap_contention_seconds(modelled, dp_total - dp_exposed, parts)
    embedding = 0.0
    if p > 1 and not cfg.untie_embeddings_and_output_weights:     # the tied embedding's two copies
        padded = pad_vocab_size(cfg.vocab_size, t, cfg.make_vocab_size_divisible_by)
        embedding = all_reduce_time(2, padded // t * cfg.hidden_size * w,
                                    *group_links(profile, "all_reduce", place["pp"][0], 1))
    optimizer = optimizer_time(cfg, shape, profile)
    total = compute + exchanged + bubble + dp_exposed + embedding + optimizer
    return {"compute": compute, "tp_comm": tp_comm, "ep_comm": ep_comm, "pp_comm": pp_comm, "cp_comm": cp_comm,
            "bubble": bubble, "optimizer": optimizer,
            "dp_comm": dp_total, "dp_comm_exposed": dp_exposed, "embedding_comm": embedding,
            "total": total, "model_flops": flops, "compute_parts": parts,
            "flops_per_device": flops / total / shape.ranks,
            "samples_per_s": shape.global_batch / total}
