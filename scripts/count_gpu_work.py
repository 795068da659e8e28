"""What one training step asks of a GPU, counted on the strict CuPy stand-in (tests/fakes/strict_cupy):
kernel launches by kind and by autograd Function, cuBLAS calls with their dtypes, compute types
and transposes, the copies CuPy makes inside calls, host synchronisations, device bytes, the bytes
the kernels read and write (outside the GEMMs and attention's core too, by Function), and the
Python calls the host makes in the project's own code per step.

    python scripts/count_gpu_work.py                     # GPT-2 124M's layer shapes, float32
    python scripts/count_gpu_work.py --tf32 --hidden-dropout 0.1 --attention-dropout 0.1
    python scripts/count_gpu_work.py --bf16 --json out.json
    python scripts/count_gpu_work.py --model-family llama --num-query-groups 4
    python scripts/count_gpu_work.py --model-family llama --num-experts 8 --moe-router-topk 2

Per layer is the difference between a model of two layers and one of one layer, so it holds
for any depth; each count is of the second step (the first allocates what later steps reuse: the
gradients and the optimizer's state; a third step counts the same, for every flag the tests pass).
The Python calls are cProfile's call counts (primitive and recursive) of the functions in the
repository's files outside tests/ (so neither the stand-in, NumPy nor the standard library) during
that step's train_step, clip_after_step and optimizer step; at 12 layers they are extrapolated,
calls(1 layer) + 11 x (calls(2 layers) - calls(1 layer)) (--check-python-calls N profiles N
layers to compare).
No GPU is used: the stand-in computes with NumPy and records what CuPy would launch; its cudnn
stand-in stands for nvidia-cudnn-frontend, so attention is cuDNN's fused attention wherever a GPU
with the gpu extra would run it (--blockwise-attention counts the blockwise path there instead),
and its nvmath stand-in for nvmath-python, so GEMMs carry their epilogues (--no-epilogues counts
the kernels that take their place without the library).
"""
import argparse
import cProfile
import collections
import dataclasses
import json
import os
import pstats
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "fakes", "strict_cupy"))     # `import cupy` gets the stand-in
sys.path.insert(1, ROOT)

import cupy  # noqa: E402
import numpy  # noqa: E402

from npmegatron.autograd.memory import saved_bytes_by_function  # noqa: E402
from npmegatron.autograd import epilogues  # noqa: E402
from npmegatron.autograd.ops import fused_attention  # noqa: E402
from npmegatron.config import GPTConfig, TrainConfig  # noqa: E402
from npmegatron.run import assemble  # noqa: E402
from npmegatron.training.step import clip_after_step, setup_objects_frozen, train_step  # noqa: E402

STRICT = cupy._strict
ATTENTION_CORE = ("CausalAttention.", "PackedCausalAttention.", "FusedCausalAttention.",
                  "FusedGroupedCausalAttention.")
STEPS = 2
GPT2_LAYERS = 12


def count_step(cfg, batch, seq):
    """{phase: [Launch]} of the second step of `cfg` on the stand-in, and its memory and syncs; the
    optimizer step includes the Trainer's loss sum, gradient norm and clipping."""
    run = assemble(TrainConfig(model=cfg, seq_length=seq, micro_batch_size=batch, lr=1e-4, min_lr=0.0),
                   world_size=1)
    ids = numpy.random.default_rng(cfg.seed).integers(0, cfg.vocab_size, (batch, seq + 1))
    tokens = (ids[:, :-1], ids[:, 1:])     # host arrays, as the Trainer gives them: checked before the upload
    profiler = cProfile.Profile()
    with setup_objects_frozen():
        for step in range(STEPS):
            last = step == STEPS - 1
            if last:
                STRICT.reset()
                profiler.enable()       # the stand-in's own calls in between are under tests/: not counted
            loss_sum = train_step(run.model, run.exchange, [tokens], run.buckets, run.schedule)
            forward_backward, syncs = STRICT.launches(), STRICT.counters()["sync"]
            STRICT.reset()
            clip_after_step(run.model, run.params, loss_sum, run.norm_skip, 1.0, run.optimizer)
            run.optimizer.step()
            if last:
                profiler.disable()
    return {"forward_backward": forward_backward, "optimizer": STRICT.launches(),
            "syncs_forward_backward": syncs, "syncs_optimizer": STRICT.counters()["sync"],
            "peak_bytes": STRICT.memory()["peak_bytes"], "python_calls": project_calls(profiler)}


