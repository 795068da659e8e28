"""The dense peak FLOP/s of the GPUs people train on, by precision, from NVIDIA's datasheets
(figures quoted "with sparsity" halved): the denominator of model-FLOP utilisation (MFU) in
`bench step` and `train`'s log, beside the GEMM ceiling measured in the same run."""
import time

import numpy

#: (substring of the device name, {precision: dense TFLOP/s}); the first match wins, so a more
#: specific name comes before a shorter one ("H100 PCIe" before "H100").
PEAK_TFLOPS = [
    ("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    ("H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0}),
    ("H100", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),          # SXM5
    ("H200", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),          # SXM
    ("H20", {"fp32": 44.0, "tf32": 74.0, "bf16": 148.0, "fp16": 148.0}),
    ("B200", {"fp32": 80.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0}),
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    ("A10G", {"fp32": 31.2, "tf32": 35.0, "bf16": 70.0, "fp16": 70.0}),
    ("A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    ("L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0}),
    ("L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    ("V100", {"fp32": 15.7, "tf32": 15.7, "fp16": 125.0}),                           # SXM2; no TF32, no bf16
]


def precision_of(cfg):
    """The precision a run's GEMMs use: "bf16", "fp16", "tf32", "fp32" or "fp64"."""
    if cfg.storage_format:
        return cfg.storage_format
    if cfg.dtype == "float64":
        return "fp64"
    return "tf32" if cfg.tf32 else "fp32"


def peak_flops(device_name, precision):
    """The device's dense peak FLOP/s at this precision, or None where the table has no entry."""
    for name, peaks in PEAK_TFLOPS:
        if name.lower() in device_name.lower():
            tflops = peaks.get(precision)
            return None if tflops is None else tflops * 1e12
    return None


def device_name(xp):
    """The GPU's name as CUDA gives it, or "cpu"."""
    if xp is numpy:
        return "cpu"
    name = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def measured_gemm_flops(xp, dtype, n=1024, repeats=3):
    """FLOP/s of an n x n x n matrix product on this device, the best of `repeats`: the CPU's peak
    for model-FLOP utilisation, measured when a run starts (DESIGN: the machine's own ceiling)."""
    a, b = xp.full((n, n), 0.5, dtype), xp.full((n, n), 0.25, dtype)
    best = float("inf")
    for _ in range(repeats + 1):            # the first warms BLAS's threads and the pages
        if xp is not numpy:
            xp.cuda.get_current_stream().synchronize()
        start = time.perf_counter()
        a @ b
        if xp is not numpy:
            xp.cuda.get_current_stream().synchronize()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best
