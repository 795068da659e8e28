"""Plans: memory + step time of one shape, every shape of N ranks ranked, and the paper's
weak-scaling configurations (Shoeybi et al. 2019, Table 1) predicted on a profile."""
import math
from dataclasses import replace

from ..autograd import InputError
from ..config import GPTConfig
from ..model import gpt_num_parameters
from .memory import ParallelShape, check_shape, memory_plan
from .device import peak
from .time_model import step_time


def plan(cfg, shape, profile, device_memory=None):
    device_memory = profile["device_memory_bytes"] if device_memory is None else device_memory
    timing = step_time(cfg, shape, profile)
    return {"layout": shape.name(), "tp": shape.tp, "pp": shape.pp, "dp": shape.dp, "cp": shape.cp,
            "ep": shape.ep, "etp": shape.expert_tp, "virtual": shape.virtual, "micro_batches": shape.micro_batches,
            # every parameter, and those a token's forward uses (an MoE layer's k experts of E)
            "parameters": gpt_num_parameters(cfg), "active_parameters": gpt_num_parameters(cfg, active=True),
            "memory": memory_plan(cfg, shape, device_memory), "time": timing,
            "throughput": throughput(timing, shape, peak(profile, cfg))}


def throughput(timing, shape, peak_flops):
    """What a step of this shape yields: tokens a step and a second, and the model-FLOP utilisation
    against `peak_flops` per device (the profile's in the run's precision; None where it gives none)."""
    tokens_per_step = shape.global_batch * shape.seq
    return {"tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / timing["total"],
            "peak_flops": peak_flops, "mfu": None if peak_flops is None else timing["flops_per_device"] / peak_flops}


def training_time(planned, shape, steps=None, tokens=None):
    """The length of a run of `planned` steps (a plan()), `steps` of them or those that reach
    `tokens` (whole steps, rounded up): its steps, tokens, seconds, ranks, and rank-hours."""
    tokens_per_step = planned["throughput"]["tokens_per_step"]
    if steps is None:
        steps = math.ceil(tokens / tokens_per_step)
    seconds = steps * planned["time"]["total"]
    return {"steps": steps, "tokens": steps * tokens_per_step, "seconds": seconds, "ranks": shape.ranks,
            "rank_hours": seconds * shape.ranks / 3600}


