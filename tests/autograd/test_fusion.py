"""The fused elementwise chains (autograd/fusion.py): each equals a plain NumPy reference in
float64, the ops built on them pass finite differences, and every chain body runs under a strict
stand-in for `cupy.fuse`, so a body that CuPy could not compile fails here, on the CPU.

The stand-in is local and minimal: proxies that allow only elementwise arithmetic, comparisons,
in-place updates, `astype` and the ufuncs the chains may use, and that raise on `bool()`,
indexing, `.shape`, reductions, NumPy conversion, captured arrays and scalar-with-scalar math."""
import math
import sys
import types

import numpy as np
import pytest
from scipy.special import erf

import npmegatron.autograd as ag
from npmegatron.autograd import InputError, Tensor, fusion, gradcheck, precision
from npmegatron.optim import adamw as optimizer
from npmegatron.tensor_parallel import cross_entropy  # noqa: F401  (registers its chains)
from npmegatron.tensor_parallel import random as dropout_random

RNG = np.random.default_rng(0)
SHAPE = (2, 3, 5)


def normal(*shape, dtype=np.float64):
    return RNG.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------------------------
# A strict stand-in for cupy.fuse and the CuPy ufuncs a fused body may call.

class FuseError(Exception):
    """What cupy.fuse would refuse (at trace time, or by failing to compile)."""


class Proxy:
    """A traced value: an array (or a scalar argument) that allows only what cupy.fuse's proxies
    (`cupy/_core/_fusion_interface.py`) allow. The value is computed with NumPy alongside, so a
    strict run can be compared with a direct one."""

    __array_ufunc__ = None      # numpy ufuncs and operators refuse it, as they refuse CuPy proxies

    def __init__(self, value, scalar=False):
        self._value, self._scalar = value, scalar

    @property
    def dtype(self):
        return np.result_type(self._value)

    @property
    def ndim(self):
        return np.ndim(self._value)

    def astype(self, dtype):
        return Proxy(np.asarray(self._value).astype(dtype), self._scalar)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)      # protocol lookups (copy, NumPy's array interface)
        raise FuseError(f"`.{name}` of a proxy: shapes, reductions and array methods are not "
                        "available inside cupy.fuse")

    def _refuse(self, *args):
        raise FuseError("Python control flow, indexing or conversion of a traced value")

    __bool__ = __int__ = __float__ = __index__ = __len__ = __iter__ = _refuse
    __getitem__ = __setitem__ = __array__ = __contains__ = _refuse


def _operand(x):
    if isinstance(x, Proxy):
        if _TRACE["reduced"] and not x._scalar and not getattr(x, "_after_reduction", False):
            raise FuseError("a value from before the reduction used after it (cupy.fuse: 'Shape mismatch')")
        return x
    if type(x) in (bool, int, float, complex):
        return Proxy(x, scalar=True)
    raise FuseError(f"{type(x).__name__} in a fused body: only traced values and Python scalars "
                    "(a captured array is 'Concrete ndarray is not supported in fusion')")


def strict_ufunc(function, nin):
    """A ufunc of the stand-in `cupy`: proxies or Python scalars in, `out=` an array proxy."""
    def call(*args, out=None):
        if len(args) != nin:
            raise FuseError(f"{function.__name__} takes {nin} inputs here")
        ins = [_operand(a) for a in args]
        if all(p._scalar for p in ins):
            raise FuseError(f"{function.__name__} of scalars only: compute it on the host (under "
                            "the old fusion it would be a strong float64)")
        values = [p._value for p in ins]
        if out is None:
            return Proxy(function(*values))
        if not isinstance(out, Proxy) or out._scalar:
            raise FuseError("out= must be an array proxy")
        function(*values, out=out._value)
        return out
    call.__name__ = function.__name__
    return call


#: whether the body being traced has reduced already (one reduction, as its last step)
_TRACE = {"reduced": False}


def _sum(x, axis=None, dtype=None, out=None, keepdims=False):
    """cupy.sum inside a trace: one reduction, no keepdims, no out (cupy/_core/fusion.pyx)."""
    if _TRACE["reduced"]:
        raise FuseError("Multiple reduction is not implemented yet")
    if keepdims or out is not None:
        raise FuseError("cupy.sum in a fusion takes neither keepdims nor out")
    value = _operand(x)._value
    _TRACE["reduced"] = True
    result = Proxy(np.sum(value, axis=axis, dtype=dtype))
    result._after_reduction = True
    return result


