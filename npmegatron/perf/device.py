"""A GPU rank's step for this engine from a device profile (its "device" section: the rates
`npmegatron plan calibrate --device gpu` measures on the card it runs on; shipped: h200) and the work
this engine asks of a GPU, counted on the strict CuPy stand-in (WORK):

- the Linears' and the output layer's GEMMs (work.layer_gemms; forward, and backward the input's
  and the weight's gradient) at the FLOP/s the profile measured in the run's precision (fp32, tf32,
  bf16, fp16), interpolated by shape (published.interpolated_rate, shapes as cuBLAS sees them);
- attention's core: cuDNN's fused kernels where the engine runs them (16-bit arrays, no attention
  dropout, a head size that is a multiple of 8 up to 128: autograd/ops/fused_attention.py) as the
  causal half of its products' FLOPs, forward twice a GEMM's and backward 2.5 times the forward's
  (the score and context products again, their four gradients), at the GEMM rate; otherwise the
  blockwise kernels: 7 batched GEMMs a layer (forward QK and PV; backward QK again and the four
  gradients) over the blocks of scores they compute, and SCORE_PASSES float32 passes over them;
- every other kernel as the bytes it reads and writes (WORK: a layer's passes over its tokens'
  hidden vectors, the loss's over the logits, the optimizer's per parameter) over the bandwidth a
  copy reached on arrays of that size (`bandwidth`); under TP a layer's passes are all counted on
  the whole hidden size, as its norms and residual adds run (its MLP activation's share runs on
  1/TP of the columns: a TP rank's bytes are overstated by up to a third, in float32);
- every launch: in a replayed CUDA graph (--cuda-graph) the gap between a graph's kernels
  (launch_gap_s); run eagerly, the step takes at least what the host needs to issue it, where the
  profile measured the engine's host seconds a layer and a micro-batch (host_s_per_layer,
  host_s_per_micro_batch; without them the eager step is its device time, a floor).
Dense layers only (an MoE model is refused); CP's ring is timed as attention over local blocks.
"""
from ..autograd import InputError
from ..autograd.ops.attention import BLOCK_SIZE, GPU_BLOCK_SCORE_BYTES, query_blocks
from ..autograd.ops.fused_attention import MAX_HEAD_DIM
from ..tensor_parallel import pad_vocab_size
from .memory import rank_layers, rank_parameters
from .published import interpolated_rate
from .work import busiest_stage, forward_backward, layer_gemms, log_interpolate, pipeline_stages

#: This engine's GPU work outside the GEMMs and attention's core, counted on the strict CuPy stand-in
#: at GPT-2 124M's shapes, micro-batch 1 (`python scripts/count_gpu_work.py [--bf16]`, 2026-11-29):
#:   passes: a layer's bytes read and written per token and hidden element of e bytes (34,725,888
#:     under --bf16 = 22 x 1024 x 768 x 2 + 120 x 1024; 185,720,832 in float32 = 59 x 1024 x 768 x 4 +
#:     120 x 1024: LayerNorm's float32 statistics and its column sums' partial rows);
#:   end_passes: the same outside the layers but the loss (the embedding's rows, the position table's
#:     add, the final LayerNorm), 17 and 23; table_passes: float32 passes over the tied table's
#:     gradient (under --bf16 its zeros, the lookup's scatter and the head's gradient added: 4; in
#:     float32 the head's GEMM writes it in place: 0);
#:   launches: a layer's kernels, attention's core included (16-bit: fused attention's 26; float32:
#:     the blockwise kernels' 63; a 16-bit run with attention dropout, blockwise, is not told apart), and those
#:     outside the layers and of the optimizer step (25 + 7, 24 + 6);
#:   optimizer_bytes: the optimizer step's bytes per parameter (AdamW over float32 masters and
#:     moments, the gradient norm and clip; under --bf16 the 16-bit copy written: 39, float32 33).
#: The loss passes over the logits three times (LOSS_PASSES: read forward, read and write backward).
WORK = {"16-bit": {"passes": 22, "token_bytes": 120, "end_passes": 17, "table_passes": 4, "launches": 26,
                   "end_launches": 32, "optimizer_bytes": 39},
        "float32": {"passes": 59, "token_bytes": 120, "end_passes": 23, "table_passes": 0, "launches": 63,
                    "end_launches": 30, "optimizer_bytes": 33}}
