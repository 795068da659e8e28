"""`npmegatron bench step`: time forward + backward + an optimizer step, and in the same run the
machine's matmul FLOP/s at the model's own GEMM shapes, so the ratio holds on a noisy machine."""
import contextlib
import importlib.util
import json
import statistics
import time

import numpy

from ..autograd import cpu_blas, gemm, precision
from ..autograd.backend import array_module_for, to_numpy
from ..autograd.ops.fused_attention import attention_path
from ..autograd.profile import op_profile
from ..autograd.threads import set_cpu_threads
from ..config import TrainConfig
from ..model import GPTConfig, model_flops
from ..run import assemble
from ..training.cuda_graph import GraphedStep
from ..training.metrics import device_pool_bytes, peak_resident_bytes
from ..training.step import setup_objects_frozen, train_step
from ..perf.peaks import device_name, peak_flops, precision_of


def _synchronize(xp):
    if xp is not numpy:
        xp.cuda.Device().synchronize()


def model_gemms(cfg, batch, seq):
    """(count, m, k, n, kind) of every forward GEMM in one step, kind being the profile's kind of
    op that runs it (OP_KINDS): the Linears' "matmul", attention's batched products "attention";
    backward repeats each shape twice (input gradient and weight gradient), measured separately
    below."""
    tokens, h, heads, d = batch * seq, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    per_layer = [(1, tokens, h, 3 * h, "matmul"), (1, tokens, h, h, "matmul"),
                 (1, tokens, h, cfg.ffn_hidden_size, "matmul"), (1, tokens, cfg.ffn_hidden_size, h, "matmul"),
                 (batch * heads, seq, d, seq, "attention"), (batch * heads, seq, seq, d, "attention")]
    return ([(c * cfg.num_layers, m, k, n, kind) for c, m, k, n, kind in per_layer]
            + [(1, tokens, h, cfg.vocab_size, "matmul")])


