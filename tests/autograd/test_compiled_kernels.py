"""The numba kernels of the float32 CPU path (bias + GeLU, attention's softmax and dropout parts,
residual + dropout, AdamW, the embedding's row scatter) against the chains they replace, in float64 where the kernel is
generic, bitwise where it does the chain's arithmetic, and to float32 round-off where it does
not. LayerNorm's kernel is tested in test_fusion.py."""
import numpy as np
import pytest

import npmegatron.autograd as ag
from npmegatron.autograd import Tensor
from npmegatron.autograd.ops import _attention_cpu, _dropout_cpu, _gelu_cpu, attention, elementwise
from npmegatron.autograd.ops import dropouts as dropout_ops
from npmegatron.autograd.ops.elementwise import bias_gelu_tanh, bias_gelu_tanh_backward
from npmegatron.tensor_parallel.random import MODEL_PARALLEL, RNGTracker
from npmegatron.optim import _adamw_cpu
from npmegatron.optim.adamw import AdamW, adamw_update_

RNG = np.random.default_rng(11)


def error_in_ulps(got, want, floor):
    """|got - want| in float32 ulps of max(|want|, floor): a relative error that stays finite
    where want is near 0 (there the absolute error counts, in ulps of the floor)."""
    scale = np.maximum(np.abs(want), floor).astype(np.float32)
    return (np.abs(got.astype(np.float64) - want) / np.spacing(scale)).max()


def test_exp_is_within_one_float32_ulp_and_flushes_below_the_normal_range():
    x = np.linspace(-87.3, 88.0, 1_000_003).astype(np.float32)
    got = np.empty_like(x)
    z = x.reshape(1, 1, -1).copy()
    _attention_cpu.probabilities_(z, x.size, np.zeros((1, 1), np.float32))     # exp(x - 0)
    got[:] = z.ravel()
    assert error_in_ulps(got, np.exp(x.astype(np.float64)), 0.0) <= 1.0
    z = np.array([[[-88.0, -200.0, -np.inf, 0.0]]], np.float32)
    _attention_cpu.probabilities_(z, 4, np.zeros((1, 1), np.float32))
    np.testing.assert_array_equal(z.ravel(), [0.0, 0.0, 0.0, 1.0])


def causal_scores(heads, rows, keys):
    z = RNG.standard_normal((heads, rows, keys)).astype(np.float32) * 4
    keys_before = keys - rows
    mask = np.arange(keys)[None, :] > keys_before + np.arange(rows)[:, None]
    return z, keys_before, mask


@pytest.mark.parametrize("rows, keys", [(5, 12), (7, 40), (3, 33), (20, 64)])
def test_softmax_numerators_equal_the_masked_exponentials(rows, keys):
    """Rows shorter than, equal to and longer than the row maximum's 16 lanes, with a tail."""
    z, keys_before, mask = causal_scores(3, rows, keys)
    z[0, -1, -1] = z.max() + 1         # the maximum of a row in the tail after its lanes
    reference = np.where(mask, -np.inf, z.astype(np.float64))
    shift = reference.max(axis=-1)
    numerators = np.exp(reference - shift[..., None])
    got, got_shift, got_total = z.copy(), np.empty((3, rows), np.float32), np.empty((3, rows), np.float32)
    _attention_cpu.softmax_numerators_(got, keys_before, got_shift, got_total)
    np.testing.assert_array_equal(got_shift, shift.astype(np.float32))
    # z - max rounds in float32 before exp (as in NumPy's chain): a few ulps for scores near 10.
    assert error_in_ulps(got, numerators, 1e-3) <= 8
    assert np.all(got[np.broadcast_to(mask, got.shape)] == 0)
    assert error_in_ulps(got_total, numerators.sum(axis=-1), 1.0) <= 4

    lse = (shift + np.log(numerators.sum(axis=-1))).astype(np.float32)
    probs = z.copy()
    _attention_cpu.probabilities_(probs, keys_before, lse)
    # against exp(z - lse) of the float32 lse the kernel is given: lse's own rounding (an ulp of
    # a number near 10 is ~1e-6) would otherwise be counted as the kernel's
    assert error_in_ulps(probs, np.exp(reference - lse[..., None].astype(np.float64)), 1e-3) <= 8


def test_softmax_backward_kernel_equals_the_chain_in_float64():
    g, y = RNG.standard_normal((2, 4, 3, 7))
    dot = RNG.standard_normal((4, 3))
    want = (g - dot[..., None]) * y * 0.3
    _attention_cpu.softmax_backward_(g, y, dot, 0.3)
    np.testing.assert_allclose(g, want, rtol=1e-14, atol=1e-15)


