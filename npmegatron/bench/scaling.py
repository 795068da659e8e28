"""`npmegatron bench scaling`: strong and weak scaling over TP x PP x DP layouts, with each
step's time split into phases by the training step's timers (npmegatron/timers.py).

The parent is a plain process (it never starts MPI): for each layout it launches one
`mpiexec -n TP*PP*DP python -m npmegatron.bench.scaling_child '<spec JSON>'` child (scaling_child.py), whose rank 0
prints one JSON record on a line starting with RECORD_PREFIX. Every child gets
max(1, cores // ranks) BLAS threads per rank (OMP/OPENBLAS/MKL_NUM_THREADS here, threadpoolctl in
comm.init()), so every layout runs on the same cores.

Strong scaling: one model and one global batch (default: micro-batch x largest DP x 2, so every
layout has at least 2 micro-batches) on every layout; efficiency = speed-up / ranks, speed-up =
step time of the baseline (the 1-rank layout, else the one with fewest ranks) / this step time,
times the baseline's ranks.

Weak scaling (the paper's Table 1 idea: the work per rank stays about constant):
  TP: heads = the given heads rounded up to a multiple of TP; hidden = the given hidden x sqrt(TP)
      rounded to a multiple of those heads (so parameters per rank, ~12 L h^2 / TP, stay about
      constant, and heads and the MLP split evenly over TP);
  PP: layers = the given layers x PP;   DP: global batch = the given global batch x DP.
  Efficiency = model FLOP/s per rank / the baseline's model FLOP/s per rank.

A step is the trainer's: train_step (1F1B), loss and gradient-norm reductions, clip at 1.0,
AdamW, on synthetic random tokens. Phases are rank 0's seconds per step (mean over the measured
steps); "other" is rank 0's step time minus its phases (zeroing buffers, Python overhead).
"""
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys

import numpy

from .. import comm
from ..autograd import InputError
from ..model import gpt_num_parameters
from ..pipeline_layout import default_layout
from ..timers import PHASES
from .scaling_child import RECORD_PREFIX, cores

PHASE_LABELS = {"forward-compute": "fwd", "backward-compute": "bwd", "tp-comm": "tp", "dp-comm": "dp",
                "pipeline-wait": "pp", "finalize-grads": "fin", "optimizer": "opt", "other": "other"}
AXES = {"tp": 0, "pp": 1, "dp": 2}
MAX_RANKS_PER_CORE = 8


