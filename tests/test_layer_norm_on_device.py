"""LayerNorm on a GPU (the strict stand-in): one launch forward, two backward (the input's
gradient, which also adds the residual path's gradient, and the weight's and bias's), by the row
kernels of autograd/row_kernels.py, whose NumPy twins the stand-in runs; values equal NumPy's.
tests/test_kernels_gpu.py holds the CUDA kernels to the same twins on a real GPU."""
import numpy
import pytest

from npmegatron import autograd as ag
from npmegatron.autograd import precision, row_kernels
from npmegatron.autograd.ops import nn


@pytest.fixture
def cp(fresh_strict_cupy):
    return fresh_strict_cupy


def residual_block(xp, host, storage=None):
    """h = 2 x; backward from layer_norm(h) with gradient r and from h itself with gradient s:
    h's gradient has two parts, the LayerNorm's and the residual path's, which the engine (or
    the row kernel) adds. Returns the output and every leaf's gradient."""
    x, weight, bias, r, s = (xp.asarray(a) for a in host)
    leaves = [ag.Tensor(a, requires_grad=True) for a in (x, weight, bias)]
    with precision.storage(storage):
        h = leaves[0] * 2.0
        y = ag.layer_norm(h, leaves[1], leaves[2])
        ag.backward([y, h], [r, s])
    return [y.data] + [leaf.grad for leaf in leaves]


def host_arrays(dtype, shape=(2, 5, 48)):
    rng = numpy.random.default_rng(3)
    return [rng.standard_normal(shape).astype(dtype) + 1, rng.standard_normal(shape[-1]).astype(dtype),
            rng.standard_normal(shape[-1]).astype(dtype), rng.standard_normal(shape).astype(dtype),
            rng.standard_normal(shape).astype(dtype)]


def test_one_launch_forward_two_backward_and_numpys_values(cp):
    host = host_arrays(numpy.float64)
    expected = residual_block(numpy, host)
    cp._strict.reset()
    got = residual_block(cp, host)
    names = [(launch.op.split(".")[-1], launch.name) for launch in cp._strict.launches()
             if launch.op.startswith("LayerNorm.")]
    assert names == [("forward", "layer_norm_forward_rows_double"), ("backward", "layer_norm_column_sums_double"),
                     ("backward", "layer_norm_backward_rows_double")]
    for g, e in zip(got, expected):
        numpy.testing.assert_allclose(cp.asnumpy(g), e, rtol=1e-12, atol=1e-12)


def test_the_residual_gradient_is_added_in_the_row_kernel_with_the_engines_numbers(cp, monkeypatch):
    """Bitwise what the engine's own add gives (pending + gx, as _accumulate computes it), one
    launch fewer."""
    host = host_arrays(numpy.float32)
    cp._strict.reset()
    fused = [cp.asnumpy(a) for a in residual_block(cp, host)]
    fused_launches = len(cp._strict.launches())
    monkeypatch.setattr(nn.LayerNorm, "adds_pending_grads", False)
    cp._strict.reset()
    apart = [cp.asnumpy(a) for a in residual_block(cp, host)]
    assert len(cp._strict.launches()) == fused_launches + 1
    for f, a in zip(fused, apart):
        assert numpy.array_equal(f, a)


def test_under_16_bit_storage_the_sum_is_left_to_the_engine(cp):
    """The results of a backward are rounded to the 16-bit grid; the residual's gradient is added
    after that rounding, so the kernel must not add it first."""
    host = host_arrays(numpy.float32)
    cp._strict.reset()
    got = residual_block(cp, host, "bf16")
    assert any(launch.op == "_accumulate" for launch in cp._strict.launches())
    expected = residual_block(numpy, host, "bf16")
    numpy.testing.assert_allclose(cp.asnumpy(got[1]), expected[1], rtol=1e-2, atol=1e-2)


def test_the_twins_are_the_chains_formulas_in_float64():
    """The CPU's chains (nn.py) and the row kernels' twins compute the same LayerNorm."""
    rng = numpy.random.default_rng(5)
    x, g, pending = (rng.standard_normal((6, 33)) * 3 + 2 for _ in range(3))
    weight, bias = rng.standard_normal(33), rng.standard_normal(33)
    out, xhat, rstd = numpy.empty_like(x), numpy.empty_like(x), numpy.empty((6, 1))
    row_kernels.layer_norm_forward_rows(x, weight, bias, xhat, out, rstd, numpy.int32(33), numpy.float64(1e-5))
    mean = x.mean(axis=-1, keepdims=True)
    square_sum = nn.centered_square_sum(x, mean).reshape(-1, 1)
    chain_xhat, chain_out = numpy.empty_like(x), numpy.empty_like(x)
    nn.layer_norm_forward_(x, mean, square_sum, 33.0, 1e-5, weight, bias, chain_xhat, chain_out)
    numpy.testing.assert_allclose(out, chain_out, rtol=1e-13, atol=1e-13)
    numpy.testing.assert_allclose(xhat, chain_xhat, rtol=1e-13, atol=1e-13)
    gx = numpy.empty_like(g)
    row_kernels.layer_norm_backward_rows(g, weight, xhat, rstd, pending, gx, numpy.int32(33), numpy.int32(1))
    sums = nn.layer_norm_row_sums(g, weight, xhat).reshape(-1, 1)
    chain_gx = numpy.empty_like(g)
    nn.layer_norm_backward_(g, weight, xhat, sums.real, sums.imag, square_sum, 33.0, 1e-5, chain_gx)
    numpy.testing.assert_allclose(gx, chain_gx + pending, rtol=1e-12, atol=1e-12)


def test_strided_inputs_take_the_chains(cp):
    rng = numpy.random.default_rng(1)
    x = cp.asarray(rng.standard_normal((40, 6)))[:, :4]     # rows not C-ordered
    weight, bias = cp.asarray(rng.standard_normal(4)), cp.asarray(rng.standard_normal(4))
    cp._strict.reset()
    ag.layer_norm(ag.Tensor(x), ag.Tensor(weight), ag.Tensor(bias))
    assert [launch.name for launch in cp._strict.launches()] == \
        ["mean", "centered_square_sum", "layer_norm_forward_"]


def test_the_stand_ins_raw_kernel_keeps_cudas_launch_rules(cp):
    source, name = row_kernels.KERNELS["layer_norm_forward_rows"].code(numpy.float64)
    kernel = cp.RawKernel(source, name)
    x = cp.zeros((3, 8))
    w, b = cp.ones(8), cp.zeros(8)
    outs = (cp.empty((3, 8)), cp.empty((3, 8)), cp.empty((3, 1)))
    with pytest.raises(TypeError, match="NumPy scalars"):
        kernel((3,), (32,), (x, w, b, *outs, 8, numpy.float64(1e-5)))
    with pytest.raises(ValueError, match="not C-ordered"):
        kernel((3,), (32,), (x.T, w, b, *outs, numpy.int32(8), numpy.float64(1e-5)))
    with pytest.raises(ValueError, match="1024"):
        kernel((3,), (2048,), (x, w, b, *outs, numpy.int32(8), numpy.float64(1e-5)))
    with pytest.raises(NotImplementedError, match="twin"):
        cp.RawKernel('extern "C" __global__ void k(float* x) {}', "k")
    with pytest.raises(ValueError, match="no __global__"):
        cp.RawKernel(source, "missing")
