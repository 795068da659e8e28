"""The click command `npmegatron plan` (and `npmegatron plan calibrate`), added to cli.main."""
import json
import os

import click

from ...autograd import InputError
from ...cli_support import Group, config_options, model_preset_option, user_errors, with_model_preset
from ...config import MODEL_PRESETS, TRAIN_MODEL_DEFAULTS, GPTConfig, ParallelConfig, TrainConfig, check_given
from ...perf import ParallelShape, load_profile
from ...perf.search import paper_attention_heads, paper_weak_scaling, plan, search, training_time
from .against import format_against, predicted_against_measured, read_records
from .calibrate import calibrate

MODEL_FIELDS = {"num_layers", "hidden_size", "num_attention_heads", "vocab_size", "dtype", "fp16", "bf16",
                "sequence_parallel", "hidden_dropout", "attention_dropout", "ffn_hidden_size", "model_family",
                "normalization", "position_embedding_type", "swiglu", "group_query_attention", "num_query_groups",
                "untie_embeddings_and_output_weights", "disable_bias_linear",
                # mixture of experts: what sets the experts' parameters, GEMMs and dispatch
                "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk",
                "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "tf32"}
GB = 1e9


def parse_grid_shape(text):
    """"TPxPPxDP" (the shape of the rank grid, as --layout gives it) -> (tp, pp, dp)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() and 1 <= int(p) <= 2 ** 16 for p in parts):
        raise InputError(f"--layout {text!r} is not TPxPPxDP with positive integers up to 65536; "
                         "write e.g. 2x1x4")
    return tuple(int(p) for p in parts)


def gb(n):
    return f"{n / GB:.3f} GB"


def format_throughput(result):
    """Tokens a second, and the utilisation of the profile's peak where it gives one."""
    rate = result["throughput"]
    line = f"throughput {rate['tokens_per_s']:,.0f} tokens/s ({rate['tokens_per_step']:,} tokens a step)"
    if rate["mfu"] is not None:
        line += (f", model-FLOP utilisation {rate['mfu'] * 100:.1f} % of the profile's "
                 f"{rate['peak_flops'] / 1e12:.2f} TFLOP/s peak per rank")
    return line


def format_training(run):
    return (f"training {run['steps']:,} steps, {run['tokens']:,} tokens: {format_duration(run['seconds'])} on "
            f"{run['ranks']} rank{'s' if run['ranks'] > 1 else ''}, {run['rank_hours']:,.{0 if run['rank_hours'] >= 10 else 2}f} "
            "rank-hours")


def format_duration(seconds):
    """Seconds in the unit a person sizing a run reads: s, min, h, or days with the hours."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:,.1f} days ({seconds / 3600:,.0f} h)"


def format_plan(result, cfg, profile):
    lines = [f"layout {result['layout']} (TP x PP x DP), {result['micro_batches']} micro-batches per step, "
             f"profile {profile['name']}"]
    mem = result["memory"]
    head = f"{'pp rank':>7} {'layers':>6} {'params':>12} {'param':>11} {'grad':>11} {'AdamW m,v':>11} " \
           f"{'activations':>12} {'total':>11}   {'mixed precision':>15}"
    lines += ["memory per rank (this run's precision, where --fp16/--bf16 keep float32 gradients and master "
              "weights; mixed precision = the paper's: 16-bit parameters and gradients, fp32 master weights and "
              "AdamW state (sharded with --use-distributed-optimizer), 16-bit activations):", head]
    for r in mem["ranks"]:
        lines.append(f"{r['pp_rank']:>7} {r['layers']:>6} {r['parameter_count']:>12,} {gb(r['parameters']):>11} "
                     f"{gb(r['gradients']):>11} {gb(r['optimizer']):>11} {gb(r['activations']):>12} "
                     f"{gb(r['total']):>11}   {gb(r['mixed_precision_total']):>15}")
    if cfg.num_experts:
        lines.append(format_experts(result, cfg))
    fits = "n/a" if mem["fits"] is None else ("fits" if mem["fits"] else "DOES NOT FIT")
    lines.append(f"peak {gb(mem['peak'])} on pipeline rank {mem['peak_pp_rank']} vs device memory "
                 f"{gb(mem['device_memory'] or 0)}: {fits}")
    t = result["time"]
    lines.append(f"predicted step time {t['total'] * 1e3:.2f} ms, {t['flops_per_device'] / 1e9:.2f} GFLOP/s "
                 "per rank:")
    for key, name in TIME_TERMS:
        if key in ("compute", "dp_comm_exposed") or t[key]:
            share = t[key] / t["total"] * 100 if t["total"] else 0.0
            extra = f" (of {t['dp_comm'] * 1e3:.2f} ms)" if key == "dp_comm_exposed" else ""
            lines.append(f"  {name:<34}{t[key] * 1e3:>11.2f} ms {share:>6.1f} %{extra}")
            if key == "compute":
                for part, seconds in t["compute_parts"].items():
                    lines.append(f"    {COMPUTE_PART_NAMES[part]:<32}{seconds * 1e3:>11.2f} ms "
                                 f"{seconds / t['total'] * 100 if t['total'] else 0.0:>6.1f} %")
    lines.append(format_throughput(result))
    if "training" in result:
        lines.append(format_training(result["training"]))
    return "\n".join(lines)


def format_experts(result, cfg):
    """An MoE model's parameters (all, and those a token uses, which its model FLOPs count) and
    what each pipeline rank's routed experts take of its memory."""
    split = (f"split over TP {result['tp']}" if result["etp"] > 1
             else "whole on every TP rank" if result["tp"] > 1 else "whole")
    held = ", ".join(f"pp rank {r['pp_rank']} {r['expert_parameter_count']:,} ({gb(r['experts'])})"
                     for r in result["memory"]["ranks"])
    return (f"mixture of experts: {cfg.num_experts} experts, top {cfg.moe_router_topk}, in {sum(cfg.moe_layers)} of "
            f"{cfg.num_layers} layers; {result['parameters']:,} parameters, {result['active_parameters']:,} active per "
            f"token (model FLOPs and utilisation count these)\n"
            f"routed experts per rank (EP {result['ep']}, each expert {split}), parameters (with their gradients and "
            f"optimizer state): {held}")


#: The parts of compute a profile with measured rates splits it into (perf/work.py).
COMPUTE_PART_NAMES = {"gemm": "GEMMs", "attention": "attention core", "memory_bound": "memory-bound ops",
                      "engine": "engine (Python, autograd)", "host": "waits for the host (RNG state)",
                      "launches": "gaps between kernels", "host_issue": "waiting for the host to issue"}


#: The step time's terms in plan's output, in the order of a step (time_model.step_time's keys).
TIME_TERMS = (("compute", "compute"), ("tp_comm", "TP communication"), ("ep_comm", "expert all-to-alls"),
              ("cp_comm", "CP ring"),
              ("pp_comm", "pipeline sends"), ("bubble", "pipeline bubble"),
              ("dp_comm_exposed", "DP all-reduce not hidden"), ("embedding_comm", "tied embedding all-reduce"),
              ("optimizer", "optimizer"))


def format_search(results):
    """One line a layout; with a run length (--train-iters or --train-tokens) its duration too."""
    run = "training" in results[0]
    width = max(12, max(len(r["layout"]) for r in results) + 2)      # an MoE layout names its EP too
    experts = any(r["ep"] > 1 for r in results)                       # a column for the all-to-alls
    lines = [f"{'layout':<{width}}{'step ms':>10}{'compute':>10}{'TP':>9}" + (f"{'EP':>9}" if experts else "")
             + f"{'PP':>9}{'bubble':>9}{'DP exp':>9}{'tokens/s':>12}{'peak mem':>12}"
             + (f"{'run':>20}" if run else "") + "  fit"]
    for r in results:
        t, m = r["time"], r["memory"]
        fit = "-" if m["fits"] is None else ("yes" if m["fits"] else "no")
        length = f"{format_duration(r['training']['seconds']):>20}" if run else ""
        lines.append(f"{r['layout']:<{width}}{t['total'] * 1e3:>10.2f}{t['compute'] * 1e3:>10.2f}"
                     f"{t['tp_comm'] * 1e3:>9.2f}" + (f"{t['ep_comm'] * 1e3:>9.2f}" if experts else "")
                     + f"{t['pp_comm'] * 1e3:>9.2f}{t['bubble'] * 1e3:>9.2f}"
                     f"{t['dp_comm_exposed'] * 1e3:>9.2f}{r['throughput']['tokens_per_s']:>12,.0f}"
                     f"{gb(m['peak']):>12}{length}  {fit}")
    return "\n".join(lines)


WEAK_HEADER = (f"{'hidden':>6}{'heads':>6}{'layers':>7}{'params':>8}{'TP':>4}{'DP':>4}{'GPUs':>6}{'DP all-reduce':>15}"
               f"{'step s':>8}{'TFLOP/s/GPU':>13}{'MFU':>7}{'efficiency':>12}{'measured':>10}")


def format_heads(rows):
    return format_weak(rows, "the 8.3 B model at 8-way TP by attention heads (the paper's Table 7), predicted "
                             "against the predicted 1-GPU baseline, beside the efficiency measured:")


def format_weak(rows, title=None):
    lines = [title or "weak scaling (Shoeybi et al. 2019 configurations, fp16, full recomputation), predicted, "
                      "with the efficiency measured where published:", WEAK_HEADER]
    for r in rows:
        reduce = "-" if r["dp"] == 1 else ("overlapped" if r["overlap_grad_reduce"] else "after")
        paper = "" if r["paper_efficiency"] is None else f"{r['paper_efficiency'] * 100:.0f}%"
        mfu = "-" if r["mfu"] is None else f"{r['mfu'] * 100:.1f}%"
        lines.append(f"{r['hidden']:>6}{r['heads']:>6}{r['layers']:>7}{r['parameters'] / 1e9:>7.2f}B{r['tp']:>4}"
                     f"{r['dp']:>4}{r['gpus']:>6}{reduce:>15}{r['step_s']:>8.3f}{r['tflops_per_gpu']:>13.1f}"
                     f"{mfu:>7}{r['efficiency'] * 100:>11.1f}%{paper:>10}")
    return "\n".join(lines)


@click.group("plan", cls=Group, invoke_without_command=True)
@config_options(GPTConfig, only=MODEL_FIELDS, defaults=TRAIN_MODEL_DEFAULTS)      # train's defaults
@config_options(TrainConfig, only={"seq_length", "micro_batch_size", "global_batch_size"})
@config_options(ParallelConfig, only={"num_layers_per_virtual_pipeline_stage", "pipeline_schedule",
                                      "context_parallel_size", "ddp_bucket_size", "expert_model_parallel_size",
                                      "expert_tensor_parallel_size"})
@model_preset_option
@click.option("--layout", default="1x1x1", show_default=True, help="TPxPPxDP, e.g. 2x1x4.")
@click.option("--recompute", type=click.Choice(["none", "selective", "full"]), default="none",
              show_default=True, help="Activation recomputation (training's --recompute-granularity).")
@click.option("--recompute-method", type=click.Choice(["uniform", "block"]), default="uniform",
              show_default=True, help="With --recompute full: as training's --recompute-method.")
@click.option("--recompute-num-layers", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --recompute full: as training's --recompute-num-layers.")
@click.option("--use-distributed-optimizer", "distributed_optimizer", is_flag=True,
              help="Optimizer state sharded over the DP ranks, as training's flag.")
@click.option("--overlap-grad-reduce/--no-overlap-grad-reduce", default=True, show_default=True,
              help="The DP gradient all-reduce hidden behind backward, as this project's training does it "
                   "(Megatron-LM's flag); without it the whole all-reduce follows backward, as the 2019 "
                   "implementation did.")
@click.option("--profile", default="dgx2h", show_default=True,
              help="Profile JSON file, or a shipped profile's name (dgx2h, h200).")
@click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
              help="Where the run trains, as train's flag: on cpu its ranks share this machine's memory, on "
                   "gpu each has the profile's device memory.")
@click.option("--device-memory", type=float, default=None, help="GB per rank (default: this machine's memory "
              "over the ranks with --device cpu, the profile's with --device gpu).")
@click.option("--search", "search_ranks", type=click.IntRange(min=1), default=None,
              help="Rank every TPxPPxDP layout of N ranks valid for the model by predicted step time.")
@click.option("--weak-scaling", type=click.Choice(["paper"]), default=None,
              help="Predict the paper's weak-scaling runs on the profile (default dgx2h).")
@click.option("--against", "against", default=None, metavar="RESULTS_JSONL",
              help="Predict every run a `npmegatron bench scaling` results.jsonl records, beside its measured "
                   "step time (use a profile from `npmegatron plan calibrate` on the same machine).")
@click.option("--train-iters", type=int, default=None,
              help="Optimizer steps of the run (train's flag): plan adds how long they take.")
@click.option("--train-tokens", type=float, default=None,
              help="Tokens to train on, e.g. 300e9: plan adds the steps they take (global batch x seq-length "
                   "tokens a step, rounded up to whole steps) and how long.")
@click.option("--cuda-graph", is_flag=True, help="The step replayed as one CUDA graph (train's flag; a GPU "
              "profile then counts no time for the host to issue it).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
@user_errors
def plan_command(ctx, preset, layout, recompute, recompute_method, recompute_num_layers, distributed_optimizer,
                 overlap_grad_reduce, profile, device, device_memory, search_ranks, weak_scaling, against,
                 train_iters, train_tokens, cuda_graph, as_json, **options):
    """Predict memory per rank and step time of a model on a layout from a machine profile."""
    if ctx.invoked_subcommand is not None:
        return
    machine = load_profile(profile)
    check_gpu_flags(machine, cuda_graph=cuda_graph, tf32=options.get("tf32"))
    if against:
        rows = predicted_against_measured(read_records(against), machine)
        click.echo(json.dumps(rows) if as_json else format_against(rows))
        return
    if weak_scaling:
        rows, heads = paper_weak_scaling(machine), paper_attention_heads(machine)
        click.echo(json.dumps({"weak_scaling": rows, "attention_heads": heads}) if as_json
                   else format_weak(rows) + "\n" + format_heads(heads))
        return
    if device_memory is not None and not device_memory > 0:
        raise InputError(f"--device-memory {device_memory} must be a positive number of GB")
    check_run_length(train_iters, train_tokens)
    memory = None if device_memory is None else device_memory * GB
    options = with_model_preset(preset, options)
    check_given(options, TrainConfig, ParallelConfig)      # GPTConfig checks its own fields
    seq = options.pop("seq_length")
    micro_batch = options.pop("micro_batch_size")
    global_batch = options.pop("global_batch_size")
    per_virtual = options.pop("num_layers_per_virtual_pipeline_stage")
    schedule = options.pop("pipeline_schedule")
    cp = options.pop("context_parallel_size")
    bucket = options.pop("ddp_bucket_size")
    ep, etp = options.pop("expert_model_parallel_size"), options.pop("expert_tensor_parallel_size")
    # --tf32 is a GPU's: the config refuses it elsewhere in one sentence naming --device gpu
    cfg = GPTConfig(**options, max_position_embeddings=seq, **({"device": device} if options.get("tf32") else {}))
    t, p, d = parse_grid_shape(layout)
    if search_ranks is not None and layout != "1x1x1":
        if t * p * d * cp != search_ranks:
            raise InputError(f"--layout {layout} has {t * p * d * cp} ranks but --search asks for {search_ranks}; "
                             "give one of the two")
    if search_ranks is not None:
        if search_ranks % cp:
            raise InputError(f"--search {search_ranks} ranks are not divisible by --cp {cp}; give a multiple")
        p, d = 1, search_ranks // cp
    virtual = 1
    if per_virtual is not None:
        if cfg.num_layers % (p * per_virtual):
            raise InputError(f"--num-layers-per-virtual-pipeline-stage {per_virtual} does not split "
                             f"{cfg.num_layers} layers over PP {p}; choose a divisor of num-layers / PP")
        virtual = cfg.num_layers // (p * per_virtual)
    base = ParallelShape(tp=t, pp=p, dp=d, cp=cp, virtual=virtual, micro_batch=micro_batch,
                  global_batch=global_batch or micro_batch * d, seq=seq,
                  sequence_parallel=cfg.sequence_parallel, recompute=recompute, schedule=schedule,
                  recompute_method=recompute_method, recompute_num_layers=recompute_num_layers,
                  distributed_optimizer=distributed_optimizer, overlap_grad_reduce=overlap_grad_reduce,
                  bucket_elements=bucket, ep=ep, etp=etp, cuda_graph=cuda_graph)
    ranks = search_ranks or t * p * d * cp
    if memory is None and device == "cpu":
        memory = machine_memory_bytes() / ranks         # the ranks of a CPU run share this machine
    if search_ranks is not None:
        if global_batch is None:
            base.global_batch = micro_batch * search_ranks // cp
        results = search(cfg, base, machine, search_ranks, memory)
        for result in results:
            add_run_length(result, base, train_iters, train_tokens)
        click.echo(json.dumps(results) if as_json else format_search(results))
    else:
        result = plan(cfg, base, machine, memory)
        add_run_length(result, base, train_iters, train_tokens)
        click.echo(json.dumps(result) if as_json else format_plan(result, cfg, machine))
    if device == "cpu" and device_memory is None and not as_json:
        click.echo(memory_note(machine, ranks))


#: What each GPU-only flag prices, for the sentence refusing it on a profile that cannot.
GPU_FLAGS = {"cuda_graph": "--cuda-graph prices a GPU step replayed as one graph",
             "tf32": "--tf32 prices float32 GEMMs on a GPU's tensor cores"}


def check_gpu_flags(machine, **given):
    """--cuda-graph and --tf32 change only a GPU profile's step (its measured "device" section,
    perf/device.py); any other profile would leave them out of the plan without a word."""
    if "device" in machine:
        return
    for name, flag_prices in GPU_FLAGS.items():
        if given.get(name):
            flag = "--" + name.replace("_", "-")
            raise InputError(f"{flag_prices}, but profile {machine['name']!r} has no GPU's measured rates (a "
                             f"\"device\" section) to price it with; use a GPU profile (e.g. --device gpu "
                             f"--profile h200) or drop {flag}")


def check_run_length(train_iters, train_tokens):
    if train_iters is not None and train_tokens is not None:
        raise InputError("--train-iters and --train-tokens both give the run's length; give one of the two")
    if train_iters is not None and train_iters < 1:
        raise InputError(f"--train-iters is {train_iters}; it must be a positive integer")
    if train_tokens is not None and not (train_tokens >= 1 and train_tokens < float("inf")):
        raise InputError(f"--train-tokens {train_tokens:g} is not a positive number of tokens; give e.g. 300e9")


def add_run_length(result, shape, train_iters, train_tokens):
    """A plan's "training" entry where the run's length was given (search's layouts share the
    rank count and global batch of `shape`)."""
    if train_iters or train_tokens:
        result["training"] = training_time(result, shape, train_iters, train_tokens)


def memory_note(machine, ranks):
    """Where a CPU run's memory and the step time come from, which a GPU profile's times and this
    machine's memory would otherwise leave unsaid."""
    gpu = not machine["ranks_share_flops"]      # a device per rank, not this machine shared
    return (f"(memory: this machine's {machine_memory_bytes() / GB:.1f} GB over {ranks} rank(s)"
            + ("; --device gpu judges each rank against the profile's device memory" if gpu else "")
            + f"; step time: profile {machine['name']}"
            + (", a GPU machine's: `npmegatron plan calibrate -o cpu.json` and --profile cpu.json time this one)"
               if gpu else ")"))


def machine_memory_bytes():
    """This machine's physical memory (Linux and macOS: the page size times the pages)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise InputError("this machine's memory is not known here; give --device-memory GB") from None


@plan_command.command("calibrate")
@click.option("--output", "-o", required=True, help="Profile JSON to write.")
@click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
              help="Profile this machine's CPU, or its GPU (GEMM rates by precision, copy bandwidth, launch and "
                   "host costs: the profile plan --device gpu reads).")
@click.option("--ranks", type=click.IntRange(min=2), default=2, show_default=True, help="bench comm ranks.")
@click.option("--max-bytes", type=click.IntRange(min=4096), default=2 ** 20, show_default=True,
              help="Largest bench comm message (from 1 KiB, by factors of 4).")
@click.option("--iters", type=click.IntRange(min=1), default=2, show_default=True, help="bench step timed steps.")
@user_errors
def calibrate_command(output, device, ranks, max_bytes, iters):
    """Write a profile of this machine: `bench step` (on the plan's model), `bench comm`, and the rates
    of plan's work model (GEMMs by shape, attention, memory-bound ops, AdamW, the engine), about 2 min."""
    parent = click.get_current_context().parent.params
    if parent.get("preset"):
        parent = {**parent, **MODEL_PRESETS[parent["preset"]]}
    model_args = []
    for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "dtype",
                 "seq_length", "micro_batch_size"):
        model_args += ["--" + name.replace("_", "-"), parent[name]]
    profile = calibrate(model_args + ["--warmup", 1, "--iters", iters], ranks, 1024, max_bytes, device)
    try:
        with open(output, "w", encoding="utf-8") as f:
            json.dump(profile, f, indent=2)
    except OSError as error:
        raise InputError(f"cannot write the profile {output} ({error.strerror}); choose another --output") from None
    rate = (f"GEMMs {', '.join(f'{p} {v[0][3]:.1f}' for p, v in profile['device']['gemm'].items())} TFLOP/s"
            if device == "gpu" else f"{profile['flops'] / 1e9:.2f} GFLOP/s model")
    click.echo(f"{output}: {rate}, links " + ", ".join(
        f"{op} alpha {v['alpha_s'] * 1e6:.1f} us beta {1 / v['beta_s_per_byte'] / 1e9 if v['beta_s_per_byte'] else float('inf'):.2f} GB/s"
        for op, v in profile["intra"].items()))