def threads_per_rank(ranks):
    return max(1, cores() // ranks)


# ----------------------------------------------------------------------------- layouts (parent)

def parse_grid_shapes(layouts, ranks, parallel):
    """[(tp, pp, dp)] from --layouts "1x1x1,2x1x1" or from --ranks "1,2,4" with --parallel."""
    if layouts is not None and ranks is not None:
        raise InputError("give either --layouts or --ranks with --parallel, not both")
    if ranks is not None:
        if parallel is None:
            raise InputError("--ranks needs --parallel tp, pp or dp to say which axis the ranks go to")
        result = []
        for item in _items(ranks, "--ranks"):
            n = _positive(item, f"--ranks entry {item!r}")
            layout = [1, 1, 1]
            layout[AXES[parallel]] = n
            result.append(tuple(layout))
        return result
    if parallel is not None:
        raise InputError("--parallel goes with --ranks; --layouts already names each axis")
    result = []
    for item in _items(layouts if layouts is not None else "1x1x1,2x1x1,1x2x1,1x1x2,2x1x2", "--layouts"):
        parts = item.lower().split("x")
        if len(parts) != 3:
            raise InputError(f"layout {item!r} is not TPxPPxDP (three positive integers joined by x, "
                             "like 2x1x2)")
        result.append(tuple(_positive(p, f"layout {item!r}") for p in parts))
    return result


def _items(text, flag):
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise InputError(f"{flag} is empty; give a comma-separated list")
    return items


def _positive(text, what):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or str(value) != text.strip():
        raise InputError(f"{what} needs positive integers, got {text!r}")
    return value


def grid_shape_name(tp, pp, dp):
    return f"{tp}x{pp}x{dp}"


def plan_runs(cfg, layouts, mode, micro_batch, seq, global_batch=None, sequence_parallel=False):
    """One spec per layout: its model config, global batch and micro-batches, checked here, in
    the parent, so a bad layout is one sentence before anything is launched. sequence_parallel:
    on for the layouts with TP > 1 (with TP = 1 there is nothing to shard)."""
    if mode == "strong" and global_batch is None:
        global_batch = micro_batch * max(dp for _, _, dp in layouts) * 2
    if mode == "weak" and global_batch is None:
        global_batch = micro_batch * 2
    limit = MAX_RANKS_PER_CORE * cores()
    specs = []
    for tp, pp, dp in layouts:
        name, ranks = grid_shape_name(tp, pp, dp), tp * pp * dp
        if ranks > limit:
            raise InputError(f"layout {name} needs {ranks} ranks, more than {MAX_RANKS_PER_CORE} per core "
                             f"on this machine's {cores()} cores; use smaller layouts")
        layout_cfg, batch = dataclasses.replace(cfg, sequence_parallel=sequence_parallel and tp > 1), global_batch
        name += "+sp" if layout_cfg.sequence_parallel else ""
        if mode == "weak":
            heads = -(-cfg.num_attention_heads // tp) * tp
            hidden = max(heads, round(cfg.hidden_size * math.sqrt(tp) / heads) * heads)
            layout_cfg = dataclasses.replace(cfg, hidden_size=hidden, num_attention_heads=heads,
                                             num_layers=cfg.num_layers * pp, ffn_hidden_size=None,
                                             num_query_groups=cfg.num_query_groups if cfg.group_query_attention
                                             else None)
            batch = global_batch * dp
        if layout_cfg.num_attention_heads % tp:
            raise InputError(f"layout {name}: {layout_cfg.num_attention_heads} attention heads are not "
                             f"divisible by TP = {tp}; choose --num-attention-heads a multiple of {tp}")
        if layout_cfg.num_layers % pp:
            raise InputError(f"layout {name}: {layout_cfg.num_layers} layers do not split evenly over "
                             f"PP = {pp} stages; choose --num-layers a multiple of {pp}")
        default_layout(layout_cfg.num_layers, pp)
        if batch % (micro_batch * dp):
            raise InputError(f"layout {name}: global batch {batch} is not a multiple of micro-batch "
                             f"{micro_batch} x DP {dp}; choose --global-batch-size a multiple of "
                             f"{micro_batch * dp}")
        specs.append({"layout": name, "tp": tp, "pp": pp, "dp": dp, "ranks": ranks,
                      "cfg": dataclasses.asdict(layout_cfg), "global_batch": batch,
                      "micro_batch": micro_batch, "micro_batches": batch // (micro_batch * dp),
                      "seq": seq, "parameters": gpt_num_parameters(layout_cfg)})
    return specs


# ----------------------------------------------------------------------------- running (parent)

def rank_environment(ranks, threads):
    env = dict(os.environ, **comm.blas_thread_environment(threads), PYTHONUNBUFFERED="1")
    if ranks > cores():
        env["MPIR_CVAR_CH4_PROGRESS_THROTTLE"] = "true"
    return env


class ChildFailed(Exception):
    pass


def run_layout(spec, warmup, iters, timeout=None, threads=None):
    """Launch one layout's child under mpiexec; its record (a dict). threads: BLAS and CPU-engine
    threads per rank (default: the cores shared among the ranks)."""
    threads = threads or threads_per_rank(spec["ranks"])
    child = dict(spec, warmup=warmup, iters=iters, threads_per_rank=threads)
    command = [comm.mpiexec_path(), "-n", str(spec["ranks"]), sys.executable, "-m", "npmegatron.bench.scaling_child",
               json.dumps(child)]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    done = subprocess.run(command, env=rank_environment(spec["ranks"], threads), capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RECORD_PREFIX)]
    if done.returncode or not lines:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise ChildFailed(f"layout {spec['layout']} failed (exit {done.returncode}):\n{tail}")
    record = json.loads(lines[-1][len(RECORD_PREFIX):])
    record["environment"]["load_average_before"] = load
    return record


def add_efficiency(records, mode):
    """Speed-up and efficiency against the baseline: the 1-rank layout, else the fewest ranks."""
    if not records:
        return records
    base = min(records, key=lambda r: r["ranks"])
    for r in records:
        r["baseline"] = base["layout"]
        if mode == "strong":
            r["speedup"] = base["step_s"] / r["step_s"] * base["ranks"]
            r["efficiency"] = r["speedup"] / r["ranks"]
        else:
            r["efficiency"] = r["model_flops_per_s_per_rank"] / base["model_flops_per_s_per_rank"]
            r["speedup"] = r["efficiency"] * r["ranks"]
    return records


def bench_scaling(cfg, layouts, mode, micro_batch, seq, global_batch=None, warmup=1, iters=3,
                  on_record=None, threads=None, sequence_parallel=False, rounds=1):
    """One record per layout. rounds > 1 runs all the layouts that many times, one after the
    other in turn, each round's efficiencies against its own baseline run (combine_rounds)."""
    specs = plan_runs(cfg, layouts, mode, micro_batch, seq, global_batch, sequence_parallel)
    by_round = []
    for _ in range(rounds):
        records = []
        for spec in specs:
            records.append(run_layout(spec, warmup, iters, threads=threads))
            if on_record is not None:
                on_record(records[-1])
        by_round.append(add_efficiency(records, mode))
    return by_round[0] if rounds == 1 else combine_rounds(by_round)


def combine_rounds(by_round):
    """Per layout, the round whose efficiency is the median (the lower one for an even count)
    stands for it, with every round's step, tokens/s and efficiency listed under "rounds": on a
    machine whose speed drifts by +-15 % within minutes, a layout is held against the baseline
    run next to it rather than one run minutes earlier."""
    combined = []
    for runs in zip(*by_round):
        middle = statistics.median_low(r["efficiency"] for r in runs)
        record = dict(next(r for r in runs if r["efficiency"] == middle))
        record["rounds"] = [{k: r[k] for k in ("step_s", "tokens_per_s", "efficiency")} for r in runs]
        combined.append(record)
    return combined


# ----------------------------------------------------------------------------- output (parent)

def format_table(records, mode):
    if not records:
        return ""
    env = records[0]["environment"]
    flop_unit, scale = ("TFLOP/s", 1e12) if env["device"] == "gpu" else ("GFLOP/s", 1e9)
    lines = [f"{mode} scaling, {records[0]['dtype']} on {env['device']}, {env['cores']} cores; BLAS threads "
             f"per rank = max(1, cores // ranks), set through OMP/OPENBLAS/MKL_NUM_THREADS and "
             f"threadpoolctl; efficiency vs {records[0]['baseline']}",
             "step: median [min-max] over the measured steps, slowest rank; phases: rank 0's ms per "
             "step (mean), compute excludes the TP communication inside it"]
    phases = list(PHASES) + ["other"]
    head = (f"{'layout':>8} {'ranks':>5} {'thr':>3} {'params':>11} {'hidden':>6} {'lay':>3} {'GBS':>4} "
            f"{'step s':>22} {'tokens/s':>9} {flop_unit + '/rank':>13} {'eff':>6} "
            + " ".join(f"{PHASE_LABELS[p]:>7}" for p in phases))
    lines.append(head)
    for r in records:
        spread = f"{r['step_s']:.3f} [{r['step_min_s']:.3f}-{r['step_max_s']:.3f}]"
        lines.append(f"{r['layout']:>8} {r['ranks']:>5} {r['threads_per_rank']:>3} {r['parameters']:>11,} "
                     f"{r['hidden_size']:>6} {r['num_layers']:>3} {r['global_batch']:>4} {spread:>22} "
                     f"{r['tokens_per_s']:>9.0f} {r['model_flops_per_s_per_rank'] / scale:>13.2f} "
                     f"{r['efficiency'] * 100:>5.0f}% "
                     + " ".join(f"{r['phases_s'][p] * 1e3:>7.1f}" for p in phases))
    if "rounds" in records[0]:
        lines.append(f"{len(records[0]['rounds'])} rounds of the layouts in turn; each row is the round "
                     "of its median efficiency; every round's efficiency (tokens/s):")
        for r in records:
            lines.append(f"{r['layout']:>8}  " + ", ".join(f"{x['efficiency'] * 100:.0f} % ({x['tokens_per_s']:,.0f})"
                                                         for x in r["rounds"]))
    return "\n".join(lines)


def write_output(records, mode, folder):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "results.jsonl"), "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    plot(records, mode, folder)


