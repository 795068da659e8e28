"""The kernels of one `bench step` training step on a GPU, by total time: where a step's GPU time
goes. PyTorch's profiler reads CUDA's activity records (CUPTI) for the whole process, CuPy's
kernels and cuBLAS calls included; PyTorch is an optional peer here, not a dependency.

    python3 scripts/profile_gpu_step.py [--bf16|--fp16|--tf32] [--micro-batch-size 8] [--top 40]

The model is GPT-2 124M's shape (bench step's flags for another); the third step is profiled,
from its forward to the end of its optimizer step.
"""
import argparse

import cupy
from torch.profiler import ProfilerActivity, profile

import npmegatron.bench.step as bench
from npmegatron.cli import bench_model_config


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("num-layers", 12), ("hidden-size", 768), ("num-attention-heads", 12),
                          ("seq-length", 1024), ("vocab-size", 50304), ("micro-batch-size", 8), ("top", 40)):
        parser.add_argument(f"--{name}", type=int, default=default)
    for flag in ("tf32", "bf16", "fp16"):
        parser.add_argument(f"--{flag}", action="store_true")
    args = parser.parse_args()
    profiler = profile(activities=[ProfilerActivity.CUDA])
    state = {"steps": 0, "on": False}
    train_step, gemm_round = bench.train_step, bench.GemmCeiling.round

    def profiled_step(*a, **k):
        state["steps"] += 1
        if state["steps"] == 3:
            profiler.start()
            state["on"] = True
        return train_step(*a, **k)

    def round_after(self):          # the optimizer step has ended (bench step synchronised)
        if state["on"]:
            cupy.cuda.Device().synchronize()
            profiler.stop()
            state["on"] = False
        return gemm_round(self)

    bench.train_step, bench.GemmCeiling.round = profiled_step, round_after
    options = {"num_layers": args.num_layers, "hidden_size": args.hidden_size, "dtype": "float32",
               "num_attention_heads": args.num_attention_heads, "vocab_size": args.vocab_size, "device": "gpu",
               "tf32": args.tf32, "fp16": args.fp16, "bf16": args.bf16, "seq_length": args.seq_length}
    bench.bench_step(bench_model_config(options), args.micro_batch_size, args.seq_length, warmup=2, iters=1)
    kernels = [e for e in profiler.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels)
    print(f"{sum(e.count for e in kernels)} kernels, {total / 1e3:.1f} ms of kernel time in one step")
    for e in kernels[:args.top]:
        print(f"{e.self_device_time_total / 1e3:8.2f} ms {e.count:6d}x  {e.key[:110]}")


if __name__ == "__main__":
    main()
