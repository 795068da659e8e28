"""The tape: accumulation, needs_input_grad, deep graphs, freeing, explicit-gradient backward."""
import weakref

import numpy as np
import pytest

import npmegatron.autograd as ag
from npmegatron.autograd import Function, InputError, Tensor, no_grad


def test_gradients_accumulate_across_uses_and_calls():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    (x * x + x).sum().backward()
    np.testing.assert_array_equal(x.grad, [3.0, 5.0])
    (x * 2).sum().backward()
    np.testing.assert_array_equal(x.grad, [5.0, 7.0])


def test_shared_gradient_arrays_are_not_aliased_into_leaves():
    a = Tensor(np.ones(3), requires_grad=True)
    b = Tensor(np.ones(3), requires_grad=True)
    (a + b).sum().backward()          # Add hands the same array to both inputs
    a.grad *= 10
    np.testing.assert_array_equal(b.grad, np.ones(3))


def test_needs_input_grad_skips_unneeded_gradients():
    calls = []

    class Probe(Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * b

        @staticmethod
        def backward(ctx, g):
            calls.append(ctx.needs_input_grad)
            return (g if ctx.needs_input_grad[0] else None), (g if ctx.needs_input_grad[1] else None)

    w = Tensor(np.ones(2), requires_grad=True)
    Probe.apply(w, Tensor(np.ones(2))).sum().backward()
    assert calls == [(True, False)]
    # nothing requires grad: no node is recorded at all
    assert Probe.apply(Tensor(np.ones(2)), Tensor(np.ones(2))).grad_fn is None


def test_deep_graph_needs_no_recursion():
    x = Tensor(np.array(1.0), requires_grad=True)
    y = x
    for _ in range(20000):
        y = y * 1.0001
    y.backward()
    assert x.grad == pytest.approx(1.0001 ** 20000)


def test_saved_arrays_and_intermediates_are_freed_after_use():
    x = Tensor(np.random.default_rng(0).standard_normal((4, 4)), requires_grad=True)
    h = ag.tanh(x)
    ref = weakref.ref(h.grad_fn.ctx.saved[0])
    node = h.grad_fn
    loss = (h * h).sum()
    del h
    loss.backward()
    assert node.ctx is None and ref() is None
    with pytest.raises(RuntimeError, match="a second time"):
        loss.backward()


def test_explicit_gradient_backward_works_after_the_output_data_is_freed():
    """The pipeline frees a sent output's data and backpropagates with the received gradient."""
    x = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    w = Tensor(np.ones((3, 3)), requires_grad=True)
    out = ag.gelu(x @ w)
    g = np.random.default_rng(1).standard_normal(out.shape)
    expected_x = Tensor(x.data.copy(), requires_grad=True)
    ag.backward([ag.gelu(expected_x @ Tensor(np.ones((3, 3))))], [g])
    out.data = np.empty(1)      # deallocated: one element, graph kept
    ag.backward([out], [g])
    np.testing.assert_allclose(x.grad, expected_x.grad)
    assert w.grad.shape == (3, 3)


def test_backward_of_several_outputs_at_once():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    a = x * 3
    b = a * x
    ag.backward([a, b], [np.ones(2), np.ones(2)])
    np.testing.assert_allclose(x.grad, 3 + 6 * x.data)


def test_no_grad_records_nothing():
    x = Tensor(np.ones(2), requires_grad=True)
    with no_grad():
        y = x * 2
    assert y.grad_fn is None and not y.requires_grad
    assert ag.is_grad_enabled()


def test_backward_on_non_scalar_without_gradient_is_a_clear_error():
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(InputError, match=r"backward\(\) on a tensor of shape \(2, 3\) needs an explicit gradient"):
        (x * 2).backward()
    with pytest.raises(InputError, match="does not require grad"):
        Tensor(np.ones(1)).backward()


def test_a_branch_no_gradient_reaches_is_released():
    class BlockGradient(Function):
        @staticmethod
        def forward(ctx, a):
            return a.copy()

        @staticmethod
        def backward(ctx, g):
            return None

    x = Tensor(np.ones(3), requires_grad=True)
    blocked = ag.exp(x * 2)
    node = blocked.grad_fn
    (BlockGradient.apply(blocked) + x).sum().backward()
    np.testing.assert_array_equal(x.grad, np.ones(3))
    assert node.ctx is None       # its saved exp output was dropped, not kept alive