LOSS_PASSES = 3
#: The blockwise kernels' float32 passes over each computed score besides their GEMMs' (the stand-in:
#: 1,354,563,584 bytes a layer at micro-batch 1, less its 7 GEMMs' 396,361,728, over 12 x 1024^2 scores).
SCORE_PASSES = 19


def precision(cfg):
    """The run's GEMM precision on a GPU, as the profile's rates are keyed."""
    if cfg.dtype == "float64":
        return "fp64"
    return cfg.storage_format or ("tf32" if cfg.tf32 else "fp32")


def fused_attention(cfg):
    """Whether the engine runs cuDNN's fused attention for this model on a GPU."""
    return (cfg.storage_format is not None and cfg.attention_dropout == 0 and cfg.head_dim % 8 == 0
            and cfg.head_dim <= MAX_HEAD_DIM)


def gemm_seconds(device, cfg, m, k, n, batch=1):
    """Seconds of `batch` row-major (m x k) @ (k x n) products at the profile's rate for the run's
    precision (cuBLAS's column-major M = n, N = m, K = k)."""
    return 2.0 * batch * m * k * n / interpolated_rate(device["gemm"][precision(cfg)], n, batch * m, k)


def copy_seconds(device, nbytes, array_bytes):
    """Seconds to read and write `nbytes` in kernels over arrays of `array_bytes` each."""
    table = device["bandwidth"]
    return nbytes / log_interpolate([table["bytes"]], table["bytes_per_s"], (array_bytes,))


