"""`npmegatron plan calibrate`: a profile of this machine from its own benchmarks.

flops: the model FLOP/s of `npmegatron bench step` (a whole forward + backward + update, not the
GEMM ceiling), with every core and, on a multi-core CPU, with one BLAS thread (flops_by_threads). Links: `npmegatron bench comm` on `ranks` processes, each collective's times over
message sizes fitted by least squares to t = A + B S (relative error, bench comm's fit), then
turned into the ring model's per-step parameters: all-reduce alpha = A / (2(p-1)), beta =
B p / (2(p-1)); all-gather and reduce-scatter alpha = A / (p-1), beta = B p / (p-1); send/recv
alpha = A, beta = B. One machine has no network: "inter" repeats "intra".
On a CPU, "measured" holds the rates of plan's work model (measure.py) with one thread and
with every core: GEMMs by shape, attention per score, memory bandwidth and the engine's cost.
With --device gpu the profile is a GPU's (perf/device.py): "device" holds the card's rates
(measure_gpu.py), peak_flops the datasheet's for its name.
Both benchmarks run as subprocesses (bench comm relaunches itself under mpiexec) and are parsed
from the JSON line they print last.
"""
import json
import os
import subprocess
import sys

from ... import comm
from ...autograd import InputError
from ...autograd.backend import array_module_for
from ...perf.peaks import device_name, peak_flops
from ..comm import alpha_beta_fit
from .measure import measure, sharing_factor
from .measure_gpu import measure_device


def run_bench(args, threads=None):
    """The JSON object printed last by `npmegatron bench ARGS` (with `threads` BLAS threads)."""
    command = [sys.executable, "-m", "npmegatron.cli", "bench"] + [str(a) for a in args]
    env = dict(os.environ, **(comm.blas_thread_environment(threads) if threads is not None else {}))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise InputError(f"`npmegatron bench {' '.join(map(str, args))}` failed ({tail[0]}); run it "
                         "alone to see why")
    return json.loads(lines[-1])


def link_parameters(op, p, alpha_fit, beta_fit):
    steps = {"all_reduce": 2 * (p - 1), "all_gather": p - 1, "reduce_scatter": p - 1, "sendrecv": 1}[op]
    share = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p,
             "sendrecv": 1.0}[op]
    return {"alpha_s": max(0.0, alpha_fit / steps), "beta_s_per_byte": max(0.0, beta_fit / share)}


def physical_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def measured_links(runner, ranks, min_bytes, max_bytes, device):
    """(ranks, {collective: link parameters}) from bench comm on `ranks` processes."""
    comm = runner(["comm", "--ranks", ranks, "--min-bytes", min_bytes, "--max-bytes", max_bytes,
                   "--device", device])
    links = {}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "sendrecv"):
        rows = [r for r in comm["table"] if r["op"] == op]
        if len(rows) < 2:
            raise InputError(f"bench comm measured {len(rows)} message size(s) for {op}; widen "
                             "--min-bytes .. --max-bytes to at least two sizes (a factor of 4)")
        alpha, beta = alpha_beta_fit([r["bytes"] for r in rows], [r["seconds"] for r in rows])
        links[op] = link_parameters(op, comm["ranks"], alpha, beta)
    return comm["ranks"], links


def calibrate_gpu(model_args, ranks, min_bytes, max_bytes, runner, xp=None):
    """A GPU profile (perf/device.py) of the card this process sees: its rates (measure_gpu.py),
    the datasheet's peaks for its name (perf/peaks.py), its memory, and the links bench comm measures
    between `ranks` processes on this machine (inter = intra)."""
    xp = xp or array_module_for("gpu")
    name = device_name(xp)
    device = measure_device(xp, runner, model_args)
    p, links = measured_links(runner, ranks, min_bytes, max_bytes, "gpu")
    peaks = {precision: peak_flops(name, precision) for precision in device["gemm"]}
    peaks = {precision: peak for precision, peak in peaks.items() if peak}      # a card peaks.py does not list: none
    return {
        "name": f"calibrated-{name.replace(' ', '-')}",
        "description": (f"npmegatron plan calibrate --device gpu on {name}: device = its GEMM rates by precision "
                        "(bench step's rounds on the model), copy bandwidth, a graph's gap per kernel and the host's "
                        "time to issue an eager step (perf/device.py); peak_flops from perf/peaks.py; links fitted "
                        f"from bench comm on {p} ranks; inter = intra (one machine)."),
        "device": device, "devices_per_node": xp.cuda.runtime.getDeviceCount(),
        "device_memory_bytes": xp.cuda.runtime.memGetInfo()[1],
        "dp_overlap": 1.0, "intra": links, "inter": links,
    } | ({"peak_flops": peaks} if peaks else {})


def calibrate(model_args, ranks=2, min_bytes=1024, max_bytes=2 ** 20, device="cpu", runner=None):
    runner = runner or run_bench
    if device == "gpu":
        return calibrate_gpu(model_args, ranks, min_bytes, max_bytes, runner)
    step = runner(["step"] + list(model_args))
    cores = (os.cpu_count() or 1) if device == "cpu" else 1
    # On a CPU, ranks split the cores: a layout of R ranks gives each cores / R BLAS threads, and
    # one thread runs the step's single-threaded elementwise work as fast as all of them do, so
    # the one-thread rate is measured too (time_model.rank_flops).
    by_threads = {str(cores): step["model_flops_per_s"]}
    if cores > 1:
        by_threads["1"] = runner(["step"] + list(model_args), threads=1)["model_flops_per_s"]
    measured = {str(n): measure(n, step["dtype"]) for n in sorted({1, cores})} if device == "cpu" else {}
    p, links = measured_links(runner, ranks, min_bytes, max_bytes, device)
    return {
        "name": f"calibrated-{os.uname().nodename}",
        "description": (f"npmegatron plan calibrate: flops = bench step's model FLOP/s ({step['dtype']}, "
                        f"{step['num_layers']} layers, hidden {step['hidden_size']}, micro-batch "
                        f"{step['micro_batch_size']} x {step['seq_length']}, {step['device']}); links "
                        f"fitted from bench comm on {p} ranks; inter = intra (one machine)."),
        "flops": step["model_flops_per_s"], "gemm_flops": step["gemm_flops_per_s"],
        "flops_recompute": "none",
        "devices_per_node": cores,
        "ranks_share_flops": device == "cpu",      # the layout's ranks split this machine
        "flops_by_threads": by_threads,
        "device_memory_bytes": physical_memory(),
        "dp_overlap": 1.0, "intra": links, "inter": links,
    } | ({"measured": {"threads": measured, "sharing_factor": sharing_factor(cores)}}
         if measured and all(measured.values()) else {})