def _where(condition, x, y):
    return np.where(condition, x, y)


UFUNCS = {"add": (np.add, 2), "subtract": (np.subtract, 2), "multiply": (np.multiply, 2),
          "true_divide": (np.true_divide, 2), "divide": (np.divide, 2), "power": (np.power, 2),
          "negative": (np.negative, 1), "less": (np.less, 2), "less_equal": (np.less_equal, 2),
          "greater": (np.greater, 2), "greater_equal": (np.greater_equal, 2),
          "equal": (np.equal, 2), "not_equal": (np.not_equal, 2), "exp": (np.exp, 1),
          "log": (np.log, 1), "tanh": (np.tanh, 1), "sqrt": (np.sqrt, 1), "abs": (np.abs, 1),
          "maximum": (np.maximum, 2), "minimum": (np.minimum, 2), "where": (_where, 3),
          "bitwise_xor": (np.bitwise_xor, 2), "bitwise_and": (np.bitwise_and, 2), "right_shift": (np.right_shift, 2),
          "left_shift": (np.left_shift, 2), "isfinite": (np.isfinite, 1)}


def _binary(name, reflected=False, inplace=False):
    ufunc = strict_ufunc(*UFUNCS[name])

    def method(self, other):
        if inplace:
            if self._scalar:
                raise FuseError("in-place update of a scalar")
            return ufunc(self, other, out=self)
        return ufunc(other, self) if reflected else ufunc(self, other)
    return method


for _op, _name in (("add", "add"), ("sub", "subtract"), ("mul", "multiply"),
                   ("truediv", "true_divide"), ("pow", "power")):
    setattr(Proxy, f"__{_op}__", _binary(_name))
    setattr(Proxy, f"__r{_op}__", _binary(_name, reflected=True))
    setattr(Proxy, f"__i{_op}__", _binary(_name, inplace=True))
for _op, _name in (("lt", "less"), ("le", "less_equal"), ("gt", "greater"),
                   ("ge", "greater_equal"), ("eq", "equal"), ("ne", "not_equal")):
    setattr(Proxy, f"__{_op}__", _binary(_name))
Proxy.__neg__ = lambda self: strict_ufunc(np.negative, 1)(self)
Proxy.__hash__ = object.__hash__


def strict_cupy():
    """(cupy, cupyx) stand-in modules: `fuse` traces a body with proxies, ufuncs act on them."""
    cupy = types.ModuleType("cupy")
    for name, (function, nin) in UFUNCS.items():
        setattr(cupy, name, strict_ufunc(function, nin))
    cupy.sum = _sum
    cupy.float32 = np.float32
    cupy.traces = []

    def fuse(kernel_name=None):
        def decorate(func):
            def kernel(*args):
                cupy.traces.append(kernel_name)
                return _trace(func, args)
            return kernel
        return decorate
    cupy.fuse = fuse
    special = types.ModuleType("cupyx.scipy.special")
    special.erf = strict_ufunc(erf, 1)
    return cupy, special


class DeviceArray:
    """Stands for a cupy.ndarray: its type's module starts with "cupy", as backends check."""
    __module__ = "cupy._core.core"

    def __init__(self, array):
        self.array = array


def _trace(func, args):
    """Run `func` as cupy.fuse would: arrays and scalars in as proxies; an array, a tuple of
    arrays or None out, never an input itself."""
    _TRACE["reduced"] = False
    inputs = []
    for a in args:
        if isinstance(a, DeviceArray):
            inputs.append(Proxy(a.array))
        elif type(a) in (bool, int, float, np.uint64):
            inputs.append(Proxy(a, scalar=True))
        else:
            raise FuseError(f"argument of type {type(a).__name__}: cupy.fuse takes CuPy arrays and "
                            "Python or NumPy scalars")
    result = func(*inputs)
    if result is None:
        return None
    outs = result if isinstance(result, tuple) else (result,)
    for out in outs:
        if not isinstance(out, Proxy) or out._scalar:
            raise FuseError("a fused body returns arrays, a tuple of arrays, or None")
        if any(out is i for i in inputs):
            raise FuseError("a fused body must not return one of its arguments")
    wrapped = tuple(DeviceArray(np.asarray(out._value)) for out in outs)
    return wrapped if isinstance(result, tuple) else wrapped[0]