def project_calls(profiler):
    """{"file:line name": calls} of the functions in the repository's own files (not under tests/)
    that `profiler` saw called, calls being primitive and recursive ones (pstats' nc)."""
    calls = collections.Counter()
    for (file, line, name), (_, nc, _, _, _) in pstats.Stats(profiler).stats.items():
        path = os.path.abspath(file)     # built-ins ("~") and frozen modules have no path: not counted
        if os.path.isabs(file) and is_project_source(path):
            calls[f"{os.path.relpath(path, ROOT)}:{line} {name}"] += nc
    return calls


def is_project_source(path):
    """Whether `path` is one of the repository's own files outside tests/. A virtual environment made
    inside the checkout (CI's .venv-ci) is under the root too: its installed packages are not ours."""
    if not path.startswith(ROOT + os.sep):
        return False
    parts = os.path.relpath(path, ROOT).split(os.sep)
    return parts[0] != "tests" and "site-packages" not in parts and not os.path.exists(
        os.path.join(ROOT, parts[0], "pyvenv.cfg"))


def python_calls(cfg, batch, seq, layers):
    """Project Python calls in one step of the `layers`-layer model of `cfg`."""
    return sum(count_step(dataclasses.replace(cfg, num_layers=layers), batch, seq)["python_calls"].values())


def kept_for_backward(cfg, batch, seq):
    """(bytes the tape keeps for backward after one forward, parameters excluded, by Function;
    bytes of the parameters the forward reads)."""
    run = assemble(TrainConfig(model=cfg, seq_length=seq, micro_batch_size=batch, lr=1e-4, min_lr=0.0),
                   world_size=1)
    ids = numpy.random.default_rng(cfg.seed).integers(0, cfg.vocab_size, (batch, seq + 1))
    _, loss = run.model.chunks[0](ids[:, :-1], ids[:, 1:])     # PP 1: one chunk, the whole model
    params = [p.data for p in run.params]
    buffers = [p if p.base is None else p.base for p in params]      # views of the flat buffers on a GPU
    return saved_bytes_by_function([loss], exclude=buffers), sum(p.nbytes for p in params)


def summary(launches):
    """Counts of a list of Launch records; bytes are those the launches read plus those they write,
    all of them and those outside the GEMMs (kind "gemm") and attention's core (ATTENTION_CORE),
    the latter also by autograd Function."""
    gemms = [launch for launch in launches if launch.kind == "gemm"]
    rest = [launch for launch in launches if launch.kind != "gemm" and not launch.op.startswith(ATTENTION_CORE)]
    by_op = collections.Counter()
    for launch in rest:
        by_op[launch.op] += moved(launch)
    return {"launches": len(launches),
            "bytes": sum(map(moved, launches)),
            "bytes_outside_gemms_and_attention": sum(by_op.values()),
            "bytes_outside_gemms_and_attention_by_op": dict(by_op.most_common()),
            "by_kind": dict(collections.Counter(launch.kind for launch in launches)),
            "by_op": dict(collections.Counter(launch.op for launch in launches).most_common()),
            "hidden_copies": sum(1 for launch in launches if "hidden" in launch.fields),
            # GEMMs cupy.matmul/dot chose (upcasts, dtype as compute type) rather than autograd/gemm.py
            "gemms_through_cupy_matmul": sum(1 for launch in gemms if not launch.fields.get("direct")),
            "gemms": dict(collections.Counter(_gemm_key(launch) for launch in gemms).most_common())}


