"""autograd.gemm.matmul on the strict stand-in's cuBLAS (raw pointers, column-major, checked
leading dimensions): every layout the model hands it (transposed views, strided views of a fused
QKV output, broadcast weights, `out=` slices, accumulation) equals NumPy, as one call with the
intended transposes and compute type and no copy."""
import itertools

import ml_dtypes
import numpy
import pytest

from fakes.strict_cupy import strict_cupy
from npmegatron.autograd import gemm


@pytest.fixture
def cp(monkeypatch):
    monkeypatch.setitem(gemm._settings, "tf32", False)      # restored after the test
    with strict_cupy(devices=1) as module:
        module._strict.reset()
        yield module


def calls(cp):
    return [(r.kind, r.name, r.fields.get("transa"), r.fields.get("transb"), r.fields.get("batch"),
             r.fields.get("compute")) for r in cp._strict.launches()]


def operand(cp, rng, shape, transposed, dtype=numpy.float64):
    """A device array of `shape`, stored transposed (a view) when asked."""
    if transposed:
        host = rng.standard_normal(shape[:-2] + shape[-2:][::-1]).astype(dtype)
        return cp.asarray(host).swapaxes(-1, -2), host.swapaxes(-1, -2)
    host = rng.standard_normal(shape).astype(dtype)
    return cp.asarray(host), host


@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("shapes", [((5, 3), (3, 4)), ((2, 5, 3), (3, 4)), ((2, 3, 5, 3), (2, 3, 3, 4)),
                                    ((2, 1, 5, 3), (3, 3, 4)), ((1, 3), (3, 1)), ((4, 5, 3), (4, 3, 1))])
def test_every_layout_equals_numpy_in_one_call_without_copies(cp, ta, tb, shapes):
    rng = numpy.random.default_rng(0)
    (a, ha), (b, hb) = operand(cp, rng, shapes[0], ta), operand(cp, rng, shapes[1], tb)
    cp._strict.reset()
    product = gemm.matmul(a, b)
    numpy.testing.assert_allclose(cp.asnumpy(product), ha @ hb, rtol=1e-13)
    kinds = [r.kind for r in cp._strict.launches()]
    assert kinds.count("copy") == 0 and "elementwise" not in kinds, calls(cp)
    assert all(r.fields["compute"] == "64F" and r.fields.get("direct") for r in cp._strict.launches("gemm"))


def test_a_weight_folds_the_batch_into_rows_and_transposes_are_flags(cp):
    rng = numpy.random.default_rng(1)
    x, hx = operand(cp, rng, (2, 6, 4), False, numpy.float32)
    w, hw = operand(cp, rng, (5, 4), False, numpy.float32)
    cp._strict.reset()
    y = gemm.matmul(x, w.T)                                   # g @ w^T: one gemmEx, w transposed
    numpy.testing.assert_allclose(cp.asnumpy(y), hx @ hw.T, rtol=1e-5)
    assert calls(cp) == [("gemm", "gemmEx", "T", "N", 1, "32F")]


def test_strided_heads_of_a_fused_qkv_need_no_copy(cp):
    """q, k (b=1, heads, t, d) as views of qkv (b, t, 3, heads, d): one strided-batched call; with
    b = 2 the batch does not fold into one stride, so one call per sequence."""
    rng = numpy.random.default_rng(2)
    for b in (1, 2):
        qkv_host = rng.standard_normal((b, 7, 3, 4, 8)).astype(numpy.float32)
        qkv = cp.asarray(qkv_host)
        q, k = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in (0, 1))
        cp._strict.reset()
        scores = gemm.matmul(q, k.swapaxes(-1, -2))
        hq, hk = (qkv_host[:, :, i].transpose(0, 2, 1, 3) for i in (0, 1))
        numpy.testing.assert_allclose(cp.asnumpy(scores), hq @ hk.swapaxes(-1, -2), rtol=1e-5)
        assert calls(cp) == [("gemm", "gemmStridedBatchedEx", "T", "N", 4, "32F")] * b


def test_out_slices_accumulate_with_beta_one(cp):
    rng = numpy.random.default_rng(3)
    (a, ha), (g, hg) = operand(cp, rng, (2, 3, 5, 4), True), operand(cp, rng, (2, 3, 5, 6), False)
    total_host = rng.standard_normal((2, 3, 9, 6))
    total = cp.asarray(total_host)
    cp._strict.reset()
    gemm.matmul(a.swapaxes(-1, -2), g, out=total[..., 2:6, :], accumulate=True)
    total_host[..., 2:6, :] += ha.swapaxes(-1, -2) @ hg
    numpy.testing.assert_allclose(cp.asnumpy(total), total_host, rtol=1e-13)
    assert [r.name for r in cp._strict.launches()] == ["gemmStridedBatchedEx"]