@pytest.fixture
def fake_cupy(monkeypatch):
    """The stand-in installed as `cupy` and `cupyx.scipy.special`, and every chain's kernel cache
    cleared, so chains go through Fused.kernel() as on a GPU."""
    cupy, special = strict_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    for name in ("cupyx", "cupyx.scipy"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "cupyx.scipy.special", special)
    for chain in fusion.CHAINS.values():
        monkeypatch.setattr(chain, "_kernel", None)
    return cupy


# ---------------------------------------------------------------------------------------------
# Every chain: arguments for a run, and a plain NumPy float64 reference.

def _gelu_tanh_ref(x):
    t = np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))
    return 0.5 * x * (1 + t), t


def _gelu_tanh_grad_ref(g, x):
    t = _gelu_tanh_ref(x)[1]
    s = math.sqrt(2 / math.pi)
    return g * (0.5 * (1 + t) + 0.5 * x * (1 - t ** 2) * s * (1 + 3 * 0.044715 * x ** 2))


def _gelu_erf_ref(x):
    cdf = 0.5 * (1 + erf(x / math.sqrt(2)))
    return x * cdf, cdf


def _gelu_erf_grad_ref(g, x):
    return g * (_gelu_erf_ref(x)[1] + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi))


def _softmax_ref(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _cases(dtype=np.float64):
    """name -> (args, reference): reference(args) gives the expected results, and for chains that
    update arguments in place, the expected arguments after the call (index -> array)."""
    x, g, b = normal(*SHAPE, dtype=dtype), normal(*SHAPE, dtype=dtype), normal(5, dtype=dtype)
    t = _gelu_tanh_ref(x)[1].astype(dtype)
    cdf = _gelu_erf_ref(x)[1].astype(dtype)
    tb, cdfb = _gelu_tanh_ref(x + b)[1].astype(dtype), _gelu_erf_ref(x + b)[1].astype(dtype)
    y = _softmax_ref(x).astype(dtype)
    dot = (g * y).sum(axis=-1, keepdims=True)
    mean, n = x.mean(axis=-1, keepdims=True), float(SHAPE[-1])
    xc = x - mean
    square_sum = (xc * xc).sum(axis=-1, keepdims=True)
    rstd = 1 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + 1e-5)
    xhat = xc * rstd
    gh = g * b
    mean_gh, mean_ghx = gh.mean(axis=-1, keepdims=True), (gh * xhat).mean(axis=-1, keepdims=True)
    u, r = RNG.random(SHAPE).astype(dtype), normal(*SHAPE, dtype=dtype)
    keep = u >= 0.3
    p, m = normal(*SHAPE, dtype=dtype), 0.1 * normal(*SHAPE, dtype=dtype)
    v = np.abs(normal(*SHAPE, dtype=dtype))
    lr, wd, b1, b2, eps, step = 1e-2, 0.1, 0.9, 0.999, 1e-8, 3
    bias1, bias2 = 1 - b1 ** step, 1 - b2 ** step
    m_new, v_new = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    decayed = np.arange(p.size).reshape(p.shape) % 3 != 0       # decay on some elements only
    p_new = np.where(decayed, p * (1 - lr * wd), p) - lr * (m_new / bias1) / (np.sqrt(v_new / bias2) + eps)
    x2, x2_max = x.reshape(-1, SHAPE[-1]), x.reshape(-1, SHAPE[-1]).max(axis=-1, keepdims=True)
    x2_sum = np.exp(x2 - x2_max).sum(axis=-1, keepdims=True)
    target = np.array([0, 4, 2, -1, 1, 3])[:, None]         # -1: the target is another rank's
    columns = np.arange(SHAPE[-1])[None, :]
    bits = np.concatenate([x.astype(np.float32).reshape(-1).view(np.uint32), np.array(
        [0x7F800001, 0xFFFFFFFF, 0x7F800000, 0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x80000000], np.uint32)])
    rms = 1 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-5)
    sig = 1 / (1 + np.exp(-x))
    norms_squared = np.array([4.0, 0.25, np.inf, np.nan], dtype)    # clipped, kept, not finite twice
    return {
        "fp16_round_": ((x * 1e3,), lambda: {0: (x * 1e3).astype(np.float16).astype(dtype)}),
        "bf16_round_bits_": ((bits.copy(),), lambda: {0: precision._round_bf16_(np, bits.copy().view(np.float32))
                                                          .view(np.uint32)}),
        "fp16_round_copy_": ((x * 1e3, np.empty(x.shape, np.float16)),
                             lambda: {0: (x * 1e3).astype(np.float16).astype(dtype), 1: (x * 1e3).astype(np.float16)}),
        "bf16_round_bits_copy_": ((bits.copy(), np.empty(bits.shape, np.uint16)),
                                  lambda: {0: precision._round_bf16_(np, bits.copy().view(np.float32)).view(np.uint32),
                                           1: (precision._round_bf16_(np, bits.copy().view(np.float32))
                                               .view(np.uint32) >> 16).astype(np.uint16)}),
        "bf16_top_bits_": ((bits.copy(), np.empty(bits.shape, np.uint16)),
                           lambda: {1: (precision._round_bf16_(np, bits.copy().view(np.float32)).view(np.uint32)
                                        >> 16).astype(np.uint16)}),
        "bf16_widen_bits_": (((bits >> 16).astype(np.uint16), np.empty(bits.shape, np.uint32)),
                             lambda: {1: (bits >> 16) << 16}),
        "exp_sum": ((x2, x2_max), lambda: np.exp(x2 - x2_max).sum(axis=-1)),
        "square_sum": ((x,), lambda: (x * x).sum()),
        "cross_entropy_grad_": ((x2, x2_max, x2_sum, target, columns, 0.5, np.empty_like(x2)),
                                lambda: {6: 0.5 * (np.exp(x2 - x2_max) / x2_sum - (target == columns))}),
        "gelu_tanh": ((x,), lambda: _gelu_tanh_ref(x)),
        "gelu_tanh_backward": ((g, x, t), lambda: _gelu_tanh_grad_ref(g, x)),
        "bias_gelu_tanh": ((x, b), lambda: _gelu_tanh_ref(x + b)),
        "bias_gelu_tanh_backward": ((g, x, b, tb), lambda: _gelu_tanh_grad_ref(g, x + b)),
        "bias_gelu_tanh_output": ((x, b), lambda: _gelu_tanh_ref(x + b)[0]),
        "bias_gelu_tanh_backward_recomputed": ((g, x, b), lambda: _gelu_tanh_grad_ref(g, x + b)),
        "gelu_tanh_backward_at": ((g, x), lambda: _gelu_tanh_grad_ref(g, x)),
        "gelu_erf": ((x,), lambda: _gelu_erf_ref(x)),
        "gelu_erf_backward": ((g, x, cdf), lambda: _gelu_erf_grad_ref(g, x)),
        "bias_gelu_erf": ((x, b), lambda: _gelu_erf_ref(x + b)),
        "bias_gelu_erf_backward": ((g, x, b, cdfb), lambda: _gelu_erf_grad_ref(g, x + b)),
        "bias_gelu_erf_output": ((x, b), lambda: _gelu_erf_ref(x + b)[0]),
        "bias_gelu_erf_backward_recomputed": ((g, x, b), lambda: _gelu_erf_grad_ref(g, x + b)),
        "exp_shifted_": ((x.copy(), x.max(axis=-1, keepdims=True)),
                         lambda: {0: np.exp(x - x.max(axis=-1, keepdims=True))}),
        "softmax_backward": ((g, y, dot, 0.5), lambda: 0.5 * y * (g - dot)),
        "centered_square_sum": ((x, mean), lambda: (xc * xc).sum(axis=-1)),
        "layer_norm_forward_": ((x, mean, square_sum, n, 1e-5, b, g[0], np.empty_like(x), np.empty_like(x)),
                                lambda: {7: xhat, 8: xhat * b + g[0]}),
        "layer_norm_row_sums": ((g, b, xhat), lambda: gh.sum(axis=-1) + 1j * (gh * xhat).sum(axis=-1)),
        "layer_norm_column_sums": ((g, xhat), lambda: (g * xhat).sum(axis=0) + 1j * g.sum(axis=0)),
        "layer_norm_backward_": ((g, b, xhat, mean_gh * n, mean_ghx * n, square_sum, n, 1e-5, np.empty_like(g)),
                                 lambda: {8: rstd * (gh - mean_gh - xhat * mean_ghx)}),
        "dropout_add_forward": ((x, keep, r, 1 / 0.7), lambda: r + np.where(keep, x / 0.7, 0)),
        "bias_dropout_add_forward": ((x, b, keep, r, 1 / 0.7), lambda: r + np.where(keep, (x + b) / 0.7, 0)),
        "bias_add_residual": ((x, b, r), lambda: r + (x + b)),
        "dropout_backward": ((g, keep, 1 / 0.7), lambda: np.where(keep, g / 0.7, 0)),
        "hashed_keep": ((np.arange(6, dtype=np.uint64)[:, None] * np.uint64(5), np.arange(5, dtype=np.uint64)[None, :],
                         np.uint64(0xFEDCBA9876543210), *dropout_random._HASH_CONSTANTS, np.uint64(64 - 53),
                         np.uint64(math.ceil(0.3 * 2.0 ** 53))),
                        lambda: dropout_random.uniform(0xFEDCBA9876543210, (6, 5), np.float64, np) >= 0.3),
        "device_draw_key": ((np.array([0, 7, 2 ** 40], np.uint64), np.uint64(0xFEDCBA9876543210),
                             *dropout_random._HASH_CONSTANTS, dropout_random._word(3), dropout_random._word(5)),
                            lambda: np.array([dropout_random.draw_key(0xFEDCBA9876543210, i, 3, 5)
                                              for i in (0, 7, 2 ** 40)], np.uint64)),
        "dropout_": ((x.copy(), keep, 1 / 0.7), lambda: {0: np.where(keep, x / 0.7, 0)}),
        "dropout_softmax_backward_": ((g.copy(), y, keep, dot, 1 / 0.7, 0.5),
                                      lambda: {0: 0.5 * y * (np.where(keep, g / 0.7, 0) - dot)}),
        "gradient_factor_on_device": ((norms_squared, 1.0, 1.0, 1.0),
                                      lambda: np.array([optimizer.gradient_factor(math.sqrt(s), 1.0) or 1.0
                                                        if np.isfinite(s) else 1.0 for s in norms_squared],
                                                       np.float32)),
        "row_square_sums": ((x,), lambda: (x * x).sum(axis=-1)),
        "rms_norm_forward_": ((x, (x * x).sum(axis=-1, keepdims=True), n, 1e-5, b, np.empty_like(x), np.empty_like(x)),
                              lambda: {5: x * rms, 6: x * rms * b}),
        "rms_norm_row_sums": ((g, b, x * rms), lambda: (gh * x * rms).sum(axis=-1)),
        "rms_norm_backward_": ((g, b, x * rms, (gh * x * rms).sum(axis=-1, keepdims=True),
                                (x * x).sum(axis=-1, keepdims=True), n, 1e-5, np.empty_like(g)),
                               lambda: {7: rms * (gh - x * rms * (gh * x * rms).mean(axis=-1, keepdims=True))}),
        "rotate_pairs_": ((x, g, np.cos(r), np.sin(r), np.empty_like(x), np.empty_like(x)),
                          lambda: {4: x * np.cos(r) - g * np.sin(r), 5: g * np.cos(r) + x * np.sin(r)}),
        "rms_norm_weight_grad": ((g, x), lambda: (g * x).sum(axis=0)),
        "swiglu_forward": ((x, g), lambda: x / (1 + np.exp(-x)) * g),
        "swiglu_backward_": ((r, x, g, np.empty_like(x), np.empty_like(x)),
                             lambda: {3: r * g * sig * (1 + x * (1 - sig)), 4: r * x * sig}),
        "adamw_update_": ((p.copy(), g / 0.5, m.copy(), v.copy(), decayed, 0.5, 1 - lr * wd, b1, 1 - b1, b2, 1 - b2,
                           1 / math.sqrt(bias2), eps, lr / bias1),
                          lambda: {0: p_new, 2: m_new, 3: v_new}),
    }


