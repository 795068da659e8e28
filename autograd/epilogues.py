"""GEMMs whose cuBLASLt epilogues add a Linear's bias, apply GeLU (keeping its input for backward)
or apply GeLU's derivative, through nvmath-python's stateful `Matmul` (the gpu extra), for a GPU's
16-bit arrays under --bf16/--fp16.

Where an epilogue runs, the bias add and GeLU are no kernels of their own and their operands make
no trip through memory: the GEMM adds the bias and applies GeLU (or multiplies by its derivative)
to its float32 sums and rounds as it stores, the same numbers as the GEMM's float32 result followed
by sixteen_bit_kernels.py's kernels, which run where nvmath-python is not installed or a shape is
not one the epilogue takes (takes()). cuBLASLt adds a bias along a result's rows and writes such a
result column-major, so x W + b, x of N rows, is computed as its transpose W^T x^T + b, (M, N)
column-major: in memory that is the row-major (N, M) result, handed on as a C-ordered view.

A plan (nvmath's Matmul and its plan(): cuBLASLt's heuristic choice of an algorithm) is made once
per operand layout, epilogue and stream and given new operands each call (reset_operands), as
gemm.py keeps a plan per layout; it lets go of them once it has run (release_operands), so a plan
holds no activation alive. A layout whose plan the library refuses (cuBLASLt has no algorithm for
it on this GPU, or nvmath-python does not take these arrays) is remembered in `unsupported` and
its callers run the kernels instead."""
import numpy

from . import gemm, precision
from .backend import get_array_module

#: (id of the loaded CuPy module) -> nvmath.linalg.advanced, or None where it does not import
_libraries = {}
#: (epilogue, operand layouts and alignments, device, stream) -> nvmath Matmul, planned
_plans = {}
MAX_PLANS = 256
#: plan key -> why the library refused to plan it (its error), for the callers' fallback
unsupported = {}
#: "auto": the epilogues wherever nvmath-python loads; "never": the kernels (the same numbers)
EPILOGUES = "auto"
#: GeLU's auxiliary output (its input, kept for backward) has a leading dimension of a multiple of 8
AUX_ALIGNMENT = 8


def library(xp):
    """nvmath-python's `linalg.advanced` for CuPy module xp, or None where it does not import
    (asked once per loaded CuPy; NumPy has none)."""
    if xp is numpy:
        return None
    key = id(xp)
    if key not in _libraries:
        try:
            from nvmath.linalg import advanced
            _libraries[key] = advanced
        except Exception:           # not installed, or its CUDA libraries do not load
            _libraries[key] = None
    return _libraries[key]


def takes(x, w, b, fmt, gelu=False):
    """Whether the epilogue GEMMs take x @ w + b (with gelu, GeLU of it): device arrays where
    nvmath-python loads; x fmt's 16-bit with C-ordered rows, w 2-D fmt's 16-bit with unit stride
    in one dimension, b None or fmt's 16-bit of w's columns, unit stride; with gelu, w's columns a
    multiple of AUX_ALIGNMENT (the auxiliary output's leading dimension, the result's)."""
    xp = get_array_module(x)
    if EPILOGUES == "never" or fmt is None or library(xp) is None or x.size == 0 or w.ndim != 2:
        return False
    if any(precision.format_of(a.dtype) != fmt for a in (x, w) + (() if b is None else (b,))):
        return False
    if not x.flags.c_contiguous or (w.strides[0] != w.itemsize and w.strides[1] != w.itemsize):
        return False
    if b is not None and (b.shape != w.shape[1:] or b.strides != (b.itemsize,)):
        return False
    return not gelu or w.shape[1] % AUX_ALIGNMENT == 0


def linear_bias(x, w, b):
    """x @ w + b (x (..., k) 16-bit, w (k, m), b (m,)) in one GEMM, 16-bit, C-ordered; None where
    the library refuses the layout (nothing computed)."""
    rows = gemm.rows(x)
    out = _run("BIAS", w.T, rows.T, {"bias": b})
    return None if out is None else out.T.reshape(x.shape[:-1] + w.shape[-1:])


def linear_bias_gelu(x, w, b):
    """(gelu(x @ w + b), x @ w + b), both 16-bit and C-ordered, in one GEMM: the MLP's first
    layer's output and the input to GeLU that its backward reads (cuBLASLt's GELU_AUX_BIAS); None
    where the library refuses the layout."""
    rows = gemm.rows(x)
    result = _run("GELU_AUX_BIAS", w.T, rows.T, {"bias": b})
    if result is None:
        return None
    out, aux = result
    shape = x.shape[:-1] + w.shape[-1:]
    return out.T.reshape(shape), aux["gelu_aux"].T.reshape(shape)


def gelu_input_grad(g, w, aux):
    """(g @ w.T) * gelu'(aux), 16-bit and C-ordered, in one GEMM (cuBLASLt's DGELU): the MLP's
    second layer's data gradient carried through GeLU. g (..., n) 16-bit, w (m, n), aux (..., m)
    the 16-bit input to GeLU that linear_bias_gelu kept; None where the library refuses the layout."""
    rows = gemm.rows(g)
    out = _run("DGELU", w, rows.T, {"gelu_aux": gemm.rows(aux).T})
    return None if out is None else out.T.reshape(g.shape[:-1] + w.shape[:1])


def _run(epilog, a, b, inputs):
    """a @ b with cuBLASLt's epilogue `epilog` on the current stream, by the cached plan of these
    layouts (made on first use, given these operands after); returns what execute() returns, or
    None where the library refuses to plan these layouts (remembered in `unsupported`)."""
    xp = get_array_module(a)
    advanced = library(xp)
    stream = xp.cuda.get_current_stream()
    operands = (a, b) + tuple(inputs.values())
    key = (epilog, stream.ptr, xp.cuda.Device().id, tuple(inputs)) + tuple(
        (x.shape, x.strides, x.dtype.str, x.data.ptr % 256) for x in operands)
    plan = _plans.get(key)
    if plan is None:
        if key in unsupported:
            return None
        if len(_plans) >= MAX_PLANS:
            _forget_plans()     # layouts that keep changing (a growing sequence): start again
        try:
            plan = advanced.Matmul(a, b, stream=stream)
            # the heuristic's best algorithm alone: the workspace a plan keeps is sized for it
            plan.plan(preferences={"limit": 1}, epilog=getattr(advanced.MatmulEpilog, epilog),
                      epilog_inputs=inputs, stream=stream)
        except Exception as error:      # nvmath's and cuBLASLt's refusals have no common type
            unsupported[key] = f"{type(error).__name__}: {error}"
            return None
        _plans[key] = plan
    else:
        plan.reset_operands(a=a, b=b, epilog_inputs=inputs, stream=stream)
    try:
        return plan.execute(stream=stream)
    finally:
        plan.release_operands()


def _forget_plans():
    """Free every plan's cuBLASLt descriptors and workspace (a Matmul does not free them when it
    dies) and forget them."""
    for plan in _plans.values():
        plan.free()
    _plans.clear()
