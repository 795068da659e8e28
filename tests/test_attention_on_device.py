"""Packed causal attention on a GPU (the strict stand-in): with more than one sequence, q, k, v
are copied heads-first once, so that each of attention's GEMMs is one cuBLAS call over batch x
heads, as many calls as for one sequence; values and gradients equal NumPy's."""
import numpy
import pytest

from npmegatron import autograd as ag


@pytest.fixture
def cp(fresh_strict_cupy):
    return fresh_strict_cupy


def attention(xp, qkv_host, g_host, block_size):
    qkv = ag.Tensor(xp.asarray(qkv_host), requires_grad=True)
    out = ag.causal_attention_packed(qkv, 0.125, 0.0, None, block_size=block_size)
    out.backward(xp.asarray(g_host))
    return out.data, qkv.grad


@pytest.mark.parametrize("batch", [1, 3])
def test_gemm_calls_do_not_grow_with_the_batch_and_values_equal_numpy(cp, batch):
    rng = numpy.random.default_rng(0)
    t, heads, d, block = 20, 4, 8, 8
    qkv, g = rng.standard_normal((batch, t, heads, 3, d)), rng.standard_normal((batch, heads, t, d))
    expected = attention(numpy, qkv, g, block)
    cp._strict.reset()
    got = attention(cp, qkv, g, block)
    gemms = cp._strict.launches("gemm")
    for a, b in zip(got, expected):
        numpy.testing.assert_allclose(cp.asnumpy(a), b, rtol=1e-12, atol=1e-12)
    blocks = -(-t // block)
    # per block: q k^T and p v forward; q k^T again, dP, dV, dQ and dK backward
    assert len(gemms) == 7 * blocks, [r.name for r in gemms]
    assert all(r.name == "gemmStridedBatchedEx" and r.fields["batch"] == batch * heads for r in gemms)
