"""`npmegatron plan calibrate --device gpu`: the card's rates for plan's GPU model (perf/device.py, a
profile's "device" section), measured in this process on the device (copies, a CUDA graph of tiny
kernels) and through `npmegatron bench step` in subprocesses (TF32 is process-wide once on):

- GEMMs: the model's own GEMMs timed alone by bench step's rounds, their FLOP/s in each precision
  (float32, TF32, bfloat16, float16), one point a precision at the model's MLP shape;
- bandwidth: what a device-to-device copy reads and writes a second, by the bytes of the array
  (up to 1 GiB, or what half the card's free memory holds twice);
- launch_gap_s: a replayed graph's seconds per kernel, kernels that do next to nothing;
- the host: seconds a layer and a micro-batch of a tiny model's eager step, which waits only for
  the host to issue its kernels, by precision.
Every time is the best of a few after a warm-up, the device synchronised around it."""
import time

from ...autograd import InputError
from ...perf.fit import size

COPY_BYTES = (1 << 22, 1 << 24, 1 << 26, 1 << 28, 1 << 30)
#: The share of the card's free memory a copy's source and target may take together: the rest is
#: headroom for CuPy's pool, cuBLAS's workspace and whatever else the card is running.
COPY_MEMORY_SHARE = 0.5
GRAPH_KERNELS = 256
PRECISION_FLAGS = {"fp32": [], "tf32": ["--tf32"], "bf16": ["--bf16"], "fp16": ["--fp16"]}
TINY = ["--hidden-size", 64, "--num-attention-heads", 1, "--seq-length", 64, "--micro-batch-size", 1,
        "--vocab-size", 256]


def best_seconds(xp, run, repeats=5):
    run()                                   # warm: kernels compiled, memory pooled
    xp.cuda.Device().synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        xp.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def copy_sizes(xp, sizes=None):
    """The array bytes of COPY_BYTES (or `sizes`) whose copy, source and target, fits in
    COPY_MEMORY_SHARE of the card's free memory: a smaller or busier card measures fewer sizes
    instead of running out of memory."""
    sizes = sizes or COPY_BYTES
    free = xp.cuda.runtime.memGetInfo()[0]
    fitting = [nbytes for nbytes in sizes if 2 * nbytes <= COPY_MEMORY_SHARE * free]
    if not fitting:
        need = 2 * min(sizes) / COPY_MEMORY_SHARE
        raise InputError(f"GPU {xp.cuda.Device().id} has {size(free)} free, but measuring its copy bandwidth "
                         f"needs {size(need)} (two arrays of {size(min(sizes))} and as much again spare); end what "
                         "else holds the card's memory and calibrate again")
    return fitting


def copy_bandwidth(xp, sizes=None):
    """{"bytes", "bytes_per_s"}: bytes a device copy reads and writes a second, by array bytes
    (those of COPY_BYTES the card's free memory holds, unless `sizes` is given)."""
    sizes, rates = sizes or copy_sizes(xp), []
    for nbytes in sizes:
        source = xp.ones(nbytes // 4, xp.float32)
        target = xp.empty_like(source)
        rates.append(2 * nbytes / best_seconds(xp, lambda: xp.copyto(target, source)))
    return {"bytes": list(sizes), "bytes_per_s": rates}


def launch_gap(xp, kernels=None):
    """Seconds per kernel of a replayed CUDA graph of `kernels` (GRAPH_KERNELS) one-element adds."""
    kernels = kernels or GRAPH_KERNELS
    x = xp.zeros(1, xp.float32)
    stream = xp.cuda.Stream(non_blocking=True)
    with stream:
        x += 1                              # compiled before the capture
        stream.synchronize()
        stream.begin_capture()
        for _ in range(kernels):
            x += 1
        graph = stream.end_capture()
    return best_seconds(xp, lambda: graph.launch(stream)) / kernels


def gemm_points(runner, model_args):
    """{precision: [[M, N, K, TFLOP/s]]}: bench step's GEMM rounds on the model in each precision, at
    its MLP's first GEMM in cuBLAS's terms (M the 4h output columns, N the tokens, K the hidden size)."""
    points = {}
    for precision, flags in PRECISION_FLAGS.items():
        step = runner(["step", "--device", "gpu", "--no-torch"] + list(model_args) + flags)
        h, tokens = step["hidden_size"], step["micro_batch_size"] * step["seq_length"]
        points[precision] = [[4 * h, tokens, h, step["gemm_flops_per_s"] / 1e12]]
    return points


def host_seconds(runner):
    """({precision: seconds a layer}, {precision: seconds a micro-batch}) of the host issuing an
    eager step: a tiny model's with 1 and with 5 layers, whose kernels take no time."""
    per_layer, per_micro_batch = {}, {}
    for precision, flags in PRECISION_FLAGS.items():
        one, five = (runner(["step", "--device", "gpu", "--no-torch", "--num-layers", layers] + TINY + flags
                            + ["--warmup", 2, "--iters", 5])["step_s"] for layers in (1, 5))
        per_layer[precision] = max(0.0, (five - one) / 4)
        per_micro_batch[precision] = max(0.0, one - per_layer[precision])
    return per_layer, per_micro_batch


def measure_device(xp, runner, model_args):
    """The profile's "device" section, measured on the current GPU (the copies' sizes chosen
    first, so a card without room for any is told before minutes of benchmarks)."""
    sizes = copy_sizes(xp)
    per_layer, per_micro_batch = host_seconds(runner)
    return {"gemm": gemm_points(runner, model_args), "bandwidth": copy_bandwidth(xp, sizes),
            "launch_gap_s": launch_gap(xp), "host_s_per_layer": per_layer,
            "host_s_per_micro_batch": per_micro_batch}
