"""GEMMs with cuBLASLt's epilogues (autograd/epilogues.py) on the strict stand-in of nvmath-python
(tests/fakes/strict_cupy/nvmath): the stand-in takes the real package's calls and refuses what the
library refuses; a layout the library will not plan falls back to the kernels, with the same
numbers. tests/test_16_bit_kept_on_device.py holds a model step with and without the epilogues to
the CPU's emulation; tests/test_kernels_gpu.py holds the real library to the same numbers."""
import importlib.util
import inspect
import subprocess
import sys

import numpy
import pytest

from npmegatron.autograd import epilogues, precision


@pytest.fixture
def cp(fresh_strict_cupy):
    return fresh_strict_cupy


def sixteen_bit(cp, rng, shape, fmt="bf16"):
    return cp.asarray((rng.standard_normal(shape) * 0.5).astype(precision.sixteen_bit_dtype(fmt)))


def test_the_epilogues_write_the_row_major_results_the_kernels_would(cp):
    rng = numpy.random.default_rng(0)
    x, w, b, g = (sixteen_bit(cp, rng, s) for s in ((2, 8, 16), (16, 24), (24,), (2, 8, 16)))
    wide = [cp.asnumpy(a).astype(numpy.float32) for a in (x, w, b, g)]
    pre = wide[0] @ wide[1] + wide[2]
    y = epilogues.linear_bias(x, w, b)
    assert y.shape == (2, 8, 24) and y.flags.c_contiguous
    numpy.testing.assert_array_equal(cp.asnumpy(y), pre.astype(y.dtype))
    h, a = epilogues.linear_bias_gelu(x, w, b)
    numpy.testing.assert_array_equal(cp.asnumpy(a), pre.astype(a.dtype))
    gelu = 0.5 * pre * (1 + numpy.tanh(numpy.sqrt(2 / numpy.pi) * (pre + 0.044715 * pre ** 3)))
    numpy.testing.assert_allclose(cp.asnumpy(h).astype(numpy.float32), gelu, rtol=2 ** -7, atol=1e-3)
    w2 = cp.ascontiguousarray(w.T)          # (24, 16): the second layer's weight
    d = epilogues.gelu_input_grad(g, w2, a)
    assert d.shape == a.shape and d.flags.c_contiguous
    gemms = cp._strict.launches("gemm")
    assert [r.fields["epilogue"] for r in gemms] == ["BIAS", "GELU_AUX_BIAS", "DGELU"]
    assert len(epilogues._plans) == 3
    epilogues.linear_bias(x, w, b)          # the cached plan, new operands
    assert len(epilogues._plans) == 3 and all(plan.released for plan in epilogues._plans.values())


def test_the_stand_in_refuses_what_nvmath_refuses(cp):
    from nvmath.linalg.advanced import Matmul, MatmulEpilog
    rng = numpy.random.default_rng(1)
    a, b = sixteen_bit(cp, rng, (24, 16)), sixteen_bit(cp, rng, (16, 8))
    with pytest.raises(ValueError, match="one dtype"):
        Matmul(a, b.astype(numpy.float32))
    with pytest.raises(ValueError, match="multiply"):
        Matmul(a, a)
    plan = Matmul(a, b)
    with pytest.raises(ValueError, match="takes inputs"):
        plan.plan(epilog=MatmulEpilog.BIAS)
    with pytest.raises(ValueError, match="result's dtype"):
        plan.plan(epilog=MatmulEpilog.BIAS, epilog_inputs={"bias": cp.zeros(24, numpy.float32)})
    with pytest.raises(ValueError, match="column-major"):
        plan.plan(epilog=MatmulEpilog.DGELU, epilog_inputs={"gelu_aux": cp.zeros((24, 8), a.dtype)})
    with pytest.raises(RuntimeError, match="before plan"):
        plan.execute()
    plan.plan(epilog=MatmulEpilog.BIAS, epilog_inputs={"bias": cp.zeros(24, a.dtype)})
    plan.execute()
    plan.release_operands()
    with pytest.raises(ValueError, match="all required operands"):
        plan.reset_operands(a=a, b=b)
    with pytest.raises(ValueError, match="planned"):
        plan.reset_operands(a=a, b=sixteen_bit(cp, rng, (16, 9)), epilog_inputs={"bias": cp.zeros(24, a.dtype)})


def test_a_layout_the_library_refuses_runs_the_kernels(cp, monkeypatch):
    """cuBLASLt with no algorithm for a layout (its plan() raising): None, remembered, and the
    callers' kernels give the same numbers."""
    from nvmath.linalg import advanced
    rng = numpy.random.default_rng(2)
    x, w, b = sixteen_bit(cp, rng, (8, 16)), sixteen_bit(cp, rng, (16, 24)), sixteen_bit(cp, rng, (24,))
    want = cp.asnumpy(epilogues.linear_bias(x, w, b))

    def refuse(plan, **kwargs):
        raise RuntimeError("no algorithm for this layout")
    monkeypatch.setattr(advanced.Matmul, "plan", refuse)
    monkeypatch.setattr(epilogues, "_plans", {})
    assert epilogues.linear_bias(x, w, b) is None and len(epilogues.unsupported) == 1
    from npmegatron import autograd as ag
    with precision.storage("bf16"):
        y = ag.linear(ag.Tensor(x), ag.Tensor(w), ag.Tensor(b))
    numpy.testing.assert_array_equal(cp.asnumpy(y.data), want)


@pytest.mark.skipif(importlib.util.find_spec("nvmath") is None, reason="nvmath-python (the gpu extra) is not installed")
def test_the_stand_in_takes_the_installed_nvmath_pythons_calls():
    """The stand-in's Matmul methods take the keywords the installed package takes (all that
    epilogues.py passes among them), and its epilogues are the package's by name and value."""
    script = ("import inspect, json\nfrom nvmath.linalg import advanced\n"
              "print(json.dumps({'methods': {m: list(inspect.signature(getattr(advanced.Matmul, m)).parameters)"
              " for m in ('__init__', 'plan', 'reset_operands', 'execute', 'release_operands')},"
              " 'epilogues': {e.name: int(e) for e in advanced.MatmulEpilog}}))")
    real = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert real.returncode == 0, real.stderr
    import json
    real = json.loads(real.stdout)
    from fakes.strict_cupy import strict_cupy
    with strict_cupy():
        from nvmath.linalg import advanced
        for method, names in real["methods"].items():
            ours = list(inspect.signature(getattr(advanced.Matmul, method)).parameters)
            assert set(ours) <= set(names) and set(names) - set(ours) <= {"quantization_scales"}, (method, ours)
        assert {e.name: int(e) for e in advanced.MatmulEpilog} == real["epilogues"]


def test_plans_beyond_the_cap_are_freed_and_forgotten(cp, monkeypatch):
    """Layouts that keep changing (a growing sequence): at MAX_PLANS every plan frees its cuBLASLt
    descriptors and workspace (free(); a Matmul does not when it dies) and the cache starts again."""
    monkeypatch.setattr(epilogues, "MAX_PLANS", 2)
    rng = numpy.random.default_rng(3)
    w, b = sixteen_bit(cp, rng, (16, 24)), sixteen_bit(cp, rng, (24,))
    made = []
    for rows in (4, 5, 6):
        epilogues.linear_bias(sixteen_bit(cp, rng, (rows, 16)), w, b)
        made += [plan for plan in epilogues._plans.values() if plan not in made]
    assert len(made) == 3 and [plan.freed for plan in made] == [True, True, False]
    assert list(epilogues._plans.values()) == made[2:]
