"""Every op: gradcheck (central differences, float64) over several shapes, broadcasting
included, plus forward values against plain NumPy references."""
import math

import numpy as np
import pytest
from scipy.special import erf

import npmegatron.autograd as ag
from npmegatron.autograd import InputError, Tensor, gradcheck

RNG = np.random.default_rng(0)


def leaf(*shape, positive=False):
    data = RNG.standard_normal(shape)
    return Tensor(np.abs(data) + 0.5 if positive else data, requires_grad=True)


BINARY_SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 3, 4), (3, 1)), ((1, 4), (3, 1)), ((5,), ())]


@pytest.mark.parametrize("shapes", BINARY_SHAPES, ids=str)
@pytest.mark.parametrize("op", [ag.add, ag.sub, ag.mul, ag.div, ag.pow], ids=lambda f: f.__name__)
def test_binary_gradcheck(op, shapes):
    a, b = leaf(*shapes[0], positive=True), leaf(*shapes[1], positive=True)
    assert gradcheck(op, [a, b]) < 1e-6


@pytest.mark.parametrize("op", [ag.add, ag.sub, ag.mul, ag.div, ag.pow], ids=lambda f: f.__name__)
def test_binary_values_match_numpy(op):
    a, b = leaf(3, 4, positive=True), leaf(4, positive=True)
    ref = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power}
    np.testing.assert_allclose(op(a, b).data, ref[op.__name__](a.data, b.data))


def test_scalar_operands_and_operators():
    x = leaf(3, 2, positive=True)
    y = (2.0 - x) * 3 / x + x ** 2 - (-x) + 1 / (x + 1)
    ref = (2.0 - x.data) * 3 / x.data + x.data ** 2 + x.data + 1 / (x.data + 1)
    np.testing.assert_allclose(y.data, ref)
    assert gradcheck(lambda t: (2.0 - t) * 3 / t + t ** 2 - (-t) + 1 / (t + 1), [x]) < 1e-6
    assert (Tensor(np.ones(3, np.float32)) * 0.5).dtype == np.float32


def test_neg_gradcheck():
    assert gradcheck(ag.neg, [leaf(2, 3)]) < 1e-6


@pytest.mark.parametrize("shapes", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)),
                                    ((2, 1, 3, 4), (3, 4, 2)), ((3, 4), (2, 4, 6))], ids=str)
def test_matmul_gradcheck(shapes):
    a, b = leaf(*shapes[0]), leaf(*shapes[1])
    np.testing.assert_allclose(ag.matmul(a, b).data, a.data @ b.data)
    assert gradcheck(ag.matmul, [a, b]) < 1e-6


@pytest.mark.parametrize("shape", [(4, 3), (2, 5, 3)], ids=str)
def test_linear_gradcheck(shape):
    x, w, b = leaf(*shape), leaf(3, 6), leaf(6)
    np.testing.assert_allclose(ag.linear(x, w, b).data, x.data @ w.data + b.data)
    assert gradcheck(ag.linear, [x, w, b]) < 1e-6
    assert gradcheck(ag.linear, [x, w]) < 1e-6


@pytest.mark.parametrize("shape,new", [((2, 6), (3, 4)), ((2, 3, 4), (6, -1)), ((4,), (2, 2, 1))], ids=str)
def test_reshape_gradcheck(shape, new):
    assert gradcheck(lambda x: ag.reshape(x, new) * 2, [leaf(*shape)]) < 1e-6


@pytest.mark.parametrize("shape,axes", [((2, 3), None), ((2, 3, 4), (0, 2, 1)), ((2, 3, 4, 5), (2, 0, 3, 1))], ids=str)
def test_transpose_gradcheck(shape, axes):
    x = leaf(*shape)
    y = ag.transpose(x, axes) if axes else x.T
    np.testing.assert_array_equal(y.data, np.transpose(x.data, axes))
    assert gradcheck(lambda t: ag.transpose(t, axes) * 3, [x]) < 1e-6


