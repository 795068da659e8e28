"""16-bit storage by rounding (--fp16, --bf16): values on the 16-bit grid, arithmetic in float32.

Inside `storage("fp16")` (or "bf16") every Function rounds its outputs to that format's grid, and
the tape node it records rounds the gradients its backward returns: activations, weights and
activation gradients then hold exactly the numbers a 16-bit run would store, overflow to inf
included, while every op computes in float32 from them, as tensor cores accumulate matmuls in fp32
and Megatron computes LayerNorm, softmax and the loss in fp32. A Function whose output stays in
float32 (the loss) says so with `float32_output = True`. A parameter's gradient (a leaf with
`is_parameter`) is never rounded: each contribution adds up in float32 as its Function computed
it, as Megatron's gradient-accumulation fusion sums the weight-gradient GEMM into the float32
main_grad (beta = 1, engine.py's destinations); the optimizer keeps float32 master weights
(npmegatron/optim/adamw.py). Any other leaf's gradient is an activation's (a pipeline stage's
input, sent on to the stage before) and is rounded like one.

Why rounding rather than 16-bit arrays: NumPy has no 16-bit matmul (float16 runs in a scalar loop,
hundreds of times slower than float32 BLAS) and bfloat16 (ml_dtypes) has none at all, so every op
would cast its inputs up and its outputs down anyway. On the CPU the arrays stay float32, so this
saves no bytes there (the plan and the training header report what 16-bit storage would hold).

On a GPU what the tape keeps is 16-bit: a Function names the saved arrays that lie on the grid
(`Context.on_grid`: its rounded inputs and outputs), and they are kept as float16 or bfloat16
arrays (`to_16_bit`), which holds the same numbers exactly in half the bytes; backward reads them
back in float32. So a GPU run keeps the CPU emulation's numbers bit for bit.
"""
import contextlib
import sys

import numpy

try:
    import ml_dtypes        # bfloat16 for NumPy and CuPy 14 (the gpu and test extras)
except ImportError:
    ml_dtypes = None

from . import bf16_bits
from .backend import get_array_module
from .fusion import fused

FORMATS = ("fp16", "bf16")
_active = None


def active():
    """The 16-bit format ops round to now, or None."""
    return _active


@contextlib.contextmanager
def storage(fmt):
    """Round every op's outputs (and, in backward, its input gradients) to `fmt` inside this
    block; None leaves the current setting as it is."""
    global _active
    if fmt is None:
        yield
        return
    if fmt not in FORMATS:
        raise ValueError(f"16-bit format {fmt!r} is not known; use one of {FORMATS}")
    previous, _active = _active, fmt
    try:
        yield
    finally:
        _active = previous


@contextlib.contextmanager
def suspended():
    """No rounding inside this block: ops Megatron computes in float32 or float64 whatever the
    model's 16-bit format (the MoE router under --moe-router-dtype). Their inputs come in through
    a cast of their own (on a GPU they may be 16-bit arrays: nothing here widens them)."""
    global _active
    previous, _active = _active, None
    try:
        yield
    finally:
        _active = previous


#: Whether a GPU run holds 16-bit arrays: the saved arrays that lie on the grid and the parameters
#: forward reads (npmegatron's flat buffers). Tests turn it off to show the numbers do not change.
sixteen_bit_arrays_on_gpu = True


def kept_in_16_bit(fmt=None):
    """The 16-bit format saved arrays on the grid are kept in on a GPU now (or, given `fmt`, would
    be under that format: a backward pass runs outside the storage block its nodes remember), or
    None."""
    fmt = _active if fmt is None else fmt
    if fmt is None:
        return None
    # asked once per Function call: the answer is remembered per format, CuPy module and version,
    # and switch
    cupy = sys.modules.get("cupy")
    key = (fmt, cupy, getattr(cupy, "__version__", None), sixteen_bit_arrays_on_gpu)
    held = _held_in_16_bit.get(key)
    if held is None:
        held = _held_in_16_bit[key] = holds_16_bit_arrays(cupy, fmt)
    return fmt if held else None


_held_in_16_bit = {}


def holds_16_bit_arrays(xp, fmt):
    """Whether array module `xp` (None: CuPy not loaded) holds --fp16/--bf16 values in 16-bit
    arrays (a GPU's parameters and kept activations), rather than in float32 arrays on the grid
    (the CPU)."""
    return (fmt is not None and xp is not numpy and sixteen_bit_arrays_on_gpu
            and (fmt == "fp16" or _cupy_has_bfloat16(xp)))


def _cupy_has_bfloat16(cupy):
    """CuPy holds ml_dtypes' bfloat16 from version 14 on (None: no CuPy loaded, no device arrays)."""
    return cupy is None or (ml_dtypes is not None and int(cupy.__version__.split(".")[0]) >= 14)


def sixteen_bit_dtype(fmt):
    """The array dtype of 16-bit format `fmt`: float16, or ml_dtypes' bfloat16."""
    if fmt == "fp16":
        return numpy.dtype(numpy.float16)
    if ml_dtypes is None:
        raise ImportError("bfloat16 arrays need ml_dtypes: pip install 'npmegatron[gpu]'")
    return numpy.dtype(ml_dtypes.bfloat16)


def to_16_bit(x, fmt, out=None):
    """x (float32) rounded to a 16-bit array of format fmt (into `out` when given), in one kernel:
    exact for values on the grid. For bfloat16 on a GPU the rounding is integer arithmetic on
    the float32 bits (bf16_bits.py), where CuPy's float32 -> bfloat16 cast measured about a third
    of memory speed on an H200."""
    xp = get_array_module(x)
    out = xp.empty(x.shape, sixteen_bit_dtype(fmt)) if out is None else out
    if fmt == "fp16" or xp is numpy or x.dtype != numpy.float32:
        out[...] = x
    else:
        bf16_bits.top_bits(x.view(numpy.uint32), out.view(numpy.uint16))
    return out