def test_dropout_kernels_equal_the_chains_bitwise():
    """The float32 dropout kernels (attention's probabilities, their backward, residual + dropout)
    against the fused chains they replace, on the same keep masks: bitwise."""
    g, y, z, residual = (RNG.standard_normal((4, 48, 80)).astype(np.float32) for _ in range(4))
    y = np.abs(y) / 80
    dot = RNG.standard_normal((4, 48, 1)).astype(np.float32)
    keep = RNG.random((4, 48, 80)) >= 0.3
    ds, scale = np.float32(1 / 0.7), np.float32(0.125)

    want_z, got_z = z.copy(), z.copy()
    attention.dropout_(want_z, keep, 1 / 0.7)
    _attention_cpu.dropout_(got_z, keep, ds)
    assert np.array_equal(got_z, want_z)

    want_g, want_y, got_g, got_y = g.copy(), y.copy(), g.copy(), y.copy()
    attention.dropout_softmax_backward_(want_g, want_y, keep, dot, 1 / 0.7, 0.125)
    attention.dropout_(want_y, keep, 1 / 0.7)
    _attention_cpu.dropout_softmax_backward_(got_g, got_y, keep, dot[..., 0], ds, scale)
    assert np.array_equal(got_g, want_g) and np.array_equal(got_y, want_y)

    keep = RNG.random(z.shape).astype(np.float32) >= 0.3
    want_out = dropout_ops.dropout_add_forward(z, keep, residual, 1 / 0.7)
    assert np.array_equal(_dropout_cpu.dropout_add(z, keep, residual, 1 / 0.7), want_out)