def _split(expected):
    """(returned results, {argument index: expected value after the call})."""
    if isinstance(expected, dict):
        return None, expected
    if isinstance(expected, tuple) and isinstance(expected[-1], dict):
        return expected[0], expected[-1]
    return expected, {}


def _check(result, args, expected, rtol):
    returned, updated = _split(expected)
    if returned is None:
        assert result is None, "a chain that updates its arguments returns None"
    else:
        for got, want in zip(result if isinstance(result, tuple) else (result,),
                             returned if isinstance(returned, tuple) else (returned,)):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
    for index, want in updated.items():
        np.testing.assert_allclose(args[index], want, rtol=rtol, atol=rtol)


def test_every_chain_has_a_case():
    assert set(fusion.CHAINS) == set(_cases()), "add a case (and a reference) for each new chain"


@pytest.mark.parametrize("name", sorted(_cases()))
def test_chain_matches_numpy_reference_in_float64(name):
    args, reference = _cases()[name]
    _check(fusion.CHAINS[name](*args), args, reference(), rtol=1e-12)


@pytest.mark.parametrize("name", sorted(_cases()))
def test_chain_keeps_float32(name):
    args, _ = _cases(np.float32)[name]
    result = fusion.CHAINS[name](*args)
    arrays = [a for a in (result if isinstance(result, tuple) else (result,)) if a is not None]
    arrays += [a for a in args if isinstance(a, np.ndarray)]
    # a chain's two sums come back as one complex sum (nn.layer_norm_row_sums), in float32's pair
    assert all(a.dtype in (np.float32, np.bool_, np.complex64, np.uint64, np.uint32, np.uint16, np.int64,
                           np.float16)
               for a in arrays)


