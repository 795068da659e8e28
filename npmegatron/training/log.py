"""What a training run shows: a header, a progress bar (on a terminal only: captured to a file,
its refreshes would bury the interval lines), a line every --log-interval iterations with the
same figures as JSON in --log-file and to TensorBoard or W&B (trackers.py), and a summary. Only
rank 0 writes; other ranks pass echo=None."""
import json
import sys
import time

import numpy
from tqdm import tqdm

from .. import comm
from ..autograd import InputError, precision
from ..autograd.ops.fused_attention import attention_path
from ..model import gpt_num_parameters, model_flops
from ..moe.metrics import interval_metrics
from ..perf.memory import ParallelShape, chunk_activation_bytes, optimizer_parameters
from ..run import expert_parameter_ids
from .metrics import format_layers, format_memory, format_phases, layer_times, peak_flops_per_rank, phases
from .trackers import Trackers


class TrainingLog:
    def __init__(self, trainer, echo):
        config, self.echo, self.trainer = trainer.config, echo, trainer
        self.total = config.train_iters
        self.tokens_per_step = trainer.plan.global_batch * config.seq_length
        self.flops_per_step = model_flops(trainer.cfg, trainer.model.num_parameters(),
                                          trainer.plan.global_batch, config.seq_length)
        self.file = open_log(config.log_file, append=bool(config.load)) if config.log_file and echo else None
        self.trackers = Trackers(config, echo)
        self.bar = tqdm(total=self.total, initial=trainer.iteration, desc="training", unit="it",
                        leave=False, disable=not (echo and sys.stderr.isatty()))
        self.window, self.window_start = [], time.perf_counter()
        self.world_size = trainer.grid.world_size
        self.peak, peak_source = peak_flops_per_rank(trainer)
        self.say(header(trainer))
        if self.peak:
            self.say(f"model-FLOP utilisation against {self.peak / 1e12:g} TFLOP/s per rank ({peak_source})")
        if echo and comm.launched_by_mpi() and not sys.stderr.isatty():
            self.say("progress: a line every --log-interval steps (under mpiexec every rank's output is a pipe, so "
                     "the progress bar shows only in runs of one process on a terminal)")
        if trainer.starts_fresh:
            self.say(f"--load {config.load} holds no checkpoint yet: training starts from scratch (run again "
                     "with the same --load to resume)")
        elif config.load and config.finetune:
            self.say(f"started from the weights of {config.load} (--finetune: fresh optimizer, iteration 0)")
        elif config.load:
            self.say(f"resumed from {config.load} at iteration {trainer.iteration}")
        if config.train_iters <= config.warmup_iters:
            self.say(f"warning: --train-iters {config.train_iters} is not more than the {config.warmup_iters} "
                     f"warm-up steps, so the whole run is warm-up and never trains at --lr {config.lr}")

    def say(self, text):
        if self.echo:
            self.bar.write(text) if not self.bar.disable else self.echo(text)

    def iteration(self, loss):
        self.window.append(loss)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.3f}")

    def interval(self, done, lr, grad_norm, val_loss=None, scaling=None, evaluated_s=None):
        """The line (and JSON record) for the iterations since the last one; `scaling`: the loss
        scale and the steps skipped so far (--fp16); `evaluated_s`: seconds its evaluation took."""
        # the interval's evaluation is not training: its seconds are left out
        elapsed, steps = time.perf_counter() - self.window_start - (evaluated_s or 0.0), len(self.window)
        record = {"iteration": done, "loss": float(numpy.mean(self.window)), "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": steps * self.tokens_per_step / elapsed,
                  "tflops": steps * self.flops_per_step / elapsed / 1e12, "iteration_s": elapsed / steps}
        record["tflops_per_rank"] = record["tflops"] / self.world_size
        if self.peak:
            record["mfu"] = record["tflops_per_rank"] * 1e12 / self.peak
        if val_loss is not None:
            record["val_loss"] = val_loss
        record.update(scaling or {})
        record.update(interval_metrics(self.trainer.model, self.trainer.grid))     # collective; MoE only
        lines = [format_record(record, self.total)]
        if self.trainer.timers.enabled:     # collective, as is the memory report
            if self.trainer.config.timing_log_level == 2:
                record["layers_s"] = layer_times(self.trainer.timers, steps, self.trainer.grid.world,
                                                 self.trainer.cfg.num_layers)
            record["phases_s"] = phases(self.trainer.timers, steps, self.trainer.grid.world)
            record["other_s"] = elapsed / steps - sum(high for high, _ in record["phases_s"].values())
            lines.append(format_phases(record))
            if "layers_s" in record:
                lines.append(format_layers(record))
        memory = self.trainer.memory_log.report() if self.trainer.memory_log else None
        if memory:
            record.update(memory)
            lines.append(format_memory(record, self.trainer.model.xp is not numpy))
        for line in lines:
            self.say(line)
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        self.trackers.write(record)
        self.window, self.window_start = [], time.perf_counter()

    def summary(self, losses):
        if losses:
            self.say(f"done: loss {losses[0]:.4f} -> {numpy.mean(losses[-10:]):.4f} (mean of the last "
                     f"{min(10, len(losses))} iterations)")

    def close(self):
        self.bar.close()
        if self.file:
            self.file.close()
        self.trackers.close()