def test_dropout_add_op_takes_the_kernel_with_the_chains_masks_and_values():
    """DropoutAdd on a large float32 array (the compiled path) gives the chain path's output and
    gradient bitwise, with the generator's masks."""
    tracker = RNGTracker(seed=3, tp_rank=0, xp=np)
    y64, r64 = RNG.standard_normal((2, 2, 128, 256))
    results = []
    for size in (dropout_ops.COMPILED_DROPOUT_SIZE, 1 << 62):
        dropout_ops.COMPILED_DROPOUT_SIZE = size
        try:
            y, r = Tensor(y64.astype(np.float32), requires_grad=True), Tensor(r64.astype(np.float32), requires_grad=True)
            out = dropout_ops.DropoutAdd.apply(y, r, p=0.25, generator=tracker.site(MODEL_PARALLEL, 2))
            out.backward(np.ones(out.shape, np.float32))
            results.append((out.data, y.grad, r.grad))
        finally:
            dropout_ops.COMPILED_DROPOUT_SIZE = 1 << 16
    assert y64.size >= dropout_ops.COMPILED_DROPOUT_SIZE
    for got, want in zip(*results):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_bias_dropout_add_op_takes_the_kernels_with_the_chains_values(p, monkeypatch):
    """BiasDropoutAdd on a large float32 array runs the compiled residual + dropout(y + bias), or
    residual + y + bias without dropout (p = 0, or evaluation): bitwise the chain's output and
    gradients with the generator's masks; small arrays keep the chain and never call a kernel."""
    tracker = RNGTracker(seed=5, tp_rank=0, xp=np)
    y64, r64 = RNG.standard_normal((2, 2, 128, 256))
    b64 = RNG.standard_normal(256)
    calls = []
    for name in ("bias_add_residual", "dropout_add"):
        kernel = getattr(_dropout_cpu, name)
        monkeypatch.setattr(_dropout_cpu, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    results = []
    for size in (dropout_ops.COMPILED_DROPOUT_SIZE, 1 << 62):
        monkeypatch.setattr(dropout_ops, "COMPILED_DROPOUT_SIZE", size)
        y, b, r = (Tensor(x.astype(np.float32), requires_grad=True) for x in (y64, b64, r64))
        out = dropout_ops.bias_dropout_add(y, b, r, p, tracker.site(MODEL_PARALLEL, 4))
        out.backward(np.ones(out.shape, np.float32))
        results.append((out.data, y.grad, b.grad, r.grad))
    assert calls == ["dropout_add" if p else "bias_add_residual"]
    for got, want in zip(*results):
        assert np.array_equal(got, want)
    if not p:
        assert np.array_equal(results[0][0], (y64.astype(np.float32) + b64.astype(np.float32)) + r64.astype(np.float32))


def test_bias_of_another_width_keeps_the_chain():
    """The kernels read one bias number per column unchecked: a bias that only broadcasts (one
    number) takes the chain, with NumPy's broadcasting."""
    y = np.ones((256, 256), np.float32)
    out = dropout_ops.BiasDropoutAdd.apply(y, np.full(1, 2.0, np.float32), np.zeros_like(y), p=None, generator=None)
    assert np.array_equal(out.data, np.full_like(y, 3.0))


@pytest.mark.parametrize("p, keys", [(0.0, 128), (0.2, 128), (0.0, 200)])
def test_compiled_attention_equals_the_float64_path(p, keys):
    """float32 attention large enough for the kernels (b h t^2 = 2^16) against the NumPy path in
    float64, with the same dropout masks; also with more keys than queries (a KV cache), whose
    gradients the compiled shares write whole."""
    b, h, t, d = 2, 2, 128, 16
    assert b * h * t * t >= attention.MIN_SHARED_SCORES
    tracker = RNGTracker(seed=5, tp_rank=0, xp=np)
    leaves64 = [RNG.standard_normal((b, h, n, d)) for n in (t, keys, keys)]
    weights = RNG.standard_normal((b, h, t, d))
    results = []
    for dtype in (np.float32, np.float64):
        leaves = [Tensor(x.astype(dtype), requires_grad=True) for x in leaves64]
        out = ag.causal_attention(*leaves, 0.25, p, tracker.site(MODEL_PARALLEL, 4).frozen(), block_size=48)
        out.backward(weights.astype(dtype))
        results.append([out.data] + [x.grad for x in leaves])
    for got, want in zip(*results):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_compiled_packed_attention_equals_the_float64_path(p):
    """The packed op on the compiled path (each share's q, k, v copied contiguous out of the
    (b, t, heads, 3, d) projection, its gradients gathered in arrays of its own and written back)
    against the NumPy path in float64, on two threads, with a last block shorter than the rest."""
    from npmegatron.autograd.threads import set_cpu_threads
    b, t, h, d = 1, 160, 3, 16
    assert b * h * t * t >= attention.MIN_SHARED_SCORES
    tracker = RNGTracker(seed=6, tp_rank=0, xp=np)
    qkv64, weights = RNG.standard_normal((b, t, h, 3, d)), RNG.standard_normal((b, h, t, d))
    results = []
    previous = set_cpu_threads(2)
    try:
        for dtype in (np.float32, np.float64):
            qkv = Tensor(qkv64.astype(dtype), requires_grad=True)
            out = ag.causal_attention_packed(qkv, 0.25, p, tracker.site(MODEL_PARALLEL, 4).frozen(), block_size=128)
            out.backward(weights.astype(dtype))
            results.append([out.data, qkv.grad])
    finally:
        set_cpu_threads(previous)
    for got, want in zip(*results):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())


def test_bias_gelu_kernels_are_closer_to_float64_than_the_float32_chain():
    y = (RNG.standard_normal((64, 96)) * 3).astype(np.float32)
    b, g = RNG.standard_normal(96).astype(np.float32), RNG.standard_normal((64, 96)).astype(np.float32)
    x64 = (y + b).astype(np.float64)        # the float32 sum, as the chain and the kernel take it
    want, t64 = bias_gelu_tanh(x64, np.zeros(96))
    want_gy = bias_gelu_tanh_backward(g.astype(np.float64), x64, np.zeros(96), t64)
    chain, t32 = bias_gelu_tanh(y, b)
    chain_gy = bias_gelu_tanh_backward(g, y, b, t32)
    got = _gelu_cpu.forward(y, b)
    got_gy, got_gb = _gelu_cpu.backward(g, y, b)
    # Both are float32 arithmetic; the chain's 1 + tanh cancels where gelu is near 0, the
    # kernel's logistic form does not, so the kernel is the closer of the two.
    ours, theirs = error_in_ulps(got, want, 1e-2), error_in_ulps(chain, want, 1e-2)
    assert ours <= 16 and ours < theirs
    # gelu' crosses 0 near x = -0.75, as the difference of two terms of about 0.23: the gradient's
    # error is counted in ulps of those terms there.
    terms = 0.25 * np.abs(g)
    ours, theirs = error_in_ulps(got_gy, want_gy, terms), error_in_ulps(chain_gy, want_gy, terms)
    assert ours <= 16 and ours < theirs
    np.testing.assert_allclose(got_gb, want_gy.sum(axis=0), rtol=1e-5, atol=1e-5 * np.abs(want_gy).sum(axis=0).max())