@pytest.mark.parametrize("name", sorted(_cases()))
def test_chain_compiles_under_strict_fuse_and_gives_the_cpu_results(name, fake_cupy):
    """The GPU path of Fused (cupy.fuse of the body bound to the `cupy` module) under the strict
    stand-in, against the very same body run by NumPy: equal bit for bit."""
    args, _ = _cases()[name]
    cpu_args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    cpu = fusion.CHAINS[name](*cpu_args)
    gpu_args = [DeviceArray(a.copy()) if isinstance(a, np.ndarray) else a if isinstance(a, np.uint64)
                else np.float64(a) for a in args]
    gpu = fusion.CHAINS[name](*gpu_args)
    gpu = gpu if isinstance(gpu, tuple) or gpu is None else (gpu,)
    cpu = cpu if isinstance(cpu, tuple) or cpu is None else (cpu,)
    assert (gpu is None) == (cpu is None)
    for got, want in zip(gpu or (), cpu or ()):
        np.testing.assert_array_equal(got.array, want)
    for got, want in zip(gpu_args, cpu_args):
        if isinstance(got, DeviceArray):
            np.testing.assert_array_equal(got.array, want)
    fusion.CHAINS[name](*gpu_args)
    assert fake_cupy.traces == [name, name]    # kernel_name is the chain's name; fuse made once