def moved(launch):
    """The bytes a launch reads and writes (a CUDA graph's launch: none of its own)."""
    return launch.fields.get("read_bytes", 0) + launch.fields.get("written_bytes", 0)


def _gemm_key(launch):
    f = launch.fields
    return (f"{f['routine']} {f['a']}x{f['b']}->{f['c']} compute {f['compute']} {f['transa']}{f['transb']} "
            f"m={f['m']} n={f['n']} k={f['k']}" + (f" batch={f['batch']}" if f["batch"] > 1 else "")
            + (f" epilogue {f['epilogue']}" if f.get("epilogue") else ""))


def difference(two, one, by_sizes=True):
    """Launches of the second layer: those of the 2-layer model minus those of the 1-layer one,
    per (kind, op, name, fields) (the records of one layer are alike in both models). by_sizes
    False: what is left is then matched by (kind, op, name) alone, for layers whose sizes follow
    their input (an MoE layer's grouped GEMMs are as wide as its busiest expert's block)."""
    remaining = collections.Counter(_identity(launch) for launch in one)
    extra = []
    for launch in two:
        key = _identity(launch)
        if remaining[key]:
            remaining[key] -= 1
        else:
            extra.append(launch)
    if by_sizes:
        return extra
    loose = collections.Counter()
    for key, n in remaining.items():
        loose[key[:3]] += n
    unmatched = []
    for launch in extra:
        if loose[_identity(launch)[:3]]:
            loose[_identity(launch)[:3]] -= 1
        else:
            unmatched.append(launch)
    return unmatched


def _identity(launch):
    return launch.kind, launch.op, launch.name, json.dumps(launch.fields, sort_keys=True, default=str)


def measure(cfg, batch, seq, check_depth=False, check_python_calls=None):
    """The counts per layer, for the rest of the model, for the optimizer step and per step;
    with check_depth, also whether a third layer adds the same launches as the second; with
    check_python_calls (a depth), also that model's Python calls per step, measured."""
    one = count_step(dataclasses.replace(cfg, num_layers=1), batch, seq)
    two = count_step(dataclasses.replace(cfg, num_layers=2), batch, seq)
    by_sizes = not cfg.num_experts
    layer = difference(two["forward_backward"], one["forward_backward"], by_sizes)
    same_at_depth_3 = None
    if check_depth:
        three = count_step(dataclasses.replace(cfg, num_layers=3), batch, seq)
        third = difference(three["forward_backward"], two["forward_backward"], by_sizes)
        same_at_depth_3 = sorted(map(_identity, third)) == sorted(map(_identity, layer))
    kept_one, _ = kept_for_backward(dataclasses.replace(cfg, num_layers=1), batch, seq)
    kept_two, param_bytes = kept_for_backward(dataclasses.replace(cfg, num_layers=2), batch, seq)
    kept_layer = {name: kept_two.get(name, 0) - kept_one.get(name, 0) for name in kept_two}
    core = [launch for launch in layer if launch.op.startswith(ATTENTION_CORE)]
    rest = [launch for launch in layer if not launch.op.startswith(ATTENTION_CORE)]
    calls_one, calls_two = one["python_calls"], two["python_calls"]
    calls_layer = collections.Counter({key: calls_two[key] - calls_one[key] for key in calls_two})
    per_layer = sum(calls_two.values()) - sum(calls_one.values())
    outside_calls = sum(calls_one.values()) - per_layer
    calls = {"per_layer": per_layer, "outside_layers": outside_calls,
             "one_layer": sum(calls_one.values()), "two_layers": sum(calls_two.values()),
             "per_step_12_layers": outside_calls + GPT2_LAYERS * per_layer,
             "per_layer_top_25": {key: n for key, n in calls_layer.most_common(25) if n}}
    if check_python_calls:
        calls["measured_at_depth"] = {"layers": check_python_calls,
                                      "measured": python_calls(cfg, batch, seq, check_python_calls),
                                      "extrapolated": outside_calls + check_python_calls * per_layer}
    # the first layer's own launches that differ from a later layer's (its input's gradient meets
    # the embedding's, not a residual add's) are the one-layer model's left over: counted outside
    outside = difference(one["forward_backward"], layer, by_sizes)
    layer_summary, outside_summary, optimizer_summary = summary(layer), summary(outside), summary(two["optimizer"])
    return {"config": {"hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
                       "seq_length": seq, "vocab_size": cfg.vocab_size, "micro_batch_size": batch,
                       "dtype": cfg.dtype, "tf32": cfg.tf32, "storage": cfg.storage_format,
                       "hidden_dropout": cfg.hidden_dropout, "attention_dropout": cfg.attention_dropout,
                       "num_experts": cfg.num_experts, "moe_router_topk": cfg.moe_router_topk},
            "layer": layer_summary, "layer_attention_core": summary(core), "layer_without_attention_core": summary(rest),
            "outside_layers": outside_summary, "optimizer_step": optimizer_summary,
            "step_two_layers": summary(two["forward_backward"] + two["optimizer"]),
            "step_one_layer": summary(one["forward_backward"] + one["optimizer"]),
            "optimizer_step_one_layer": summary(one["optimizer"]),
            "syncs_per_step": two["syncs_forward_backward"] + two["syncs_optimizer"],
            "third_layer_adds_the_same_launches": same_at_depth_3,
            "peak_bytes_two_layers": two["peak_bytes"],
            "kept_for_backward_per_layer": sum(kept_layer.values()),
            "kept_for_backward_per_layer_by_function": {k: v for k, v in kept_layer.items() if v},
            "kept_for_backward_two_layers": sum(kept_two.values()),
            "parameter_bytes_two_layers": param_bytes,
            "python_calls": calls, "python_calls_per_step_12_layers": calls["per_step_12_layers"]}


