"""The Llama family's ops (RMSNorm, rotary embeddings, SwiGLU, grouped-query head repetition):
values against a plain NumPy formula and gradients against central finite differences in float64."""
import numpy as np
import pytest

import npmegatron.autograd as ag
from npmegatron.autograd import InputError, Tensor, gradcheck


def leaf(*shape, seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


@pytest.mark.parametrize("shape", [(3, 8), (2, 5, 16)])
def test_rms_norm_values_and_gradcheck(shape):
    x, w = leaf(*shape), leaf(shape[-1], seed=1)
    expected = x.data / np.sqrt((x.data ** 2).mean(-1, keepdims=True) + 1e-6) * w.data
    assert np.allclose(ag.rms_norm(x, w, 1e-6).data, expected, rtol=1e-14, atol=0)
    assert gradcheck(lambda a, b: ag.rms_norm(a, b, 1e-6), [x, w]) < 1e-6


def reference_rotary(x, positions, rotary, base):
    """HF's apply_rotary_pos_emb: x * cos + rotate_half(x) * sin on the first `rotary` channels."""
    angles = np.outer(positions, 1.0 / base ** (np.arange(0, rotary, 2) / rotary))
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    part = x[..., :rotary]
    half = rotary // 2
    rotated = np.concatenate([-part[..., half:], part[..., :half]], -1)
    return np.concatenate([part * cos[:, None] + rotated * sin[:, None], x[..., rotary:]], -1)


@pytest.mark.parametrize("rotary", [8, 4])
def test_rotary_matches_hf_rotate_half_and_gradcheck(rotary):
    x = leaf(2, 5, 3, 8)
    positions = np.array([0, 1, 2, 7, 9])            # any positions: context parallelism's chunks
    angles = ag.rotary_angles(positions, rotary, 10000.0)
    cos, sin = np.cos(angles), np.sin(angles)
    assert np.allclose(ag.rotary(x, cos, sin).data, reference_rotary(x.data, positions, rotary, 10000.0),
                       rtol=0, atol=1e-14)
    assert gradcheck(lambda t: ag.rotary(t, cos, sin), [x]) < 1e-6


def test_rotary_backward_is_exactly_the_inverse_rotation():
    x = leaf(1, 4, 2, 6)
    cos, sin = np.cos(ag.rotary_angles(range(4), 6, 100.0)), np.sin(ag.rotary_angles(range(4), 6, 100.0))
    y = ag.rotary(x, cos, sin)
    g = np.random.default_rng(3).standard_normal(y.shape)
    ag.backward([y], [g])
    # <g, R x> = <R^T g, x> to rounding: backward is the transpose
    assert abs((g * y.data).sum() - (x.grad * x.data).sum()) < 1e-13


def test_swiglu_values_and_gradcheck():
    y = leaf(2, 3, 10)
    gate, up = y.data[..., :5], y.data[..., 5:]
    assert np.allclose(ag.swiglu(y).data, gate / (1 + np.exp(-gate)) * up, rtol=1e-14, atol=0)
    assert gradcheck(ag.swiglu, [y]) < 1e-6
    with pytest.raises(InputError, match="even size"):
        ag.swiglu(leaf(2, 3))


def test_repeat_heads_values_and_gradcheck():
    x = leaf(2, 3, 4, 5)
    assert np.array_equal(ag.repeat_heads(x, 2).data[:, 2], x.data[:, 1])
    assert np.array_equal(ag.repeat_heads(x, 2).data[:, 3], x.data[:, 1])
    assert gradcheck(lambda t: ag.repeat_heads(t, 3) * 1.5, [x]) < 1e-6
    assert ag.repeat_heads(x, 1) is x
