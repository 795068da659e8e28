"""The kernels of one `bench step` training step on a GPU, by total time: where a step's GPU time
goes. PyTorch's profiler reads CUDA's activity records (CUPTI) for the whole process, CuPy's
kernels and cuBLAS calls included; PyTorch is an optional peer here, not a dependency.

    python3 scripts/profile_gpu_step.py [--bf16|--fp16|--tf32] [--micro-batch-size 8] [--top 40]

The model is GPT-2 124M's shape (bench step's flags for another); the third step is profiled,
from its forward to the end of its optimizer step.
"""
import cupy
from torch.profiler import ProfilerActivity, profile

import npmegatron.bench.step as bench
from profile_gpu_host import gpu_step_arguments     # scripts/, the folder this script runs from


def main():
    args, cfg = gpu_step_arguments(__doc__, top=40)
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
    bench.bench_step(cfg, args.micro_batch_size, args.seq_length, warmup=2, iters=1)
    kernels = [e for e in profiler.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels)
    print(f"{sum(e.count for e in kernels)} kernels, {total / 1e3:.1f} ms of kernel time in one step")
    for e in kernels[:args.top]:
        print(f"{e.self_device_time_total / 1e3:8.2f} ms {e.count:6d}x  {e.key[:110]}")


if __name__ == "__main__":
    main()
