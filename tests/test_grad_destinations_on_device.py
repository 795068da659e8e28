"""Gradients written straight into a leaf's main_grad (its view of a flat gradient buffer; engine
._destinations, Context.destination) on a GPU (the strict stand-in): the same numbers as the
gradients the engine adds itself, never counted twice, over several backward passes, beside
contributions from Functions that do not write there, and with the buffer zeroed beforehand (the
data-parallel buckets) or not (DP = 1)."""
import numpy
import pytest

from npmegatron import autograd as ag
from npmegatron.autograd import precision


@pytest.fixture
def cp(fresh_strict_cupy):
    return fresh_strict_cupy


def host_arrays():
    rng = numpy.random.default_rng(11)
    shapes = {"x": (2, 3, 8), "w": (8, 8), "b": (8,), "gamma": (8,), "beta": (8,), "r": (2, 3, 8)}
    return {k: rng.standard_normal(s).astype(numpy.float32) for k, s in shapes.items()}


def backward(xp, host, leaves, extra_use):
    """Linear (its weight used twice), LayerNorm, bias-GeLU, backward from the output with
    gradient r; `extra_use`: w also gets a gradient through a Function that writes no destination
    (Mul), reached before or after the Linears."""
    x = ag.Tensor(xp.asarray(host["x"]))
    w, b, gamma, beta = leaves
    h = ag.linear(ag.linear(x, w, b), w)
    y = ag.bias_gelu(ag.layer_norm(h, gamma, beta), b)
    outputs, grads = [y], [xp.asarray(host["r"])]
    if extra_use is not None:
        extra = w * 3.0
        where = 0 if extra_use == "first" else 1
        outputs.insert(where, extra)
        grads.insert(where, xp.ones(w.shape, numpy.float32))
    ag.backward(outputs, grads)


def gradients(xp, host, flat, extra_use=None, passes=1, zeroed=False, storage=None, parameters=False):
    """Every leaf's gradient after `passes` backward passes; with `flat`, each leaf's main_grad
    is its view of one flat buffer (zeroed and preset as p.grad when `zeroed`); `parameters`:
    the leaves are a model's parameters (module.parameter), whose gradients are never rounded."""
    names = ("w", "b", "gamma", "beta")
    leaves = [ag.Tensor(xp.asarray(host[n]), requires_grad=True) for n in names]
    for leaf in leaves:
        leaf.is_parameter = parameters
    buffer = xp.zeros(sum(host[n].size for n in names), numpy.float32) if flat else None
    if flat:
        offset = 0
        for leaf in leaves:
            leaf.main_grad = buffer[offset:offset + leaf.data.size].reshape(leaf.shape)
            offset += leaf.data.size
            if zeroed:
                leaf.grad = leaf.main_grad
    with precision.storage(storage):
        for _ in range(passes):
            backward(xp, host, leaves, extra_use)
    return leaves


@pytest.mark.parametrize("extra_use", [None, "first", "last"])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("zeroed", [False, True])
def test_main_grad_holds_the_engines_sum_bitwise(cp, extra_use, passes, zeroed):
    host = host_arrays()
    expected = gradients(cp, host, False, extra_use, passes)
    got = gradients(cp, host, True, extra_use, passes, zeroed)
    for leaf, want in zip(got, expected):
        assert numpy.array_equal(cp.asnumpy(leaf.grad), cp.asnumpy(want.grad))
        if leaf.grad is not leaf.main_grad:     # a straggler: the optimizer's gather copies it
            assert extra_use is not None and not zeroed


def test_without_other_contributions_every_gradient_is_its_main_grad_and_costs_no_copy(cp):
    host = host_arrays()
    cp._strict.reset()
    leaves = gradients(cp, host, True)
    assert all(leaf.grad is leaf.main_grad for leaf in leaves)
    assert not [launch for launch in cp._strict.launches() if launch.op == "_accumulate" or
                launch.name == "copy"]


def test_under_16_bit_storage_only_overwrites_are_offered(cp):
    """A leaf that is not a parameter has its gradient rounded in place: a fresh gradient in
    main_grad may be, a sum may not."""
    host = {k: precision.round_(a.copy(), "bf16") for k, a in host_arrays().items()}    # the Linears' grid
    for passes in (1, 2):
        expected = gradients(cp, host, False, "last", passes, storage="bf16")
        got = gradients(cp, host, True, "last", passes, storage="bf16")
        for leaf, want in zip(got, expected):
            assert numpy.array_equal(cp.asnumpy(leaf.grad), cp.asnumpy(want.grad))



def test_under_16_bit_storage_a_parameters_main_grad_is_added_to_unrounded(cp, monkeypatch):
    """A parameter's gradient is not rounded (precision.py): its main_grad may be added to (a
    GEMM's beta = 1), and holds the engine's float32 sum bitwise, off the 16-bit grid."""
    from npmegatron.autograd import function
    host = {k: precision.round_(a.copy(), "bf16") for k, a in host_arrays().items()}
    offered, run = [], function.Node.run

    def spying(self, grads, pending=None, destinations=None):
        offered.extend(d[1] for d in destinations or () if d is not None)
        return run(self, grads, pending, destinations)

    monkeypatch.setattr(function.Node, "run", spying)
    for passes in (1, 2):
        expected = gradients(cp, host, False, "last", passes, storage="bf16", parameters=True)
        got = gradients(cp, host, True, "last", passes, storage="bf16", parameters=True)
        for leaf, want in zip(got, expected):
            assert numpy.array_equal(cp.asnumpy(leaf.grad), cp.asnumpy(want.grad))
        w = cp.asnumpy(got[0].grad)
        assert not numpy.array_equal(w, precision.round_(w.copy(), "bf16"))     # float32 sums
    assert True in offered          # an addition into main_grad was offered
