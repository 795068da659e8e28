"""Intel MKL for NumPy's single matrix products (autograd/cpu_blas.py, the `mkl` extra): every
layout gemm.matmul hands it computes NumPy's product, batched products and the cases BLAS cannot
take stay with NumPy, and threadpoolctl limits MKL's threads. The tests that need MKL run where
the extra is installed (CI's second pass, .ci/run); without it, the NumPy path is checked."""
import os
import subprocess
import sys

import numpy as np
import pytest

from npmegatron.autograd import cpu_blas, gemm

needs_mkl = pytest.mark.skipif(not cpu_blas.available(), reason="the mkl extra is not installed")


@pytest.fixture
def calls(monkeypatch):
    """The products MKL ran, as (m, k, n), while the test runs."""
    seen = []
    run = cpu_blas.run

    def recording(operands, shape, batch_dims, accumulate):
        seen.append(shape)
        run(operands, shape, batch_dims, accumulate)

    monkeypatch.setattr(cpu_blas, "run", recording)
    return seen


def layouts(rng, dtype):
    """(a, b) pairs as the model's Linears pass them: plain, folded rows, transposed views (weight
    gradients, the tied output layer), strided rows; and sizes of 1."""
    r = lambda *shape: rng.standard_normal(shape).astype(dtype)
    return [(r(5, 7), r(7, 4)), (r(2, 3, 7), r(7, 4)), (r(7, 5).T, r(7, 4)), (r(5, 7), r(4, 7).T),
            (r(7, 5).T, r(4, 7).T), (r(5, 9)[:, :7], r(7, 6)[:, :4]), (r(64, 48), r(48, 80)),
            (r(1, 1, 7), r(7, 4)), (r(1, 7), r(7, 1)), (r(5, 1), r(1, 4)), (r(9, 1)[::3].T, r(3, 6)[:, ::2])]


@needs_mkl
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_layout_is_numpys_product(dtype, calls):
    rng = np.random.default_rng(0)
    tolerance = 1e-5 if dtype == np.float32 else 1e-13
    for a, b in layouts(rng, dtype):
        reference = np.matmul(a.astype(np.float64), b.astype(np.float64))
        product = gemm.matmul(a, b)
        assert product.dtype == dtype and product.shape == reference.shape
        np.testing.assert_allclose(product, reference, rtol=tolerance, atol=tolerance)
        into = np.full(reference.shape, 0.5, dtype)
        assert gemm.matmul(a, b, out=into, accumulate=True) is into
        np.testing.assert_allclose(into, reference + 0.5, rtol=tolerance, atol=tolerance)
        gemm.matmul(a, b, out=into)
        np.testing.assert_allclose(into, reference, rtol=tolerance, atol=tolerance)
    assert len(calls) == 3 * len(layouts(rng, dtype))
    assert (6, 7, 4) in calls           # (2, 3, 7) @ (7, 4): one product of 6 folded rows


@needs_mkl
def test_a_strided_out_and_empty_products(calls):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 5))
    wide = np.ones((3, 9))
    gemm.matmul(a, b, out=wide[:, 2:7], accumulate=True)       # rows 9 apart: MKL's ldc
    np.testing.assert_allclose(wide[:, 2:7], 1 + a @ b, rtol=1e-13)
    assert (wide[:, :2] == 1).all() and (wide[:, 7:] == 1).all()
    into = np.full((3, 5), 7.0)
    gemm.matmul(np.ones((3, 0)), np.ones((0, 5)), out=into)     # k = 0: zeros, no call
    assert (into == 0).all() and gemm.matmul(np.ones((0, 4)), b).shape == (0, 5)
    assert calls == [(3, 4, 5)]


@needs_mkl
def test_what_blas_cannot_take_stays_with_numpy(calls):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((3, 5, 7)).astype(np.float32), rng.standard_normal((3, 7, 4)).astype(np.float32)
    np.testing.assert_allclose(gemm.matmul(a, b), a @ b, rtol=1e-6)            # batched: attention's
    square = rng.standard_normal((6, 6)).astype(np.float32)
    gemm.matmul(square, square, out=square[:, :].view())                        # out over an operand
    ints = np.arange(12).reshape(3, 4)
    assert (gemm.matmul(ints, ints.T) == ints @ ints.T).all()                   # not a float
    big_endian = np.ones((4, 4), ">f4")
    assert (gemm.matmul(big_endian, big_endian) == 4).all()
    strided = a[:, :, ::2][..., :3]                                            # folded rows not C-contiguous
    np.testing.assert_allclose(gemm.matmul(strided, b[0, :3]), gemm.matmul(strided.copy(), b[0, :3]),
                               rtol=1e-5, atol=1e-5)
    read_only = np.broadcast_to(np.zeros(4, np.float32), (5, 4))             # strides (0, 4): writes would land in one row
    with pytest.raises(ValueError):
        gemm.matmul(a[0], b[0], out=read_only)                                 # NumPy refuses it
    record = np.zeros((5, 7), [("x", "f4"), ("y", "f2")])["x"]                 # strides (42, 6): not aligned
    assert (gemm.matmul(record, b[0]) == 0).all()
    assert calls == [(15, 3, 4)]        # only the copied, C-contiguous folded product
    with pytest.raises(ValueError):
        gemm.matmul(a[0], b[0, :6])     # shapes that disagree: NumPy's own error


@needs_mkl
def test_threadpoolctl_limits_mkl():
    from threadpoolctl import threadpool_info, threadpool_limits
    assert any(lib["internal_api"] == "mkl" for lib in threadpool_info())
    with threadpool_limits(limits=1, user_api="blas"):
        assert all(lib["num_threads"] == 1 for lib in threadpool_info() if lib["internal_api"] == "mkl")


@needs_mkl
def test_the_switch_keeps_numpys_gemms():
    code = "from npmegatron.autograd import cpu_blas; print(cpu_blas.available(), cpu_blas.name())"
    env = dict(os.environ, NPMEGATRON_CPU_BLAS="openblas")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split(None, 1) == ["False", "OpenBLAS (NumPy's)\n"], out.stderr


def test_without_mkl_numpy_multiplies(monkeypatch, calls):
    monkeypatch.setattr(cpu_blas, "_library", None)
    a = np.random.default_rng(2).standard_normal((2, 3, 7)).astype(np.float32)
    b = np.ones((7, 4), np.float32)
    np.testing.assert_allclose(gemm.matmul(a, b), a @ b, rtol=1e-6)
    assert not calls and not cpu_blas.available() and cpu_blas.name() == "OpenBLAS (NumPy's)"