class GemmCeiling:
    """The model's GEMMs run alone, at its own shapes: each forward shape (m, k, n) with its
    backward shapes (m, n, k) and (k, m, n). A `round()` times every shape `repeats` times, keeps
    its best and counts it as many times as a step runs it: the GEMMs of one step at their best
    speed. bench step runs a round after each timed step, and the ratio pairs each step with the
    round right after it, so that on a machine whose speed drifts by +-15 % from one second to
    the next (this project's) a step is held against the ceiling of the same moment. Operands
    are made per shape in each round (untimed), so a GPU holds one shape's beside the model. The
    GEMMs are the model's: gemm.matmul in its dtype, or in the 16-bit type where the run holds
    16-bit arrays (--bf16/--fp16 on a GPU: 16-bit tensor cores), TF32 under --tf32. `by_kind`
    holds the last round's seconds split by the kind of op that runs each GEMM in the step, which
    --profile prints beside that kind's time in the step."""

    def __init__(self, cfg, batch, seq, repeats=3):
        self.xp, self.repeats = array_module_for(cfg.device), repeats
        sixteen_bit = precision.holds_16_bit_arrays(self.xp, cfg.storage_format)
        self.dtype = precision.sixteen_bit_dtype(cfg.storage_format) if sixteen_bit else numpy.dtype(cfg.dtype)
        self.gemms, self.flops, self.by_kind = [], 0.0, {}
        for count, m, k, n, kind in model_gemms(cfg, batch, seq):
            bmm = count if count > cfg.num_layers else 1     # attention GEMMs are batched
            for shape in ((m, k, n), (m, n, k), (k, m, n)):
                self.gemms.append((bmm, shape, count // bmm, kind))
                self.flops += count * 2.0 * shape[0] * shape[1] * shape[2]
        self.round()                                         # warm: BLAS threads, first-touch pages

    def round(self):
        """Seconds the GEMMs of one step take alone, each shape at its best of `repeats`."""
        self.by_kind = {}
        for bmm, (m, k, n), calls, kind in self.gemms:
            lead = (bmm,) if bmm > 1 else ()
            a, b = self.xp.full(lead + (m, k), 0.5, self.dtype), self.xp.full(lead + (k, n), 0.25, self.dtype)
            best = float("inf")
            for _ in range(self.repeats):
                _synchronize(self.xp)
                start = time.perf_counter()
                gemm.matmul(a, b)
                _synchronize(self.xp)
                best = min(best, time.perf_counter() - start)
            self.by_kind[kind] = self.by_kind.get(kind, 0.0) + calls * best
        return sum(self.by_kind.values())


# Functions by kind, for --profile; anything else is "other ops" (embeddings, reshapes, the
# tensor-parallel mappings).
OP_KINDS = {"matmul": ("MatMul", "Linear", "GeluMLP"),      # GeluMLP: two GEMMs, GeLU in their epilogues
            "attention": ("Softmax", "CausalAttention", "PackedCausalAttention"),
            "layernorm": ("LayerNorm",),
            "loss": ("CrossEntropy", "_VocabParallelCrossEntropy"),
            "elementwise": ("Add", "Sub", "Mul", "Div", "Neg", "Pow", "Exp", "Log", "Tanh", "GeluTanh",
                            "GeluErf", "BiasGelu", "Dropout", "DropoutAdd", "Sum", "Mean", "Max")}


def op_kinds(table):
    """Seconds per kind of op from an op_profile table (forward + backward)."""
    kind_of = {name: kind for kind, names in OP_KINDS.items() for name in names}
    seconds = {kind: 0.0 for kind in list(OP_KINDS) + ["other ops"]}
    for name, (forward, backward, _) in table.items():
        seconds[kind_of.get(name, "other ops")] += forward + backward
    return seconds


def _timed_steps(run, batch, warmup, iters, profile, ceiling, graphed=None):
    """(step seconds, GEMM round seconds, optimizer seconds, op table, each round's seconds by
    kind of op) of the timed steps, a round of the ceiling's GEMMs timed right after each. With `graphed` (--cuda-graph) each step
    is its run(): the batch copied in, the scalars written, the graph launched, the loss read;
    the capture is one more untimed step."""
    xp = run.model.xp
    times, rounds, optimizer_s, table, round_kinds = [], [], 0.0, {}, []
    warmup += graphed is not None
    for i in range(warmup + iters):
        timed = i >= warmup
        _synchronize(xp)
        start = time.perf_counter()
        if graphed is not None:
            graphed.run([tuple(map(to_numpy, batch))], LR, i)
            before_update = time.perf_counter()
        else:
            with op_profile() if profile and timed else contextlib.nullcontext() as ops:
                train_step(run.model, run.exchange, [batch], run.buckets, run.schedule)
            before_update = time.perf_counter()
            run.optimizer.step()
        _synchronize(xp)
        if timed:
            times.append(time.perf_counter() - start)
            optimizer_s += time.perf_counter() - before_update
            rounds.append(ceiling.round())
            round_kinds.append(dict(ceiling.by_kind))
            for name, entry in ((ops or {}) if graphed is None else {}).items():
                total = table.setdefault(name, [0.0, 0.0, 0])
                for k in range(3):
                    total[k] += entry[k]
    return times, rounds, optimizer_s, table, round_kinds


#: bench step's learning rate (a constant: the step's cost does not depend on it)
LR = 1e-4


def bench_step(cfg: GPTConfig, batch, seq, warmup=2, iters=5, threads=None, profile=False, torch=True,
               cuda_graph=False):
    """threads: BLAS threads for this run (threadpoolctl; default: the library's own), which are
    also the CPU engine's (autograd/threads.py); profile: also report seconds per step by kind
    of op, the optimizer, and the autograd's own overhead (the step minus both); torch: on a GPU,
    also time the same model in PyTorch (eager and torch.compile) when torch imports; cuda_graph:
    the step captured in a CUDA graph and replayed (training/cuda_graph.py)."""
    previous = set_cpu_threads(threads)
    try:
        result = _bench_step(cfg, batch, seq, warmup, iters, threads, profile, cuda_graph)
    finally:
        set_cpu_threads(previous)
    if torch and cfg.device == "gpu" and importlib.util.find_spec("torch") is not None:
        result["torch"] = torch_peers(cfg, batch, seq, warmup, iters, result)
    return result


def torch_peers(cfg, batch, seq, warmup, iters, ours):
    """The same model's step in PyTorch eager and torch.compile on the same GPU (torch_peer.py),
    with our step time divided by theirs."""
    from . import torch_peer         # torch is optional: imported only where it is installed
    array_module_for(cfg.device).get_default_memory_pool().free_all_blocks()
    precision = {"fp64": "fp32"}.get(precision_of(cfg), precision_of(cfg))
    peers = {}
    for name, compiled in (("eager", False), ("compile", True)):
        try:
            peer = torch_peer.torch_step(cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, seq, batch,
                                         cfg.vocab_size, "cuda", precision, compiled, None, warmup, iters)
        except Exception as error:  # torch.compile needs a compiler toolchain some machines lack
            peers[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            continue
        peer["ours_over_theirs"] = ours["step_s"] / peer["step_s"]
        peers[name] = peer
    return peers


def peak_bytes(xp, graphed=None):
    """Peak memory: on a GPU the memory pools' bytes, on the CPU the process's peak resident set."""
    return peak_resident_bytes() if xp is numpy else device_pool_bytes(xp, graphed)


def assembled_run(cfg, batch, seq, cuda_graph=False, warmup=2):
    """(run, its TrainConfig, (inputs, targets) on the model's device): bench step's model as the
    Trainer's step runs it on the serial layout, one process and one micro-batch of random ids."""
    config = TrainConfig(model=cfg, seq_length=seq, micro_batch_size=batch, lr=LR, min_lr=0.0,
                         cuda_graph=cuda_graph, cuda_graph_warmup_steps=max(1, warmup))
    run = assemble(config, world_size=1)
    xp = run.model.xp
    ids = numpy.random.default_rng(cfg.seed).integers(0, cfg.vocab_size, (batch, seq + 1))
    return run, config, (xp.asarray(ids[:, :-1]), xp.asarray(ids[:, 1:]))


def _bench_step(cfg, batch, seq, warmup, iters, threads, profile, cuda_graph):
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=threads) if threads else contextlib.nullcontext():
        run, config, inputs = assembled_run(cfg, batch, seq, cuda_graph, warmup)
        model, xp = run.model, run.model.xp
        graphed = GraphedStep(run, config) if cuda_graph else None
        ceiling = GemmCeiling(cfg, batch, seq)
        with setup_objects_frozen():
            times, rounds, optimizer_s, table, round_kinds = _timed_steps(run, inputs, warmup, iters,
                                                                          profile and not cuda_graph, ceiling,
                                                                          graphed)
    step_s = statistics.median(times)
    flops = model_flops(cfg, model.num_parameters(), batch, seq)
    name, precision = device_name(xp), precision_of(cfg)
    peak = peak_flops(name, precision) if xp is not numpy else None
    # Each step against the GEMMs timed right after it: (flops / step) / (GEMM flops / round).
    ratios = [flops / step / (ceiling.flops / gemm_s) for step, gemm_s in zip(times, rounds)]
    result = {
        "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads, "seq_length": seq, "micro_batch_size": batch,
        "vocab_size": cfg.vocab_size, "dtype": cfg.dtype, "device": cfg.device,
        "tf32": cfg.tf32, "storage": cfg.storage_format, "threads": threads,
        "parameters": model.num_parameters(), "step_s": step_s,
        "model_flops_per_step": flops, "model_flops_per_s": flops / step_s,
        "gemm_flops_per_s": ceiling.flops / statistics.median(rounds), "ratio": statistics.median(ratios),
        "steps_s": times, "gemm_rounds_s": rounds, "ratios": ratios,
        "device_name": name, "precision": precision, "tokens_per_s": batch * seq / step_s,
        "peak_flops_per_s": peak, "mfu": None if peak is None else flops / step_s / peak,
        "peak_bytes": peak_bytes(xp, graphed), "attention": _attention(cfg, xp), "cuda_graph": cuda_graph,
        "blas": cpu_blas.name() if xp is numpy else "cuBLAS",
    }
    if profile:
        kinds = {kind: seconds / iters for kind, seconds in op_kinds(table).items()}
        kinds["optimizer"] = optimizer_s / iters
        kinds["autograd and Python overhead"] = statistics.fmean(times) - sum(kinds.values())
        result["profile_s"] = kinds
        # what the same kinds' GEMMs take alone in the ceiling's rounds: how far each kind of op
        # in the step is from its GEMMs at their best
        result["profile_gemms_alone_s"] = {kind: statistics.fmean(r[kind] for r in round_kinds)
                                           for kind in round_kinds[0]}
    return result


def _attention(cfg, xp):
    """Which causal attention the steps ran, as the training header says it."""
    sixteen_bit = cfg.storage_format if precision.holds_16_bit_arrays(xp, cfg.storage_format) else None
    return "{} ({})".format(*attention_path(xp, cfg.attention_dropout, cfg.head_dim, sixteen_bit))


def format_table(result):
    peak = result.get("peak_flops_per_s")
    rows = [("device, precision", f"{result['device_name']}, {result['precision']}"
                                  + (", CUDA graph (one launch a step)" if result.get("cuda_graph") else "")),
            ("attention", result["attention"]),
            ("BLAS of the Linears' GEMMs", result["blas"]),
            ("parameters", f"{result['parameters']:,}"),
            ("step time (median)", f"{result['step_s'] * 1e3:.1f} ms"),
            ("tokens/s", f"{result['tokens_per_s']:,.0f}"),
            ("model FLOPs per step", f"{result['model_flops_per_step'] / 1e9:.2f} GFLOP"),
            ("model FLOP/s", f"{result['model_flops_per_s'] / 1e9:.2f} GFLOP/s"),
            ("GEMM FLOP/s at the model's shapes", f"{result['gemm_flops_per_s'] / 1e9:.2f} GFLOP/s"),
            ("ratio (median of each step's to the GEMMs timed after it)", f"{result['ratio'] * 100:.1f} %"),
            ("model-FLOP utilisation (of the device's peak)",
             "the ratio above: a CPU's peak is its GEMM ceiling" if result["device_name"] == "cpu" else
             "no peak listed for this device (perf/peaks.py)" if peak is None else
             f"{result['mfu'] * 100:.1f} % of {peak / 1e12:g} TFLOP/s"),
            ("peak memory", f"{result['peak_bytes'] / 2 ** 20:,.0f} MiB")]
    for name, peer in (result.get("torch") or {}).items():
        rows.append((f"PyTorch {name} (same GPU)", peer["error"] if "error" in peer else
                     f"{peer['step_s'] * 1e3:.1f} ms, {peer['tokens_per_s']:,.0f} tokens/s, peak "
                     f"{peer['peak_bytes'] / 2 ** 20:,.0f} MiB; ours / theirs {peer['ours_over_theirs']:.2f}"))
    alone = result.get("profile_gemms_alone_s") or {}
    for kind, seconds in (result.get("profile_s") or {}).items():
        rows.append((f"  {kind} (per step)", f"{seconds * 1e3:.1f} ms" + (
            f" (its GEMMs alone, best of 3: {alone[kind] * 1e3:.1f} ms)" if kind in alone else "")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows) + "\n" + json.dumps(result)
