"""The host's side of one eager training step on a GPU: how long Python takes to issue a step
against how long the step takes, and where that Python time goes (cProfile). Where the host
returns about when the GPU finishes, the step is bound by launching its kernels, not by running
them, and `--cuda-graph` (one launch a step) is the remedy; scripts/profile_gpu_step.py is the
GPU's side of the same step.

    python3 scripts/profile_gpu_host.py [--bf16|--fp16|--tf32] [--micro-batch-size 8] [--top 25]

The model is GPT-2 124M's shape (bench step's flags for another), run as `bench step` runs it: one
process, one micro-batch, AdamW. Three steps warm up, five are timed, three more are profiled.
"""
import argparse
import cProfile
import io
import pstats
import statistics
import time

from npmegatron.bench.step import assembled_run
from npmegatron.cli import bench_model_config
from npmegatron.training.step import setup_objects_frozen, train_step


def gpu_step_arguments(doc, top):
    """(arguments, GPTConfig) of the GPU profiling scripts (this one and profile_gpu_step.py):
    bench step's model flags at GPT-2 124M's shape, a precision and how many rows to print."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in (("num-layers", 12), ("hidden-size", 768), ("num-attention-heads", 12),
                          ("seq-length", 1024), ("vocab-size", 50304), ("micro-batch-size", 8), ("top", top)):
        parser.add_argument(f"--{name}", type=int, default=default)
    for flag in ("tf32", "bf16", "fp16"):
        parser.add_argument(f"--{flag}", action="store_true")
    args = parser.parse_args()
    options = {"num_layers": args.num_layers, "hidden_size": args.hidden_size, "dtype": "float32",
               "num_attention_heads": args.num_attention_heads, "vocab_size": args.vocab_size, "device": "gpu",
               "tf32": args.tf32, "fp16": args.fp16, "bf16": args.bf16, "seq_length": args.seq_length}
    return args, bench_model_config(options)


def main():
    args, cfg = gpu_step_arguments(__doc__, top=25)
    run, _, batch = assembled_run(cfg, args.micro_batch_size, args.seq_length)
    synchronize = run.model.xp.cuda.Device().synchronize

    def step():
        train_step(run.model, run.exchange, [batch], run.buckets, run.schedule)
        run.optimizer.step()

    with setup_objects_frozen():
        for _ in range(3):
            step()
        steps, issued = [], []
        for _ in range(5):
            synchronize()
            start = time.perf_counter()
            step()
            issued.append(time.perf_counter() - start)
            synchronize()
            steps.append(time.perf_counter() - start)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3):
            step()
        synchronize()
        profiler.disable()
    print(f"step {1e3 * statistics.median(steps):.1f} ms; the host has issued it after "
          f"{1e3 * statistics.median(issued):.1f} ms (medians of 5)")
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    print(f"{stats.total_calls / 3:,.0f} Python calls a step (3 steps profiled)")
    stats.sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())


if __name__ == "__main__":
    main()