def test_bias_gelu_takes_the_kernels_for_large_float32_arrays(monkeypatch):
    y = RNG.standard_normal((4, 8, 32)).astype(np.float32)
    b, g = RNG.standard_normal(32).astype(np.float32), RNG.standard_normal((4, 8, 32)).astype(np.float32)
    results = []
    for size in (1, 1 << 62):
        monkeypatch.setattr(elementwise, "COMPILED_GELU_SIZE", size)
        leaves = [Tensor(a.copy(), requires_grad=True) for a in (y, b)]
        out = ag.bias_gelu(*leaves)
        out.backward(g)
        results.append([out.data] + [t.grad for t in leaves])
    for got, want in zip(*results):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def adamw_state(dtype, n=5000):
    p, g, m = (RNG.standard_normal(n).astype(dtype) for _ in range(3))
    return p, g, m, np.abs(RNG.standard_normal(n)).astype(dtype)


SCALARS = (0.999, 0.9, 0.1, 0.99, 0.01, 1 / np.sqrt(0.0199), 1e-8, 1e-3 / 0.19)


def test_adamw_kernel_is_the_chains_arithmetic_in_float64():
    chain, kernel = adamw_state(np.float64), None
    kernel = tuple(a.copy() for a in chain)
    decayed = np.arange(chain[0].size) % 3 != 0         # decay on some elements only
    adamw_update_(*chain, decayed, 1.0, *SCALARS)
    _adamw_cpu._update(*kernel, decayed, 1.0, *SCALARS)
    for got, want in zip(kernel, chain):
        np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-16)


def test_adamw_takes_the_kernel_for_large_float32_parameters(monkeypatch):
    from npmegatron.optim import adamw as optimizer
    results, (p, g, _, _) = [], adamw_state(np.float32, 3000)
    for size in (1, 1 << 62):
        monkeypatch.setattr(optimizer, "COMPILED_UPDATE_SIZE", size)
        param = Tensor(p.reshape(30, 100).copy(), requires_grad=True)
        param.grad = g.reshape(30, 100)
        opt = AdamW([param], lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            opt.step()
        results.append([param.data, opt.exp_avg[0], opt.exp_avg_sq[0]])
    for got, want in zip(*results):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_scatter_kernel_equals_add_at_bitwise(dtype):
    """The embedding's backward (backend.scatter_add of rows): the compiled loop adds the rows in
    their order, as numpy.add.at does, repeated indices included; below its size, or with an index
    outside the target, NumPy's paths run (an out-of-range row is NumPy's IndexError)."""
    from npmegatron.autograd import backend
    index = RNG.integers(0, 50, 3000)                 # every row repeated about 60 times
    values = RNG.standard_normal((3000, 64)).astype(dtype)
    assert values.size >= backend.COMPILED_SCATTER_SIZE
    start = RNG.standard_normal((50, 64)).astype(dtype)
    got, want = start.copy(), start.copy()
    assert backend._compiled_rows(got, index, values)
    backend.scatter_add(got, index, values)
    np.add.at(want, index, values)
    np.testing.assert_array_equal(got, want)
    assert not backend._compiled_rows(got, index[:10], values[:10])
    small = start.copy()
    backend.scatter_add(small, index[:10], values[:10])
    np.testing.assert_allclose(small, _add_at(start, index[:10], values[:10]), rtol=1e-6, atol=1e-6)
    outside = index.copy()
    outside[7] = 50
    assert not backend._compiled_rows(got, outside, values)
    with pytest.raises(IndexError):
        backend.scatter_add(got, outside, values)
    # NumPy's paths, to round-off: a negative index (a row counted from the end), another dtype,
    # strided values
    negative = index.copy()
    negative[7] = -1
    other = values.astype(np.float64 if dtype == np.float32 else np.float32)
    strided = np.repeat(values, 2, axis=1)[:, ::2]
    for target_index, vals in ((negative, values), (index, other), (index, strided)):
        assert not backend._compiled_rows(start, target_index, vals)
        got = start.copy()
        backend.scatter_add(got, target_index, vals)
        np.testing.assert_allclose(got, _add_at(start, target_index, vals), rtol=1e-5, atol=1e-5)


def _add_at(start, index, values):
    out = start.copy()
    np.add.at(out, index, values)
    return out
