"""A leaf takes a gradient array as its .grad without a copy only when no one else holds it:
one a backward made and marked (Context.mark_fresh), or a sum the engine made. An array handed
to two inputs (Add's g) is still copied, so the leaves' gradients never alias."""
import numpy as np

import npmegatron.autograd as ag
from npmegatron.autograd import Function, Tensor


def leaf(*shape, seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


class Twice(Function):
    """y = 2 x; backward makes a new array and says so, and remembers it for the test."""
    made = []

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        ctx.mark_fresh(0)
        Twice.made.append(2 * g)
        return Twice.made[-1]


def test_a_fresh_gradient_becomes_the_leafs_grad_without_a_copy():
    x = leaf(3)
    Twice.apply(x).sum().backward()
    assert x.grad is Twice.made[-1]
    np.testing.assert_array_equal(x.grad, np.full(3, 2.0))


def test_a_gradient_given_to_two_leaves_is_copied_for_each():
    a, b = leaf(4), leaf(4, seed=1)
    (a + b).sum().backward()                     # Add.backward hands the same g to both
    assert a.grad is not b.grad
    a.grad += 1
    np.testing.assert_array_equal(b.grad, np.ones(4))


def test_a_sum_of_two_contributions_is_adopted_and_accumulation_stays_correct():
    w = leaf(3, 2)
    x = leaf(5, 3, seed=2)
    y = ag.linear(x, w) + ag.linear(x, w)        # w's two gradients: the engine sums them
    y.sum().backward()
    expected = 2 * x.data.sum(axis=0)[:, None] * np.ones((1, 2))
    np.testing.assert_allclose(w.grad, expected, rtol=1e-14)
    first = w.grad
    (ag.linear(x, w)).sum().backward()          # a second backward adds in place
    assert w.grad is first
    np.testing.assert_allclose(w.grad, 1.5 * expected, rtol=1e-14)


def test_linear_parameters_take_their_gradients_without_copies():
    x, w, b = leaf(4, 3), leaf(3, 2, seed=1), leaf(2, seed=2)
    ag.linear(x, w, b).sum().backward()
    np.testing.assert_allclose(w.grad, x.data.T @ np.ones((4, 2)), rtol=1e-14)
    np.testing.assert_allclose(b.grad, np.full(2, 4.0), rtol=1e-14)
    assert w.grad.base is None and b.grad.base is None      # their own arrays, not views of g
