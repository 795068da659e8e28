"""A strict stand-in for nvmath-python 1.0's `nvmath.linalg.advanced.Matmul` (stateful matrix
multiplication over cuBLASLt) with the epilogues npmegatron asks for, over the strict CuPy
stand-in's arrays.

It takes the calls the real package takes, by the same names and keywords (nvmath-python 1.0,
linalg/advanced/matmulmod.py): `Matmul(a, b, /, c=None, *, alpha=None, beta=None,
qualifiers=None, options=None, stream=None)`, `plan(*, preferences=None, algorithms=None,
epilog=None, epilog_inputs=None, stream=None)`, `reset_operands(*, a=None, b=None, c=None,
alpha=None, beta=None, epilog_inputs=None, stream=None)`, `execute(*, algorithm=None,
release_workspace=False, stream=None)` -> the result, or (result, auxiliary outputs) for
GELU_AUX_BIAS, `release_operands()` and `free()`.

It is strict where the plumbing can be wrong, as the library checks (matmulmod.py,
_internal/epilog_protocol.py):
- a and b: device arrays of the current device, of one floating dtype, 2-D, each with unit stride
  in one of its dimensions, a's columns b's rows; no c, alpha or beta (npmegatron passes none);
- the bias epilogues (BIAS, GELU_AUX_BIAS) take a bias of shape (M,), unit stride, of the result's
  dtype, and with DGELU and GELU_AUX_BIAS give a column-major result (M, N); DGELU's `gelu_aux` is
  (round_up(M, 8), N), column-major, of the result's dtype; GELU_AUX_BIAS gives such an array as
  `gelu_aux`;
- reset_operands takes only operands of the planned shapes, strides and dtypes and the planned
  epilogue's inputs, after release_operands every one of them; execute needs a plan and operands;
  the stream is the current one.
Each execute is one recorded launch of kind "gemm" (routine "cublasLtMatmul", the epilogue in its
fields) reading a, b and the epilogue's inputs and writing the result and the auxiliary output.

Numbers: the product of the operands widened to float32 (numpy.matmul of the matrices as given,
as the cuBLAS stand-in computes), the epilogue in float32 operation by operation, each output
rounded to its dtype as stored. GELU is cuBLASLt's tanh form, 0.5 x (1 + tanh(sqrt(2/pi) (x +
0.044715 x^3))), and DGELU its derivative, computed here in the order of npmegatron's chains
(autograd/ops/elementwise.py, _gelu_tanh and _gelu_tanh_grad) so that the stand-in's numbers are
the CPU emulation's; cuBLASLt's own may differ by a 16-bit rounding step (tests/test_kernels_gpu.py
holds them to that)."""
import enum
import math

import cupy
import numpy
from cupy import _core, _strict

_SQRT_2_OVER_PI = numpy.float32(math.sqrt(2.0 / math.pi))
_CUBIC = numpy.float32(0.044715)
_CUBIC_GRAD = numpy.float32(3 * 0.044715 * math.sqrt(2.0 / math.pi))


class MatmulEpilog(enum.IntEnum):
    """cuBLASLt's epilogues as nvmath names them (cublasLtEpilogue_t values)."""
    DEFAULT = 1
    RELU = 2
    RELU_AUX = 130
    BIAS = 4
    RELU_BIAS = 6
    RELU_AUX_BIAS = 134
    DRELU = 136
    DRELU_BGRAD = 152
    GELU = 32
    GELU_AUX = 160
    GELU_BIAS = 36
    GELU_AUX_BIAS = 164
    DGELU = 192
    DGELU_BGRAD = 208
    BGRADA = 256
    BGRADB = 512


#: the epilogues the stand-in computes, and the inputs each takes
_TAKEN = {MatmulEpilog.DEFAULT: (), MatmulEpilog.BIAS: ("bias",), MatmulEpilog.GELU_AUX_BIAS: ("bias",),
          MatmulEpilog.DGELU: ("gelu_aux",)}
_COLUMN_MAJOR = (MatmulEpilog.BIAS, MatmulEpilog.GELU_AUX_BIAS, MatmulEpilog.DGELU)