def shapes_of(n):
    return [(t, p, n // (t * p)) for t in range(1, n + 1) if n % t == 0
            for p in range(1, n // t + 1) if (n // t) % p == 0]


def expert_choices(cfg, base, ranks):
    """The EP sizes to try over `ranks` DP x CP ranks: base's, or for an MoE model whose EP was
    not given (base.ep 1) every divisor of them that divides the experts."""
    if cfg.num_experts is None or base.ep > 1:
        return [base.ep]
    return [ep for ep in range(1, ranks + 1) if ranks % ep == 0 and cfg.num_experts % ep == 0]


def search(cfg, base, profile, n, device_memory=None):
    """Every TP x PP x DP = n / CP (base.cp) the model can run on, and for an MoE model every EP
    (expert_choices), fastest first (layouts that do not fit the device memory after those that
    do); InputError when none is valid."""
    plans, reasons = [], []
    for t, p, d in shapes_of(n // base.cp):
        for ep in expert_choices(cfg, base, d * base.cp):
            shape = replace(base, tp=t, pp=p, dp=d, ep=ep)
            try:
                check_shape(cfg, shape)
            except InputError as error:
                reasons.append(f"{shape.name()}: {error}")
                continue
            plans.append(plan(cfg, shape, profile, device_memory))
    if not plans:
        raise InputError(f"no layout of {n} ranks is valid for this model (e.g. {reasons[-1]}); "
                         "choose another rank count, batch or model shape")
    plans.sort(key=lambda r: (r["memory"]["fits"] is False, r["time"]["total"]))
    return plans


PAPER_MODELS = [  # hidden, heads, layers, TP (Shoeybi et al. 2019, Table 1)
    (1536, 16, 40, 1), (1920, 20, 54, 2), (2304, 24, 64, 4), (3072, 32, 72, 8)]

#: Measured efficiencies to set beside the predictions, by (TP, DP, gradient all-reduce overlapped):
#: the paper's 77 % at 8-way TP (section 5.1) and 74 % at 512 GPUs, which the 2019 repository's
#: README says was measured with torch's DistributedDataParallel (overlapping the gradient
#: all-reduce with backward) and was 60 % with its own, which all-reduces after backward.
PAPER_EFFICIENCY = {(8, 1, False): 0.77, (8, 64, True): 0.74, (8, 64, False): 0.60}


def paper_weak_scaling(profile):
    """Predicted weak-scaling efficiency: per-GPU model FLOP/s relative to the 1-GPU model, for
    the model-parallel runs (micro-batch 8, seq 1024, vocab 51,200, fp16, every layer
    recomputed, dropout 0.1) and the same x 64-way DP at global batch 512, with the gradients
    all-reduced after backward (the 2019 implementation's own DistributedDataParallel) and
    overlapped with it (torch's, which the README of the time says the 512-GPU run used)."""
    rows, base = [], None
    for dp, global_batch, overlap in ((1, 8, False), (64, 512, False), (64, 512, True)):
        for h, a, layers, t in PAPER_MODELS:
            row = paper_row(profile, h, a, layers, t, dp, global_batch, overlap, base)
            base = base or row["tflops_per_gpu"]
            rows.append(row | {"paper_efficiency": PAPER_EFFICIENCY.get((t, dp, overlap))})
    return rows


#: The appendix's 8.3 B model at 8-way TP with 16, 24 and 32 heads (Shoeybi et al. 2019, Table 7):
#: heads and the weak-scaling efficiency measured against the 1-GPU baseline.
PAPER_HEADS = ((16, 0.82), (24, 0.80), (32, 0.77))


def paper_attention_heads(profile):
    """The appendix's table: the 8.3 B model on 8-way TP with 16, 24 and 32 heads, each predicted
    against the predicted 1-GPU baseline, beside the efficiency the paper measured."""
    base = paper_row(profile, *PAPER_MODELS[0], 1, 8, False, None)["tflops_per_gpu"]
    h, _, layers, t = PAPER_MODELS[-1]
    return [paper_row(profile, h, heads, layers, t, 1, 8, False, base) | {"paper_efficiency": measured}
            for heads, measured in PAPER_HEADS]


def paper_row(profile, h, a, layers, t, dp, global_batch, overlap, base):
    """One of the paper's runs predicted on the profile, its efficiency against `base` TFLOP/s per
    GPU (itself where None)."""
    cfg = GPTConfig(num_layers=layers, hidden_size=h, num_attention_heads=a, vocab_size=51200,
                    max_position_embeddings=1024, hidden_dropout=0.1, attention_dropout=0.1, fp16=True)
    shape = ParallelShape(tp=t, pp=1, dp=dp, micro_batch=8, global_batch=global_batch, seq=1024,
                          recompute="full", element_bytes=2, overlap_grad_reduce=overlap)
    timing = step_time(cfg, shape, profile)
    memory = memory_plan(cfg, shape, profile["device_memory_bytes"])
    tflops = timing["flops_per_device"] / 1e12
    return {"hidden": h, "heads": a, "layers": layers, "tp": t, "dp": dp, "gpus": t * dp,
            "overlap_grad_reduce": overlap, "parameters": cfg_params(cfg), "step_s": timing["total"],
            "tflops_per_gpu": tflops, "mfu": throughput(timing, shape, peak(profile, cfg))["mfu"],
            "efficiency": tflops / (base or tflops),
            "mixed_precision_memory_gb": memory["ranks"][0]["mixed_precision_total"] / 1e9, "time": timing}


def cfg_params(cfg):
    return gpt_num_parameters(cfg)
