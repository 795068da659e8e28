"""Step time from an alpha-beta + roofline model.

Ring costs, for n ranks and a buffer of S bytes (alpha per ring step, beta per byte one device
sends, base a collective call's own latency, 0 unless the profile gives one: NCCL's model has
one):  all-reduce base + 2(n-1) alpha + 2(n-1)/n S beta;  all-gather / reduce-scatter (S the
full buffer) base + (n-1) alpha + (n-1)/n S beta;  point-to-point base + alpha + S beta.

A step on one rank, M micro-batches, V virtual stages, L layers on the rank:
- compute, for a profile with this machine's measured rates ("measured", from `plan calibrate`):
  the busiest stage's GEMMs, attention, memory-bound bytes and engine overhead (work.py); for a
  GPU profile with published rates ("published", as dgx2h has): the same parts from a published
  GEMM benchmark, the device's bandwidth and the modelled implementation's kernels (published.py);
  otherwise model_flops(global batch) / (TP PP DP) / one rank's FLOP/s (the profile's, or on a
  CPU profile its share of the machine: rank_flops), times 4/3 for full
  recomputation (one more forward) unless the profile's rate was measured with it;
- TP comm (TP > 1): per layer and micro-batch 4 all-reduces of s*b*h elements (2 forward,
  2 backward; 6 with full recomputation), or with SP as many all-gathers plus reduce-scatters;
  plus the embedding's and the output layer's all-reduce, 2 per micro-batch spread over the PP
  ranks;
- CP comm (CP > 1): the ring's key/value blocks (context_parallel_time), exposed; every other
  term counts a rank's seq / CP tokens, and gradients are averaged over DP x CP;
- PP comm (PP > 1): per micro-batch and virtual stage one activation sent forward and one
  gradient back, s*b*h elements (/TP with SP: the sequence shard), counted as exposed;
- bubble = (PP-1)/(M V) x (compute + TP comm + PP comm); with measured rates the compute's part
  is each other stage's micro-batch once (work.measured_compute), which is the same for equal
  stages and less where the busiest stage is the last's output layer;
- DP comm exposed = max(all-reduce of the last bucket, all-reduce of this rank's gradients -
  dp_overlap x the last micro-batch's backward (2/3 of its compute)): gradients are reduced once
  per step, overlapped with the backward of the last micro-batch, and the last bucket starts only
  when that backward ends (last_bucket_elements: at least the embedding's tables); the
  whole all-reduce without overlap_grad_reduce (Megatron's --no-overlap-grad-reduce, and what
  the 2019 implementation did); plus, with PP > 1, the tied embedding's all-reduce between the
  first and last stage, exposed;
- optimizer = the bytes AdamW reads and writes per parameter this rank updates / the profile's
  memory_bandwidth_bytes_per_s (memory bound; 0 for a profile without one): float32 reads the
  parameter, gradient and two moments and writes three (28 B); under --fp16/--bf16 the float32
  master, gradient and moments and the 16-bit parameter written back (30 B); a "published"
  profile gives its implementation's own count.

Which link parameters a group uses: ranks are ordered TP fastest, then CP, then DP, then PP
(comm/grid.py), filling nodes of `devices_per_node`. A group within one node uses "intra". A
group spanning nodes uses "inter", whose beta is one device's share of the node's network; k
members of a ring on one node cross the node boundary once between them, so their ring runs at
k shares: beta / k.
"""
from ..model import gpt_num_parameters, model_flops
from ..recompute import recompute_segments
from ..tensor_parallel import pad_vocab_size
from .memory import _recompute_config, check_shape, element_bytes, rank_parameters
from .published import published_compute
from .work import measured_compute, measured_rates, nearest_count

RECOMPUTE_COST = {"none": 1.0, "selective": 1.0, "full": 4.0 / 3.0}


def all_reduce_time(n, nbytes, alpha, beta, base=0.0):
    return 0.0 if n <= 1 else base + 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


def all_gather_time(n, nbytes, alpha, beta, base=0.0):
    return 0.0 if n <= 1 else base + (n - 1) * alpha + (n - 1) / n * nbytes * beta


reduce_scatter_time = all_gather_time


def p2p_time(nbytes, alpha, beta, base=0.0):
    return base + alpha + nbytes * beta


def group_links(profile, op, span, members_per_node):
    """(alpha, beta, base) of a group whose ranks cover `span` consecutive rank positions."""
    if span <= profile["devices_per_node"]:
        link = profile["intra"][op]
        return link["alpha_s"], link["beta_s_per_byte"], link["base_s"]
    link = profile["inter"][op]
    return link["alpha_s"], link["beta_s_per_byte"] / max(1, members_per_node), link["base_s"]