@pytest.mark.parametrize("sections,axis", [(3, -1), ([1, 4], 1), (2, 0)], ids=str)
def test_split_gradcheck_uses_every_and_some_outputs(sections, axis):
    x = leaf(4, 6)
    parts = ag.split(x, sections, axis)
    for got, ref in zip(parts, np.split(x.data, sections, axis)):
        np.testing.assert_array_equal(got.data, ref)
    assert gradcheck(lambda t: ag.split(t, sections, axis)[0].sum() * 2 + ag.split(t, sections, axis)[-1].sum(), [x]) < 1e-6
    assert gradcheck(lambda t: ag.concatenate([p * (i + 1) for i, p in enumerate(ag.split(t, sections, axis))], axis), [x]) < 1e-6


def test_concatenate_gradcheck():
    a, b, c = leaf(2, 3), leaf(2, 1), leaf(2, 4)
    np.testing.assert_array_equal(ag.concatenate([a, b, c], 1).data, np.concatenate([a.data, b.data, c.data], 1))
    assert gradcheck(lambda *xs: ag.concatenate(xs, 1), [a, b, c]) < 1e-6


@pytest.mark.parametrize("index", [(slice(1, 3),), (slice(None), 2), (Ellipsis, slice(None, None, 2)),
                                   (np.array([0, 2, 0]),), (np.array([1, 1]), np.array([0, 0]))], ids=str)
def test_getitem_gradcheck_including_repeated_indices(index):
    x = leaf(3, 5)
    np.testing.assert_array_equal(x[index].data, x.data[index])
    assert gradcheck(lambda t: t[index] * 1.5, [x]) < 1e-6


@pytest.mark.parametrize("op", [ag.sum, ag.mean, ag.max], ids=lambda f: f.__name__)
@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, False), (-1, True), ((0, 2), False)], ids=str)
def test_reduction_gradcheck(op, axis, keepdims):
    x = leaf(2, 3, 4)
    ref = {"sum": np.sum, "mean": np.mean, "max": np.max}[op.__name__]
    np.testing.assert_allclose(op(x, axis, keepdims).data, ref(x.data, axis=axis, keepdims=keepdims))
    assert gradcheck(lambda t: op(t, axis, keepdims), [x]) < 1e-6


def test_max_shares_gradient_between_ties():
    x = Tensor(np.array([[1.0, 3.0, 3.0]]), requires_grad=True)
    ag.max(x, axis=1).sum().backward()
    np.testing.assert_array_equal(x.grad, [[0.0, 0.5, 0.5]])


@pytest.mark.parametrize("op", [ag.exp, ag.log, ag.tanh], ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [(5,), (2, 3, 4)], ids=str)
def test_pointwise_gradcheck(op, shape):
    x = leaf(*shape, positive=True)
    np.testing.assert_allclose(op(x).data, getattr(np, op.__name__)(x.data))
    assert gradcheck(op, [x]) < 1e-6


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("shape", [(7,), (3, 4, 5)], ids=str)
def test_gelu_gradcheck_and_values(approximate, shape):
    x = Tensor(RNG.standard_normal(shape) * 3, requires_grad=True)
    v = x.data
    if approximate == "tanh":
        ref = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
    else:
        ref = 0.5 * v * (1 + erf(v / math.sqrt(2)))
    np.testing.assert_allclose(ag.gelu(x, approximate).data, ref, rtol=1e-12, atol=1e-14)
    assert gradcheck(lambda t: ag.gelu(t, approximate), [x]) < 1e-6


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(5,), (2, 4, 4), (2, 3, 2, 5)], ids=str)
def test_softmax_gradcheck_and_values(causal, shape):
    x = leaf(*shape) if not causal or len(shape) > 1 else leaf(1, 5)
    scale = 0.7
    z = x.data * scale
    if causal:
        tq, tk = z.shape[-2:]
        z = np.where(np.arange(tk)[None, :] > np.arange(tk - tq, tk)[:, None], -np.inf, z)
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(ag.softmax(x, scale, causal).data, ref, rtol=1e-12)
    assert gradcheck(lambda t: ag.softmax(t, scale, causal), [x]) < 1e-6