def test_fuse_is_called_once_per_chain_with_its_name(fake_cupy):
    chain = fusion.CHAINS["dropout_backward"]
    keep = DeviceArray(np.ones(3, bool))
    for _ in range(3):
        chain(DeviceArray(np.ones(3)), keep, 2.0)
    assert chain.kernel() is chain.kernel()


@pytest.mark.parametrize("body, why", [
    (lambda xp, x: np.exp(x), "numpy ufunc"),
    (lambda xp, x: x if x > 0 else -x, "control flow"),
    (lambda xp, x: x * x.shape[0], "shape"),
    (lambda xp, x: x - x.sum(), "reduction"),
    (lambda xp, x: x[0], "indexing"),
    (lambda xp, x: x * np.ones(3), "captured array"),
    (lambda xp, x, s: x * (1 - s), "scalar arithmetic"),
    (lambda xp, x: x, "returns its argument"),
    (lambda xp, x: xp.cumsum(x), "not an elementwise ufunc"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_strict_fuse_refuses_what_cupy_fuse_cannot_compile(body, why, fake_cupy):
    chain = fusion.Fused(body)
    chain.name = "bad"
    args = (DeviceArray(np.ones(3)),) + ((0.5,) if body.__code__.co_argcount == 3 else ())
    with pytest.raises((FuseError, AttributeError, TypeError)):
        chain(*args)


def test_numpy_scalars_stay_weak_on_the_cpu():
    x = np.ones(4, np.float32)
    out = fusion.CHAINS["dropout_backward"](x, x > 0, np.float64(1 / 0.7))
    assert out.dtype == np.float32


# ---------------------------------------------------------------------------------------------
# The ops built on the chains.

def leaf(*shape):
    return Tensor(RNG.standard_normal(shape), requires_grad=True)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_equals_gelu_of_the_sum_and_gradchecks(approximate):
    y, b = leaf(2, 3, 4), leaf(4)
    np.testing.assert_allclose(ag.bias_gelu(y, b, approximate).data,
                               ag.gelu(y + b, approximate).data, rtol=1e-14, atol=1e-15)
    assert gradcheck(lambda a, c: ag.bias_gelu(a, c, approximate), [y, b]) < 1e-6


def test_bias_gelu_refuses_a_bias_of_the_wrong_size():
    with pytest.raises(InputError, match="bias of shape"):
        ag.bias_gelu(leaf(2, 4), leaf(3))


class FixedDraws:
    """A dropout site that gives the same uniforms at every call (finite differences re-run the
    forward many times)."""

    def random(self, shape, dtype=np.float64):
        return np.random.default_rng(7).random(shape).astype(dtype)


def test_dropout_add_equals_residual_plus_dropout_and_gradchecks():
    y, r = leaf(3, 4, 5), leaf(3, 4, 5)
    fused = ag.dropout_add(y, r, 0.4, FixedDraws())
    np.testing.assert_array_equal(fused.data, (r + ag.dropout(y, 0.4, FixedDraws())).data)
    assert gradcheck(lambda a, c: ag.dropout_add(a, c, 0.4, FixedDraws()), [y, r]) < 1e-6
    np.testing.assert_array_equal(ag.dropout_add(y, r, 0.4, FixedDraws(), training=False).data,
                                  (r + y).data)


def test_bias_dropout_add_equals_its_parts_and_gradchecks():
    y, bias, r = leaf(3, 4, 5), leaf(5), leaf(3, 4, 5)
    fused = ag.bias_dropout_add(y, bias, r, 0.4, FixedDraws())
    np.testing.assert_array_equal(fused.data, ag.dropout_add(y + bias, r, 0.4, FixedDraws()).data)
    assert gradcheck(lambda a, b, c: ag.bias_dropout_add(a, b, c, 0.4, FixedDraws()), [y, bias, r]) < 1e-6
    for p, training in ((0.0, True), (0.4, False)):
        assert gradcheck(lambda a, b, c: ag.bias_dropout_add(a, b, c, p, FixedDraws(), training), [y, bias, r]) < 1e-6
        np.testing.assert_array_equal(ag.bias_dropout_add(y, bias, r, p, FixedDraws(), training).data,
                                      (r + (y + bias)).data)
    with pytest.raises(InputError, match="bias of y's last dimension"):
        ag.bias_dropout_add(y, leaf(4), r, 0.1, FixedDraws())


@pytest.mark.parametrize("rows", [slice(2, 6), np.array([5, 0, 3, 3])], ids=["slice", "index"])
@pytest.mark.parametrize("p", [0.4, None])
def test_add_rows_dropout_equals_its_parts_and_gradchecks(rows, p):
    """AddRowsDropout (the embedding's end under 16-bit storage) outside storage: dropout(x + the
    table's rows) as the two ops give it, and finite differences for x and the table, the rows a
    slice (positions) or an index array with a repeated row (context parallelism's positions)."""
    x, table = leaf(3, 4, 5), leaf(7, 5)
    fused = ag.ops.dropouts.AddRowsDropout.apply(x, table, rows=rows, p=p, generator=FixedDraws())
    expected = x + table[rows]
    if p:
        expected = ag.dropout(expected, p, FixedDraws())
    np.testing.assert_array_equal(fused.data, expected.data)
    assert gradcheck(lambda a, t: ag.ops.dropouts.AddRowsDropout.apply(a, t, rows=rows, p=p, generator=FixedDraws()),
                     [x, table]) < 1e-6
    assert gradcheck(lambda a: ag.ops.dropouts.AddRowsDropout.apply(a, None, rows=None, p=0.4, generator=FixedDraws()),
                     [x]) < 1e-6
    # outside 16-bit storage the public op is the two ops themselves
    np.testing.assert_array_equal(ag.add_rows_dropout(x, table, rows, 0.4, FixedDraws()).data,
                                  ag.dropout(x + table[rows], 0.4, FixedDraws()).data)
    assert ag.add_rows_dropout(x, None, None, 0.0, FixedDraws()) is x


def test_dropout_add_refuses_bad_input():
    with pytest.raises(InputError, match="outside"):
        ag.dropout_add(leaf(2), leaf(2), 1.0, FixedDraws())
    with pytest.raises(InputError, match="one shape"):
        ag.dropout_add(leaf(2, 3), leaf(3), 0.1, FixedDraws())


@pytest.mark.parametrize("op", [
    lambda x: ag.gelu(x), lambda x: ag.gelu(x, "none"), lambda x: ag.softmax(x, 0.7, causal=True),
    lambda x: ag.layer_norm(x, Tensor(np.linspace(0.5, 2, 5), requires_grad=True),
                            Tensor(np.linspace(-1, 1, 5), requires_grad=True)),
], ids=["gelu_tanh", "gelu_erf", "softmax", "layer_norm"])
def test_ops_on_chains_pass_finite_differences(op):
    assert gradcheck(op, [leaf(2, 5, 5)]) < 1e-6


def test_adamw_matches_the_textbook_update():
    p = Tensor(normal(4, 3), requires_grad=True)
    start = p.data.copy()
    opt = optimizer.AdamW([p], lr=0.01, weight_decay=0.1)
    m = v = 0
    for step in (1, 2):
        g = p.grad = normal(4, 3)
        opt.step()
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        start = start * (1 - 0.001) - 0.01 * (m / (1 - 0.9 ** step)) / (
            np.sqrt(v / (1 - 0.999 ** step)) + 1e-8)
    np.testing.assert_allclose(p.data, start, rtol=1e-13)


@pytest.fixture
def tiny_blocks(monkeypatch):
    """The CPU block engine on the tests' small arrays: blocks of a few rows, two threads."""
    from npmegatron.autograd import cpu_blocks, threads
    monkeypatch.setattr(cpu_blocks, "MIN_BLOCKED_ELEMENTS", 1)
    monkeypatch.setattr(cpu_blocks, "BLOCK_ELEMENTS", 8)
    previous = threads.set_cpu_threads(2)
    yield
    threads.set_cpu_threads(previous)


@pytest.mark.parametrize("name", sorted(_cases()))
def test_block_engine_gives_the_whole_array_results_bitwise(name, tiny_blocks):
    """Each chain cut into row blocks on two threads equals the body run once on whole arrays."""
    args, _ = _cases()[name]
    whole_args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    block_args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    whole = fusion.CHAINS[name].body(fusion.NUMPY_FUNCTIONS, *whole_args)
    blocked = fusion.CHAINS[name](*block_args)
    for got, want in zip(blocked if isinstance(blocked, tuple) else (blocked,),
                         whole if isinstance(whole, tuple) else (whole,)):
        np.testing.assert_array_equal(got, want)
        # it owns its memory: a pipeline stage frees its sent output, which may not be a view
        assert not isinstance(got, np.ndarray) or got.base is None, name
    for got, want in zip(block_args, whole_args):
        if isinstance(got, np.ndarray):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_compiled_layer_norm_equals_the_chains(dtype, rtol, monkeypatch):
    """The CPU's numba LayerNorm (large arrays) against the fused chains (GPU, small arrays)."""
    from npmegatron.autograd.ops import nn
    rng = np.random.default_rng(3)
    x, w, b, g = (rng.standard_normal(s).astype(dtype) for s in ((3, 50, 16), (16,), (16,), (3, 50, 16)))
    results = []
    for size in (1, 1 << 62):
        monkeypatch.setattr(nn, "COMPILED_LAYER_NORM_SIZE", size)
        leaves = [Tensor(a.copy(), requires_grad=True) for a in (x, w, b)]
        out = ag.layer_norm(*leaves)
        out.backward(g)
        results.append([out.data] + [t.grad for t in leaves])
    for got, want in zip(*results):
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