#: the 16-bit float dtypes and their formats: a dict lookup, where a dtype's `name` takes about
#: 2 us of Python (NumPy's _name_get) and a GPU step asks about 800 times
_FORMATS_OF = {numpy.dtype(numpy.float16): "fp16"}
if ml_dtypes is not None:
    _FORMATS_OF[numpy.dtype(ml_dtypes.bfloat16)] = "bf16"


def format_of(dtype):
    """"bf16" or "fp16" for a 16-bit float dtype, else None."""
    return _FORMATS_OF.get(dtype if isinstance(dtype, numpy.dtype) else numpy.dtype(dtype))


def master_dtype(dtype):
    """float32 for a 16-bit dtype, else `dtype` itself: the dtype of a parameter's gradient (a
    GPU's 16-bit parameters' gradients add up in float32, Megatron's main_grad), master weights
    and moments."""
    dtype = numpy.dtype(dtype)
    return numpy.dtype(numpy.float32) if format_of(dtype) else dtype


def to_float32(x):
    """A 16-bit array (to_16_bit's) as float32, in one kernel: bfloat16 widened by a shift."""
    xp = get_array_module(x)
    if format_of(x.dtype) != "bf16" or xp is numpy:
        return x.astype(numpy.float32)
    wide = xp.empty(x.shape, numpy.uint32)
    bf16_bits.widen(x.view(numpy.uint16), wide)
    return wide.view(numpy.float32)


#: float32 arrays at least this large are rounded by the numba kernels on the CPU: the threshold
#: of every compiled kernel, below which a process never imports numba (0.65 s to load the
#: kernels, more than NumPy's cast costs a small model's whole run).
COMPILED_ROUND_SIZE = 1 << 16


def round_(x, fmt):
    """x rounded to fmt's grid, in place where x is writable (a rounded copy otherwise); arrays
    that are not floating point are returned as they are."""
    dtype = getattr(x, "dtype", None)
    if fmt is None or dtype is None or dtype.kind != "f" or _FORMATS_OF.get(dtype) == fmt:
        return x
    if fmt == "bf16" and dtype == numpy.float32 and type(x).__module__.startswith("cupy"):
        bf16_bits.round_in_place(x.view(numpy.uint32))      # the GPU's common case, first (writable)
        return x
    xp = get_array_module(x)
    if isinstance(x, numpy.generic) or not getattr(getattr(x, "flags", None), "writeable", True):
        x = xp.array(x)         # a NumPy scalar (a reduction's result) or a read-only view
    if (xp is numpy and x.dtype == numpy.float32 and x.size >= COMPILED_ROUND_SIZE
            and x.flags.c_contiguous):
        from . import _round_cpu
        from .threads import use_numba_threads
        use_numba_threads()
        flat = x.reshape(-1)
        if fmt == "fp16":
            _round_cpu.fp16_(flat, flat.view(numpy.int32))
        else:
            _round_cpu.bf16_(flat.view(numpy.int32))
        return x
    if xp is not numpy and (fmt == "fp16" or x.dtype == numpy.float32):
        # one kernel on a GPU, strided views too (the generic code is 2 kernels for fp16, 9 for bf16)
        fp16_round_(x) if fmt == "fp16" else bf16_bits.round_in_place(x.view(xp.uint32))
    elif fmt == "fp16":
        with numpy.errstate(over="ignore"):     # past 65504 is inf, as in float16
            x[...] = x.astype(xp.float16)
    else:
        _round_bf16_(xp, x)
    return x


def round_keeping_copy(x, fmt):
    """Round a C-ordered float32 device array in place (round_) and return its 16-bit copy, made by
    the same kernel: what a Function that keeps or multiplies it in 16 bits would cast again
    (function.py remembers the copy beside the array). None, and round_ alone, for any other array."""
    xp = get_array_module(x)
    if (fmt is None or xp is numpy or not hasattr(x, "dtype") or x.dtype != numpy.float32
            or not x.flags.c_contiguous or x.size == 0):
        round_(x, fmt)
        return None
    copy = xp.empty(x.shape, sixteen_bit_dtype(fmt))
    if fmt == "fp16":
        fp16_round_copy_(x, copy)
    else:
        bf16_bits.round_keeping_copy(x.view(numpy.uint32), copy.view(numpy.uint16))
    return copy


@fused
def fp16_round_copy_(xp, x, copy):
    """fp16_round_, the float16 values also written to `copy`."""
    half = x.astype(numpy.float16)
    xp.multiply(half, 1, out=copy)
    xp.multiply(half, 1.0, out=x)


@fused
def fp16_round_(xp, x):
    """x rounded in place to float16's grid (past 65504: inf); the multiply by 1 is exact and is
    how a chain writes an argument."""
    xp.multiply(x.astype(numpy.float16), 1.0, out=x)


def _round_bf16_(xp, x):
    """bfloat16 rounding of a float32 array with the array module's own integer ops (CuPy has no
    bfloat16 type): nearest-even on the top 16 bits, NaN kept."""
    if x.dtype != numpy.float32:
        raise ValueError(f"bf16 rounding works on float32 arrays, not {x.dtype}")
    if not x.flags.c_contiguous:
        x[...] = _round_bf16_(xp, xp.ascontiguousarray(x))
        return x
    bits = x.view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> xp.uint32(16)) & xp.uint32(1))) & xp.uint32(0xFFFF0000)
    bits[...] = xp.where((bits & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000), bits, rounded)
    return x