def format_report(result):
    c = result["config"]
    lines = [f"hidden {c['hidden_size']}, {c['num_attention_heads']} heads, seq {c['seq_length']}, vocab "
             f"{c['vocab_size']}, micro-batch {c['micro_batch_size']}; {c['dtype']}"
             f"{' --tf32' if c['tf32'] else ''}{' --' + c['storage'] if c['storage'] else ''}, dropout "
             f"{c['hidden_dropout']}/{c['attention_dropout']}"
             + (f"; MoE layers of {c['num_experts']} experts, top {c['moe_router_topk']}" if c["num_experts"] else "")
             + "; TP 1, on the strict CuPy stand-in", "",
             f"{'':<42}{'launches':>9}{'GEMMs':>7}{'hidden copies':>15}{'bytes':>15}{'bytes outside':>15}"]
    for label, key in (("per layer, forward + backward", "layer"), ("  attention's core", "layer_attention_core"),
                       ("  the rest of the layer", "layer_without_attention_core"),
                       ("embedding, final LayerNorm, head, loss", "outside_layers"),
                       ("optimizer step", "optimizer_step"), ("whole step, 2 layers", "step_two_layers")):
        s = result[key]
        lines.append(f"{label:<42}{s['launches']:>9}{s['by_kind'].get('gemm', 0):>7}{s['hidden_copies']:>15}"
                     f"{s['bytes']:>15,}{s['bytes_outside_gemms_and_attention']:>15,}")
    calls = result["python_calls"]
    lines += ["(bytes: read + written by the launches; outside: outside the GEMMs and attention's core; the row "
              "outside the layers also holds the first layer's launches that differ from a later layer's)",
              f"host synchronisations per step: {result['syncs_per_step']}",
              f"peak device bytes (2 layers): {result['peak_bytes_two_layers']:,}",
              f"bytes kept for backward (parameters excluded): {result['kept_for_backward_per_layer']:,} per "
              f"layer, {result['kept_for_backward_two_layers']:,} for the 2-layer model; by Function, per layer: "
              + ", ".join(f"{k} {v:,}" for k, v in result["kept_for_backward_per_layer_by_function"].items()),
              f"bytes of the parameters forward reads (2 layers): {result['parameter_bytes_two_layers']:,}", "",
              "the rest of the layer, by kind: " + ", ".join(f"{k} {n}" for k, n in
                                                            result["layer_without_attention_core"]["by_kind"].items()),
              "", "launches per layer by autograd Function (attention's core included):"]
    lines += [f"  {n:>5}  {op}" for op, n in result["layer"]["by_op"].items()]
    lines += ["", "bytes read + written per layer outside the GEMMs and attention's core, by autograd Function:"]
    lines += [f"  {n:>13,}  {op}" for op, n in result["layer"]["bytes_outside_gemms_and_attention_by_op"].items()]
    lines += ["", f"project Python calls per step: {calls['one_layer']:,} at 1 layer, {calls['two_layers']:,} at 2 "
              f"layers: {calls['per_layer']:,} per layer, {calls['outside_layers']:,} outside the layers"]
    if "measured_at_depth" in calls:
        depth = calls["measured_at_depth"]
        lines.append(f"project Python calls per step at {depth['layers']} layers, measured: {depth['measured']:,} "
                     f"(extrapolated: {depth['extrapolated']:,})")
    lines += [f"project Python calls per step at {GPT2_LAYERS} layers: {result['python_calls_per_step_12_layers']}",
              "", "project Python calls per layer, the most called functions:"]
    lines += [f"  {n:>7,}  {key}" for key, n in calls["per_layer_top_25"].items()]
    lines += ["", "cuBLAS calls per layer:"] + [f"  {n:>5}  {key}" for key, n in result["layer"]["gemms"].items()]
    lines += ["", "cuBLAS calls outside the layers:"]
    lines += [f"  {n:>5}  {key}" for key, n in result["outside_layers"]["gemms"].items()]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-attention-heads", type=int, default=12)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=50304)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--hidden-dropout", type=float, default=0.0)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--model-family", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--num-query-groups", type=int, default=None,
                        help="grouped-query attention's key/value heads (default: one per query head)")
    parser.add_argument("--num-experts", type=int, default=None, help="every layer an MoE layer of this many "
                        "experts (each the family's MLP at --ffn-hidden-size)")
    parser.add_argument("--moe-router-topk", type=int, default=2)
    parser.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None)
    for flag in ("--tf32", "--fp16", "--bf16"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--blockwise-attention", action="store_true", help="count the blockwise attention "
                        "where cuDNN's fused attention would run (the cudnn stand-in is on the path)")
    parser.add_argument("--no-epilogues", action="store_true", help="count the bias and GeLU kernels where "
                        "cuBLASLt's GEMM epilogues would run (the nvmath stand-in is on the path)")
    parser.add_argument("--json", metavar="FILE", help="also write the counts as JSON")
    parser.add_argument("--check-depth", action="store_true", help="also count a 3-layer model: its third "
                        "layer must add the launches of the second")
    parser.add_argument("--check-python-calls", type=int, metavar="LAYERS", help="also profile a model of LAYERS "
                        "layers: its project Python calls per step, measured beside the extrapolation")
    args = parser.parse_args(argv)
    if args.blockwise_attention:
        fused_attention.FUSED_ATTENTION = "never"
    if args.no_epilogues:
        epilogues.EPILOGUES = "never"
    cfg = GPTConfig(num_layers=1, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                    vocab_size=args.vocab_size, max_position_embeddings=args.seq_length, dtype=args.dtype,
                    hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                    tf32=args.tf32, fp16=args.fp16, bf16=args.bf16, device="gpu", model_family=args.model_family,
                    group_query_attention=args.num_query_groups is not None,
                    num_query_groups=args.num_query_groups, num_experts=args.num_experts,
                    moe_router_topk=args.moe_router_topk, moe_router_dtype=args.moe_router_dtype)
    result = measure(cfg, args.micro_batch_size, args.seq_length, args.check_depth, args.check_python_calls)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