def recompute_note(cfg):
    """What activation recomputation the run does, for the header."""
    if cfg.recompute_granularity == "selective":
        return ", selective recomputation (the attention core)"
    if cfg.recompute_granularity != "full":
        return ""
    count, method = cfg.recompute_num_layers or 1, cfg.recompute_method or "uniform"
    if method == "block":
        return f", full recomputation of the first {count} layer(s) of each stage"
    return f", full recomputation: every {count} layer(s) keep only their input"


def precision_note(cfg):
    if cfg.storage_format:
        return f"{cfg.storage_format} values with float32 arithmetic and master weights"
    return cfg.dtype


def memory_note(trainer):
    """Bytes per parameter on this rank and activation bytes kept per layer and micro-batch, as
    the run's precision, optimizer and recomputation imply (perf/memory.py's formulas)."""
    cfg, grid, config = trainer.cfg, trainer.grid, trainer.config
    w = numpy.dtype(cfg.dtype).itemsize
    granularity = cfg.recompute_granularity or "none"
    layout = ParallelShape(tp=grid.tp_size, cp=grid.cp_size, dp=grid.dp_size, ep=grid.ep_size,
                           etp=grid.expert_tp_group.size, seq=config.seq_length,
                           micro_batch=config.micro_batch_size, sequence_parallel=cfg.sequence_parallel,
                           recompute=granularity, recompute_method=cfg.recompute_method or "uniform",
                           recompute_num_layers=cfg.recompute_num_layers or 1,
                           distributed_optimizer=config.parallel.use_distributed_optimizer)
    layers = cfg.num_layers // (grid.pp_size * trainer.model.virtual_size)
    # --fp16/--bf16: 16-bit weights and activations, float32 gradients, masters and moments.
    # On the CPU this project holds the 16-bit values in float32 arrays, on a GPU only the weights
    # (autograd/precision.py: the activations kept for backward are 16-bit arrays there), so these
    # are the bytes 16-bit storage implies.
    stored = 2 if cfg.storage_format else w
    per_layer = chunk_activation_bytes(cfg, layout, stored, layers)[0] / layers
    expert_ids = expert_parameter_ids(trainer.model)
    params = sum(p.size for p in trainer.params)
    experts = sum(p.size for p in trainer.params if id(p) in expert_ids)
    implied = ""
    if stored != w:
        held = ("the weights forward reads and the activations kept are 16-bit arrays" if cfg.device == "gpu"
                else "float32 arrays here")
        implied = f" ({cfg.storage_format} as stored by a 16-bit backend; {held})"
    return (f"memory: {stored} B weight + {w} B gradient + {adamw_state_note(cfg, layout, params, experts)} per "
            f"parameter; {per_layer / 2 ** 20:.2f} MiB of activations kept per layer and micro-batch{implied}")


def adamw_state_note(cfg, layout, params, experts):
    """AdamW's state bytes per parameter of the `params` a rank holds, `experts` of them routed
    experts', and how they are kept. Under the distributed optimizer the planner's share
    (perf/memory.py optimizer_parameters): the dense weights' state over DP x CP, the experts' over
    the DP x CP / EP ranks holding the same experts, so the figure is their mean on this rank."""
    w = numpy.dtype(cfg.dtype).itemsize
    per_element = (3 if cfg.storage_format else 2) * w      # m and v, and the float32 master
    held = optimizer_parameters(layout, params, experts) / params
    kept = "2 moments" + (" + float32 master" if cfg.storage_format else "")
    dense = layout.dp * layout.cp
    if layout.distributed_optimizer and experts and layout.ep > 1:
        shard = f"1/{layout.expert_dp}" if layout.expert_dp > 1 else "whole (one rank holds each)"
        kept += f", distributed: the dense weights' 1/{dense}, the experts' {shard}"
    elif layout.distributed_optimizer and dense > 1:
        kept += f", 1/{dense}: distributed"
    return f"{per_element * held:.4g} B AdamW state ({kept})"