def placement(shape, profile):
    """Span and members per node of the TP group, the CP ring, the DP x CP group and pipeline
    neighbours (ranks ordered TP, CP, DP, PP)."""
    dpn, t, c, d, p = profile["devices_per_node"], shape.tp, shape.cp, shape.dp, shape.pp

    def strided(count, stride):
        """`count` members `stride` ranks apart."""
        return stride * (count - 1) + 1, 1 if stride >= dpn else max(1, min(count, dpn // stride))

    return {"tp": (t, min(t, dpn)), "cp": strided(c, t), "dp": strided(d * c, t),
            "pp": (t * c * d * p if p > 1 else 1, 1)}


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
    bandwidth = profile.get("memory_bandwidth_bytes_per_s")
    if "measured" in profile:
        bandwidth = measured_rates(profile, shape)[0]["bandwidth_bytes_per_s"]
    if not bandwidth:
        return 0.0
    per_parameter = 30 if cfg.storage_format or shape.element_bytes == 2 else 28
    if "published" in profile:
        per_parameter = profile["published"]["optimizer_bytes_per_parameter"]
    params = max(rank_parameters(cfg, shape, r) for r in range(shape.pp))
    shard = shape.dp * shape.cp if shape.distributed_optimizer else 1
    return params / shard * per_parameter / bandwidth


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


def step_time(cfg, shape, profile):
    """{'compute', 'tp_comm', 'pp_comm', 'bubble', 'dp_comm_exposed', 'total', ...} in seconds."""
    check_shape(cfg, shape)
    w = element_bytes(cfg, shape)
    t, p, d, v, m = shape.tp, shape.pp, shape.dp, shape.virtual, shape.micro_batches
    s, b, h = shape.local_seq, shape.micro_batch, cfg.hidden_size
    place = placement(shape, profile)
    flops = model_flops(cfg, gpt_num_parameters(cfg), shape.global_batch, shape.seq)
    again = recomputed_share(cfg, shape)
    if "measured" in profile:        # this machine's rates by kind of work (work.py)
        compute, compute_bubble, parts = measured_compute(cfg, shape, profile, again, w)
    elif "published" in profile:     # a GPU's published rates and the counted kernels (published.py)
        compute, compute_bubble, parts = published_compute(cfg, shape, profile, again, w)
    else:
        factor = (1 + (RECOMPUTE_COST["full"] - 1) * again) / RECOMPUTE_COST[profile["flops_recompute"]]
        compute = flops / shape.ranks / rank_flops(profile, shape) * factor
        compute_bubble = (p - 1) / (m * v) * compute
        parts = {}

    sbh = s * b * h * w
    tp_comm = 0.0
    if t > 1:
        per_layer_count = 2 + 2 * again + 2       # forward's two, the recomputation's two, backward's two
        if shape.sequence_parallel:
            ag = all_gather_time(t, sbh, *group_links(profile, "all_gather", *place["tp"]))
            rs = reduce_scatter_time(t, sbh, *group_links(profile, "reduce_scatter", *place["tp"]))
            one = ag + rs
        else:
            one = all_reduce_time(t, sbh, *group_links(profile, "all_reduce", *place["tp"]))
        tp_comm = m * (cfg.num_layers // p * per_layer_count + 2 / p) * one

    pp_comm = 0.0
    if p > 1:
        nbytes = sbh / (t if shape.sequence_parallel else 1)
        pp_comm = 2 * m * v * p2p_time(nbytes, *group_links(profile, "sendrecv", *place["pp"]))

    cp_comm = context_parallel_time(cfg, shape, profile, w, again, place)
    ideal = compute + tp_comm + pp_comm + cp_comm
    bubble = compute_bubble + (p - 1) / (m * v) * (tp_comm + pp_comm + cp_comm)

    grad_bytes = max(rank_parameters(cfg, shape, r) for r in range(p)) * w
    dp_total = dp_exposed = 0.0
    if d * shape.cp > 1:             # gradients are averaged over DP and CP together
        links = group_links(profile, "all_reduce", *place["dp"])
        dp_total = all_reduce_time(d * shape.cp, grad_bytes, *links)
        bucket = last_bucket_elements(cfg, shape, grad_bytes // w, shape.bucket_elements) * w
        last_backward = compute * 2 / 3 / m
        dp_exposed = max(all_reduce_time(d * shape.cp, bucket, *links),
                         dp_total - profile["dp_overlap"] * last_backward)
        if not shape.overlap_grad_reduce:
            dp_exposed = dp_total
    embedding = 0.0
    if p > 1 and not cfg.untie_embeddings_and_output_weights:     # the tied embedding's two copies
        padded = pad_vocab_size(cfg.vocab_size, t, cfg.make_vocab_size_divisible_by)
        embedding = all_reduce_time(2, padded // t * h * w,
                                    *group_links(profile, "all_reduce", place["pp"][0], 1))
    optimizer = optimizer_time(cfg, shape, profile)
    total = ideal + bubble + dp_exposed + embedding + optimizer
    return {"compute": compute, "tp_comm": tp_comm, "pp_comm": pp_comm, "cp_comm": cp_comm, "bubble": bubble,
            "optimizer": optimizer,
            "dp_comm": dp_total, "dp_comm_exposed": dp_exposed, "embedding_comm": embedding,
            "total": total, "model_flops": flops, "compute_parts": parts,
            "flops_per_device": flops / total / shape.ranks,
            "samples_per_s": shape.global_batch / total}