_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _round_up_8(n):
    return -(-n // 8) * 8


def _matrix(x, name):
    if type(x) is not _core.ndarray:
        _core.refuse_host(x, f"Matmul operand {name}")
    _core.check_device(x)
    if x.ndim != 2 or x.dtype.name not in _DTYPES:
        raise ValueError(f"operand {name}: the stand-in takes 2-D floating-point matrices, got {x.shape} {x.dtype}")
    if x.strides[0] != x.itemsize and x.strides[1] != x.itemsize and x.size > 1:
        raise ValueError(f"operand {name} of strides {x.strides}: one dimension must have unit stride")
    return x


def _layout(x):
    return x.shape, x.strides, x.dtype


class Matmul:
    def __init__(self, a, b, /, c=None, *, alpha=None, beta=None, qualifiers=None, options=None, stream=None):
        if c is not None or alpha is not None or beta is not None or qualifiers is not None or options:
            raise NotImplementedError("the stand-in takes a and b alone (no c, alpha, beta, qualifiers or options)")
        a, b = _matrix(a, "a"), _matrix(b, "b")
        if a.dtype != b.dtype:
            raise ValueError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
        if a.shape[1] != b.shape[0]:
            raise ValueError(f"a {a.shape} and b {b.shape} do not multiply")
        self._check_stream(stream)
        self.a, self.b, self.layout = a, b, (_layout(a), _layout(b))
        self.epilog, self.inputs, self.planned, self.released, self.freed = None, {}, False, False, False

    def _check_stream(self, stream):
        if stream is not None and not _strict.replaying() and stream.ptr != cupy.cuda.get_current_stream().ptr:
            raise RuntimeError(f"Matmul on stream {stream.ptr:#x}, not the current stream")

    def plan(self, *, preferences=None, algorithms=None, epilog=None, epilog_inputs=None, stream=None):
        if self.freed:
            raise RuntimeError("plan() after free()")
        if preferences is not None and (not isinstance(preferences, dict) or set(preferences) - {"limit"}):
            raise NotImplementedError(f"the stand-in takes preferences {{'limit': n}} only, got {preferences!r}")
        epilog = MatmulEpilog.DEFAULT if epilog is None else MatmulEpilog(epilog)
        if epilog not in _TAKEN:
            raise NotImplementedError(f"the stand-in does not compute the {epilog.name} epilogue")
        self._check_stream(stream)
        self.epilog = epilog
        self.inputs = self._checked_inputs(epilog_inputs or {})
        self.input_layouts = {k: _layout(v) for k, v in self.inputs.items()}
        self.planned = True
        return []

    def _checked_inputs(self, inputs):
        m, n = self.a.shape[0], self.b.shape[1]
        if sorted(inputs) != sorted(_TAKEN[self.epilog]):
            raise ValueError(f"the {self.epilog.name} epilogue takes inputs {_TAKEN[self.epilog]}, got {sorted(inputs)}")
        for name, x in inputs.items():
            if type(x) is not _core.ndarray:
                _core.refuse_host(x, f"epilogue input {name}")
            _core.check_device(x)
            if x.dtype != self.a.dtype:
                raise ValueError(f"epilogue input {name} is {x.dtype}; the result's dtype is {self.a.dtype}")
        bias = inputs.get("bias")
        if bias is not None and (bias.shape != (m,) or bias.strides != (bias.itemsize,)):
            raise ValueError(f"the bias must be ({m},) with unit stride, got {bias.shape} strides {bias.strides}")
        aux = inputs.get("gelu_aux")
        if aux is not None and (aux.shape != (_round_up_8(m), n) or aux.strides[0] != aux.itemsize):
            raise ValueError(f"gelu_aux must be ({_round_up_8(m)}, {n}) column-major, got {aux.shape} "
                             f"strides {aux.strides}")
        return dict(inputs)

    def reset_operands(self, *, a=None, b=None, c=None, alpha=None, beta=None, epilog_inputs=None, stream=None):
        if c is not None or alpha is not None or beta is not None:
            raise NotImplementedError("the stand-in takes a and b alone")
        if self.released and (a is None or b is None or (_TAKEN[self.epilog] and epilog_inputs is None)):
            raise ValueError("After release_operands(), all required operands must be provided to reset_operands()")
        for name, x in (("a", a), ("b", b)):
            if x is not None:
                _matrix(x, name)
        a = self.a if a is None else a
        b = self.b if b is None else b
        if (_layout(a), _layout(b)) != self.layout:
            raise ValueError(f"reset_operands: operands of layouts {(_layout(a), _layout(b))} where "
                             f"{self.layout} was planned")
        self._check_stream(stream)
        self.a, self.b = a, b
        if epilog_inputs is not None:
            inputs = self._checked_inputs(epilog_inputs)
            if {k: _layout(v) for k, v in inputs.items()} != self.input_layouts:
                raise ValueError("reset_operands: epilogue inputs of other layouts than planned")
            self.inputs = inputs
        self.released = False

    def release_operands(self):
        """Let go of the operands (the next reset_operands gives all of them)."""
        self.a = self.b = None
        self.inputs = {k: None for k in self.inputs}
        self.released = True

    def execute(self, *, algorithm=None, release_workspace=False, stream=None):
        if not self.planned or self.released:
            raise RuntimeError("execute() before plan(), or after release_operands() without reset_operands()")
        self._check_stream(stream)
        m, n = self.a.shape[0], self.b.shape[1]
        order = "F" if self.epilog in _COLUMN_MAJOR else "C"
        result = cupy.empty((m, n), self.a.dtype, order=order)
        aux = cupy.empty((_round_up_8(m), n), self.a.dtype, order="F") \
            if self.epilog == MatmulEpilog.GELU_AUX_BIAS else None
        _multiply(self.epilog, self.a, self.b, dict(self.inputs), result, aux)
        return result if aux is None else (result, {"gelu_aux": aux})

    def free(self):
        self.a = self.b = None
        self.inputs = {}
        self.planned, self.freed = False, True


@_strict.device_work
def _multiply(epilog, a, b, inputs, result, aux):
    """The launch: a @ b with the epilogue, into result (and aux); a CUDA graph's replay runs it
    again on the arrays it captured."""
    m, n, k = a.shape[0], b.shape[1], a.shape[1]
    dtype = a.dtype.name
    written = (result,) if aux is None else (result, aux)
    _strict.launch("gemm", "cublasLtMatmul", read=(a, b, *inputs.values()), written=written,
                   routine="cublasLtMatmul", a=dtype, b=dtype, c=dtype, compute="32F", epilogue=epilog.name,
                   transa="N" if a.strides[1] == a.itemsize else "T", transb="N" if b.strides[1] == b.itemsize else "T",
                   m=m, n=n, k=k, batch=1, direct=True)
    work = numpy.float64 if dtype == "float64" else numpy.float32
    with _core.quiet():
        acc = numpy.matmul(a._a.astype(work), b._a.astype(work))
        if epilog == MatmulEpilog.DGELU:
            x = inputs["gelu_aux"]._a[:m].astype(work)
            value = _gelu_grad(acc, x, _gelu(x)[1])
        elif epilog == MatmulEpilog.DEFAULT:
            value = acc
        else:
            value = acc + inputs["bias"]._a.astype(work)[:, None]
            if epilog == MatmulEpilog.GELU_AUX_BIAS:
                aux._a[:m] = value.astype(aux.dtype)
                aux._a[m:] = 0
                value = _gelu(value)[0]
        result._a[...] = value.astype(result.dtype)


def _gelu(x):
    """(0.5 x (1 + t), t), t = tanh(sqrt(2/pi) (x + 0.044715 x^3)), in npmegatron's order."""
    t = x * x
    t *= _CUBIC
    t += 1
    t *= x
    t *= _SQRT_2_OVER_PI
    numpy.tanh(t, out=t)
    out = t + 1
    out *= x
    out *= 0.5
    return out, t


def _gelu_grad(g, x, t):
    """g (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2)), in npmegatron's order."""
    grad = x * x
    grad *= _CUBIC_GRAD
    grad += _SQRT_2_OVER_PI
    grad *= x
    one_minus_t2 = t * t
    one_minus_t2 *= -1
    one_minus_t2 += 1
    grad *= one_minus_t2
    grad += numpy.add(t, 1, out=one_minus_t2)
    grad *= 0.5
    grad *= g
    return grad