def attention_note(trainer):
    """Which causal attention a GPU run's training steps use, and why (fused_attention.py)."""
    cfg, xp = trainer.cfg, trainer.model.xp
    sixteen_bit = cfg.storage_format if precision.holds_16_bit_arrays(xp, cfg.storage_format) else None
    path, why = attention_path(xp, cfg.attention_dropout, cfg.head_dim, sixteen_bit)
    return f"\nattention: {path} ({why})" if cfg.device == "gpu" else ""


def header(trainer):
    cfg, grid, plan, model, data = trainer.cfg, trainer.grid, trainer.plan, trainer.model, trainer.data
    pipeline = f", layout {plan.layout!r} ({trainer.schedule})" if grid.pp_size > 1 else ""
    active = f" ({gpt_num_parameters(cfg, active=True):,} active a token)" if cfg.num_experts else ""
    return (f"GPT: {model.num_parameters():,} parameters{active}, {cfg.num_layers} layers, hidden "
            f"{cfg.hidden_size}, {cfg.num_attention_heads} heads{parts_note(cfg)}, {precision_note(cfg)} on "
            f"{cfg.device}, {grid}"
            f"{' sequence-parallel' if cfg.sequence_parallel else ''}{pipeline}{recompute_note(cfg)}; global batch "
            f"{plan.global_batch} = {trainer.config.micro_batch_size} x {plan.micro_batches} accumulation x "
            f"{grid.dp_size} DP; data {data.description}: {len(data.train):,} training / "
            f"{len(data.valid):,} validation tokens ({held_out_share(data):.1f} % held out: {data.held_out})\n"
            f"{memory_note(trainer)}{attention_note(trainer)}")


def parts_note(cfg):
    """The block's parts where they are not GPT-2's (--model-family llama, or a part's own flag)."""
    parts = [cfg.normalization if cfg.normalization != "LayerNorm" else None,
             "rotary positions" if cfg.position_embedding_type == "rope" else None,
             "SwiGLU" if cfg.swiglu else None,
             f"{cfg.num_query_groups} key/value groups" if cfg.group_query_attention else None,
             "untied output layer" if cfg.untie_embeddings_and_output_weights else None,
             ("no biases but QKV's" if cfg.add_qkv_bias else "no biases") if cfg.disable_bias_linear else None]
    chosen = [p for p in parts if p]
    return f" ({', '.join(chosen)})" if chosen else ""


def held_out_share(data):
    """The validation tokens' share, in percent, of the training and validation tokens."""
    return 100.0 * len(data.valid) / max(len(data.train) + len(data.valid), 1)


def open_log(path, append):
    try:
        return open(path, "a" if append else "w")
    except OSError as e:
        raise InputError(f"cannot write --log-file {path} ({e.strerror}); choose a writable file") from None


#: the parts of a record's line that only some runs have: (key, its text)
OPTIONAL_PARTS = (
    ("mfu", lambda r: f"MFU {r['mfu'] * 100:.1f} %"),
    ("loss_scale", lambda r: f"loss scale {r['loss_scale']:g} | skipped {r['skipped_iterations']}"),
    ("load_balancing_loss", lambda r: f"load balancing loss {r['load_balancing_loss']:.4f}"),
    ("z_loss", lambda r: f"z-loss {r['z_loss']:.4f}"),
    ("tokens_per_expert_max_over_mean", lambda r: f"tokens per expert max/mean {r['tokens_per_expert_max_over_mean']:.2f}"),
    ("dropped_tokens", lambda r: f"dropped {r['dropped_tokens']:,}"),
    ("val_loss", lambda r: f"val loss {r['val_loss']:.4f}"),
)


def format_record(r, total):
    line = (f"iter {r['iteration']:>5}/{total} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"grad norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | "
            f"{r['tflops_per_rank']:.4f} TFLOP/s per rank")
    return line + "".join(f" | {text(r)}" for key, text in OPTIONAL_PARTS if key in r)