def score_blocks(seq, batch_heads):
    """(query rows, keys seen) of each block of the GPU's blockwise kernel (attention.block_rows):
    as many multiples of BLOCK_SIZE rows as GPU_BLOCK_SCORE_BYTES of float32 scores over all the
    micro-batch's heads allow, split evenly, each block seeing the keys up to its last row."""
    fit = max(1, GPU_BLOCK_SCORE_BYTES // (batch_heads * seq * 4 * BLOCK_SIZE))
    blocks = -(-seq // (fit * BLOCK_SIZE))
    rows = BLOCK_SIZE * -(-seq // (blocks * BLOCK_SIZE))
    return [(stop - first, seen) for first, stop, seen in query_blocks(seq, seq, rows)]


def attention_seconds(device, cfg, shape):
    """(forward, backward) seconds of one layer's attention core on a rank for one micro-batch."""
    heads, seq, d = cfg.num_attention_heads // shape.tp, shape.local_seq, cfg.head_dim
    batch = shape.micro_batch * heads
    if fused_attention(cfg):
        # QK and PV: two products of (seq x d x seq)'s FLOPs, of which causal masking skips half
        forward = gemm_seconds(device, cfg, seq, d, seq, batch)
        return forward, 2.5 * forward
    blocks = score_blocks(seq, batch)
    seconds, scores = [0.0, 0.0], 0
    for rows, seen in blocks:
        qk, pv = gemm_seconds(device, cfg, rows, d, seen, batch), gemm_seconds(device, cfg, rows, seen, d, batch)
        seconds[0] += qk + pv
        seconds[1] += 2 * qk + 3 * pv        # QK again and dP like it; dV, dQ and dK like PV
        scores += batch * rows * seen
    passes = copy_seconds(device, SCORE_PASSES * 4 * scores, 4 * scores // len(blocks))
    return seconds[0] + passes / 2, seconds[1] + passes / 2


def layer_seconds(device, cfg, shape, work, w, again):
    """{part: seconds} of one dense layer on a rank for one micro-batch, the recomputed share's
    forward twice (its memory-bound bytes and launches counted half forward, half backward)."""
    tokens = shape.micro_batch * shape.local_seq
    gemm = forward_backward(lambda m, k, n: gemm_seconds(device, cfg, m, k, n), layer_gemms(cfg, shape))
    attention = attention_seconds(device, cfg, shape)
    hidden_bytes = tokens * cfg.hidden_size * w
    memory = copy_seconds(device, work["passes"] * hidden_bytes + work["token_bytes"] * tokens, hidden_bytes)
    launches = work["launches"] * device["launch_gap_s"]
    return {"gemm": gemm[0] + gemm[1] + again * gemm[0],
            "attention": attention[0] + attention[1] + again * attention[0],
            "memory_bound": memory * (1 + again / 2), "launches": launches * (1 + again / 2)}


def end_seconds(device, cfg, shape, work, w):
    """{part: seconds} of one micro-batch outside the layers: all of it on the last stage (the output
    layer, the loss and the tied table's gradient, which outweigh the first stage's embedding and
    are counted with it: WORK's end_passes, end_launches), none on the first."""
    tokens = shape.micro_batch * shape.local_seq
    vocab = pad_vocab_size(cfg.vocab_size, shape.tp, cfg.make_vocab_size_divisible_by) // shape.tp
    hidden, logits, table = tokens * cfg.hidden_size * w, tokens * vocab * w, vocab * cfg.hidden_size * 4
    gemm = forward_backward(lambda m, k, n: gemm_seconds(device, cfg, m, k, n), [(tokens, cfg.hidden_size, vocab)])
    last = (copy_seconds(device, work["end_passes"] * hidden, hidden)
            + copy_seconds(device, LOSS_PASSES * logits, logits)
            + copy_seconds(device, work["table_passes"] * table, table))
    launches = work["end_launches"] * device["launch_gap_s"]
    return {"launches": 0.0}, {"gemm": sum(gemm), "memory_bound": last, "launches": launches}


def device_compute(cfg, shape, profile, again, w):
    """(compute, bubble, compute by part) seconds of a step (work.busiest_stage); run eagerly, at
    least the host's issue time where the profile measured it."""
    device = profile["device"]
    if precision(cfg) not in device["gemm"]:
        raise InputError(f"profile {profile['name']!r} has GEMM rates for {', '.join(sorted(device['gemm']))}, not "
                         f"this run's {precision(cfg)}; plan it in one of those (--tf32, --bf16, --fp16) or add "
                         f"device.gemm.{precision(cfg)} (`npmegatron plan calibrate --device gpu` measures them)")
    if cfg.num_experts:
        raise InputError(f"profile {profile['name']!r} times this engine's dense layers only, and this model has "
                         f"{cfg.num_experts} experts; plan it with a CPU profile or the dgx2h profile")
    work = WORK["16-bit" if cfg.storage_format else "float32"]
    layer = layer_seconds(device, cfg, shape, work, w, again)
    stages = [parts for parts, _ in pipeline_stages(cfg, shape, layer, *end_seconds(device, cfg, shape, work, w))]
    compute, bubble, parts = busiest_stage(stages, shape)
    host = host_seconds(device, cfg, shape, again)
    if not shape.cuda_graph and host > compute:
        parts["host_issue"] = host - compute       # the device waiting for the host to issue kernels
        compute = host
    return compute, bubble, parts


def host_seconds(device, cfg, shape, again):
    """Seconds the host takes to issue a step eagerly on the rank with the most layers: the measured
    seconds a layer (the recomputed share's forward again, half a layer's) and a micro-batch (which
    holds the tiny model's optimizer step too); 0 where the profile has no host figures."""
    per_layer, per_micro_batch = (_of_precision(device.get(key, 0.0), cfg)
                                  for key in ("host_s_per_layer", "host_s_per_micro_batch"))
    layers = max(len(rank_layers(cfg, shape, rank)) for rank in range(shape.pp))
    return shape.micro_batches * (layers * per_layer * (1 + again / 2) + per_micro_batch)


def _of_precision(value, cfg):
    """A figure given once or by precision ({"fp32": ..., "bf16": ...}; 0 for a precision not given)."""
    return value.get(precision(cfg), 0.0) if isinstance(value, dict) else value


def optimizer_seconds(cfg, shape, profile):
    """The optimizer step on the rank with the most parameters: WORK's bytes a parameter at the
    bandwidth of arrays that size (its launches are counted with the last stage's, end_seconds)."""
    device, work = profile["device"], WORK["16-bit" if cfg.storage_format else "float32"]
    params = max(rank_parameters(cfg, shape, rank) for rank in range(shape.pp))
    return copy_seconds(device, work["optimizer_bytes"] * params, 4 * params)


def peak(profile, cfg):
    """The device's dense peak FLOP/s in the run's precision (peak_flops given once or by precision;
    None where the profile gives none)."""
    return _of_precision(profile.get("peak_flops"), cfg) or None