def test_softmax_is_stable_for_large_logits():
    y = ag.softmax(Tensor(np.array([[1000.0, 1000.0, -1000.0]])))
    np.testing.assert_allclose(y.data, [[0.5, 0.5, 0.0]])


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 8)], ids=str)
def test_layer_norm_gradcheck_and_values(shape):
    x, w, b = leaf(*shape), leaf(shape[-1]), leaf(shape[-1])
    v = x.data
    ref = (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + 1e-5) * w.data + b.data
    np.testing.assert_allclose(ag.layer_norm(x, w, b).data, ref, rtol=1e-10)
    assert gradcheck(ag.layer_norm, [x, w, b]) < 1e-6


def test_dropout_mask_comes_from_the_generator_and_gradcheck():
    x = leaf(50, 40)
    y1 = ag.dropout(x, 0.3, np.random.default_rng(7))
    y2 = ag.dropout(x, 0.3, np.random.default_rng(7))
    np.testing.assert_array_equal(y1.data, y2.data)
    kept = y1.data != 0
    assert 0.6 < kept.mean() < 0.8
    np.testing.assert_allclose(y1.data[kept], x.data[kept] / 0.7)
    assert gradcheck(lambda t: ag.dropout(t, 0.3, np.random.default_rng(7)), [x]) < 1e-6
    assert ag.dropout(x, 0.3, np.random.default_rng(7), training=False) is x


@pytest.mark.parametrize("ids_shape", [(6,), (2, 5)], ids=str)
def test_embedding_gradcheck_with_repeated_tokens(ids_shape):
    ids = RNG.integers(0, 4, ids_shape)
    w = leaf(4, 3)
    np.testing.assert_array_equal(ag.embedding(ids, w).data, w.data[ids])
    assert gradcheck(lambda t: ag.embedding(ids, t), [w]) < 1e-6


@pytest.mark.parametrize("ignore_index", [None, 2])
@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 7)], ids=str)
def test_cross_entropy_gradcheck_and_values(shape, ignore_index):
    logits = leaf(*shape)
    targets = RNG.integers(0, shape[-1], shape[:-1])
    targets.reshape(-1)[0] = 2
    flat, t = logits.data.reshape(-1, shape[-1]), targets.reshape(-1)
    nll = np.log(np.exp(flat).sum(-1)) - flat[np.arange(t.size), t]
    keep = np.ones(t.size, bool) if ignore_index is None else t != ignore_index
    got = ag.cross_entropy(logits, targets, ignore_index).item()
    assert got == pytest.approx(nll[keep].mean(), rel=1e-12)
    assert gradcheck(lambda x: ag.cross_entropy(x, targets, ignore_index), [logits]) < 1e-6


def test_cross_entropy_uniform_logits_give_log_vocab():
    loss = ag.cross_entropy(Tensor(np.zeros((4, 256))), np.arange(4))
    assert loss.item() == pytest.approx(math.log(256))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ops_keep_float32_and_float64(dtype):
    x = Tensor(RNG.standard_normal((2, 3, 4)).astype(dtype), requires_grad=True)
    w = Tensor(np.ones(4, dtype), requires_grad=True)
    y = ag.layer_norm(ag.gelu(x @ Tensor(np.eye(4, dtype=dtype))), w, w * 0)
    y = ag.softmax(y, 0.5, causal=True)
    loss = ag.cross_entropy(y, np.zeros((2, 3), int))
    loss.backward()
    assert y.dtype == dtype and loss.dtype == dtype and x.grad.dtype == dtype


def test_bad_inputs_are_one_clear_sentence():
    with pytest.raises(InputError, match=r"cannot add shapes \(2, 3\) and \(4,\): they do not broadcast"):
        leaf(2, 3) + leaf(4)
    with pytest.raises(InputError, match="inner dimensions 3 and 4 differ"):
        leaf(2, 3) @ leaf(4, 5)
    with pytest.raises(InputError, match="token id 9 is outside the vocabulary .*give the embedding more rows$"):
        ag.embedding(np.array([1, 9]), leaf(5, 2))
    with pytest.raises(InputError, match="target id -1 is outside"):
        ag.cross_entropy(leaf(2, 5), np.array([0, -1]))
    with pytest.raises(InputError, match="cannot reshape"):
        leaf(2, 3).reshape(4)
    with pytest.raises(InputError, match="equal parts"):
        ag.split(leaf(2, 5), 2)