@pytest.mark.parametrize("dtype,out_dtype", [(numpy.float16, numpy.float16), (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
                                             (ml_dtypes.bfloat16, numpy.float32), (numpy.float16, numpy.float32)])
def test_16_bit_inputs_reach_cublas_with_float32_accumulation(cp, dtype, out_dtype):
    rng = numpy.random.default_rng(4)
    (a, ha), (b, hb) = operand(cp, rng, (3, 4, 16), False, dtype), operand(cp, rng, (3, 16, 5), True, dtype)
    out = cp.zeros((3, 4, 5), out_dtype)
    cp._strict.reset()
    gemm.matmul(a, b, out=out)
    expected = (ha.astype(numpy.float32) @ hb.astype(numpy.float32)).astype(out_dtype)
    numpy.testing.assert_array_equal(cp.asnumpy(out), expected)
    (call,) = cp._strict.launches()
    assert (call.name, call.fields["a"], call.fields["c"], call.fields["compute"]) == \
        ("gemmStridedBatchedEx", numpy.dtype(dtype).name, numpy.dtype(out_dtype).name, "32F")


def test_tf32_reaches_batched_products_too(cp):
    gemm.enable_tf32()
    a = cp.ones((2, 3, 4), cp.float32)
    gemm.matmul(a, a.swapaxes(-1, -2))
    gemm.matmul(a, cp.ones((4, 2), cp.float32))
    assert {r.fields["compute"] for r in cp._strict.launches("gemm")} == {"32F_FAST_TF32"}


@pytest.fixture
def numpy_blas(monkeypatch):
    """NumPy's own GEMMs even where the mkl extra is installed (tests/autograd/test_cpu_blas.py
    checks MKL's)."""
    from npmegatron.autograd import cpu_blas
    monkeypatch.setattr(cpu_blas, "_library", None)


def test_numpy_keeps_its_own_product(numpy_blas):
    rng = numpy.random.default_rng(5)
    a, b, out = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal((2, 3, 5))
    expected = out + a @ b
    assert gemm.matmul(a, b, out=out, accumulate=True) is out
    numpy.testing.assert_allclose(out, expected, rtol=1e-14)
    numpy.testing.assert_allclose(gemm.matmul(a, b), a @ b, rtol=1e-14)


def test_numpy_writes_into_out_bitwise_as_its_own_product_and_falls_back_where_blas_cannot(numpy_blas):
    """out= on the NumPy path: the GEMM writes into out itself where its rows are evenly spaced
    (a slice of a wider array, a batch, rows folded), bitwise the product NumPy returns; a
    transposed out or another dtype still gets the product."""
    rng = numpy.random.default_rng(6)
    a3, a, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((3, 4)), rng.standard_normal((4, 5))
    wide = numpy.zeros((3, 9))
    cases = [(a, b, wide[:, 2:7]), (a3, b, numpy.empty((2, 3, 5))),
             (a3, rng.standard_normal((2, 4, 5)), numpy.empty((2, 3, 5))),
             (a, b, numpy.empty((5, 3)).T), (a, b, numpy.empty((3, 5), numpy.float32))]
    for x, y, out in cases:
        assert gemm.matmul(x, y, out=out) is out
        numpy.testing.assert_array_equal(out, (x @ y).astype(out.dtype))
    assert not wide[:, :2].any() and not wide[:, 7:].any()


@pytest.mark.parametrize("grid,dtype,compute", [("bf16", ml_dtypes.bfloat16, "32F_FAST_16BF"),
                                                ("fp16", numpy.float16, "32F_FAST_16F")])
def test_float32_operands_on_a_16_bit_grid_reach_16_bit_tensor_cores(cp, grid, dtype, compute):
    """grid=: both float32 operands lie on the 16-bit grid, so cuBLAS may convert them exactly;
    the stand-in refuses an operand that the conversion would change."""
    rng = numpy.random.default_rng(6)
    ha, hb = (rng.standard_normal(shape).astype(dtype).astype(numpy.float32) for shape in ((2, 5, 16), (16, 3)))
    a, b = cp.asarray(ha), cp.asarray(hb)
    cp._strict.reset()
    numpy.testing.assert_allclose(cp.asnumpy(gemm.matmul(a, b, grid=grid)), ha @ hb, rtol=1e-6)
    assert calls(cp) == [("gemm", "gemmEx", "N", "N", 1, compute)]
    off_grid = cp.asarray(ha + numpy.float32(1e-4))
    with pytest.raises(AssertionError, match="off the"):
        gemm.matmul(off_grid, b, grid=grid)