def plot(records, mode, folder):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot
    ranks = [r["ranks"] for r in records]
    labels = [r["layout"] for r in records]
    fig, (ax1, ax2) = pyplot.subplots(1, 2, figsize=(10, 4))
    top = max(ranks)
    ax1.plot([1, top], [1, top], "k--", label="ideal")
    ax1.scatter(ranks, [r["speedup"] for r in records], color="C0", zorder=3, label="measured")
    ax2.plot([1, top], [1, 1], "k--", label="ideal")
    ax2.scatter(ranks, [r["efficiency"] for r in records], color="C1", zorder=3, label="measured")
    for r, label in zip(records, labels):
        ax1.annotate(label, (r["ranks"], r["speedup"]), fontsize=8, xytext=(3, 3), textcoords="offset points")
        ax2.annotate(label, (r["ranks"], r["efficiency"]), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax1.set(xlabel="ranks", ylabel="speed-up" if mode == "strong" else "scaled speed-up",
            title=f"{mode} scaling: speed-up")
    ax2.set(xlabel="ranks", ylabel="efficiency", title=f"{mode} scaling: efficiency",
            ylim=(0, max(1.1, max(r["efficiency"] for r in records) * 1.1)))
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "scaling.png"), dpi=100)
    pyplot.close(fig)

    fig, ax = pyplot.subplots(figsize=(max(6, 1.2 * len(records) + 4), 4))
    bottom = numpy.zeros(len(records))
    for k, phase in enumerate(list(PHASES) + ["other"]):
        values = numpy.array([max(0.0, r["phases_s"][phase]) for r in records])
        ax.bar(labels, values, bottom=bottom, label=phase, color=f"C{k}")
        bottom += values
    ax.set(xlabel="layout (TPxPPxDP)", ylabel="seconds per step (rank 0)", title=f"{mode} scaling: step phases")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "breakdown.png"), dpi=100)
    pyplot.close(fig)
