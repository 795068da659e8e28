"""grouped_matmul and grouped_bias: rows in blocks, block i times its own weight. Checked by
finite differences in float64 (an empty block among them), against one product a block, and on
the strict CuPy stand-in, where the padded batch must give NumPy's numbers in launches that do not
grow with the blocks."""
import numpy
import pytest

from npmegatron import autograd as ag
from npmegatron.autograd import Tensor, gradcheck

SIZES = [3, 0, 5, 1]


def operands(rng, sizes, k=4, m=3, dtype=numpy.float64):
    x = Tensor(rng.standard_normal((sum(sizes), k)).astype(dtype), requires_grad=True)
    w = Tensor(rng.standard_normal((len(sizes), k, m)).astype(dtype), requires_grad=True)
    b = Tensor(rng.standard_normal((len(sizes), m)).astype(dtype), requires_grad=True)
    return x, w, b


def per_block(x, w, b, sizes):
    """The same product one block at a time, in plain NumPy."""
    starts = numpy.concatenate(([0], numpy.cumsum(sizes)))
    return numpy.concatenate([x[s:e] @ w[i] + b[i] for i, (s, e) in enumerate(zip(starts[:-1], starts[1:]))])


def test_each_block_gets_its_own_weight_and_bias_and_finite_differences_agree():
    rng = numpy.random.default_rng(0)
    x, w, b = operands(rng, SIZES)
    blocks = ag.RowBlocks(SIZES, numpy)
    y = ag.grouped_bias(ag.grouped_matmul(x, w, blocks), b, blocks)
    numpy.testing.assert_allclose(y.data, per_block(x.data, w.data, b.data, SIZES), rtol=1e-14)
    assert gradcheck(lambda x, w, b: ag.grouped_bias(ag.grouped_matmul(x, w, blocks), b, blocks), [x, w, b]) < 1e-7


def test_an_empty_block_gets_zero_gradients_and_no_rows_at_all_still_runs():
    rng = numpy.random.default_rng(1)
    x, w, b = operands(rng, SIZES)
    blocks = ag.RowBlocks(SIZES, numpy)
    ag.grouped_bias(ag.grouped_matmul(x, w, blocks), b, blocks).sum().backward()
    assert not w.grad[1].any() and not b.grad[1].any() and w.grad[0].any()
    none = ag.RowBlocks([0, 0], numpy)
    x0, w0, b0 = operands(rng, [0, 0])
    y0 = ag.grouped_bias(ag.grouped_matmul(x0, w0, none), b0, none)
    y0.sum().backward()
    assert y0.shape == (0, 3) and not w0.grad.any() and not b0.grad.any()


def test_padded_rows_change_no_number():
    """--moe-pad-expert-input-to-capacity: every block padded to 7 rows on a GPU; NumPy skips
    the zero rows, and either gives the blocks' own products."""
    rng = numpy.random.default_rng(2)
    x, w, _ = operands(rng, SIZES)
    blocks = ag.RowBlocks(SIZES, numpy, padded_rows=7)
    assert blocks.width == 7
    numpy.testing.assert_allclose(ag.grouped_matmul(x, w, blocks).data,
                                  per_block(x.data, w.data, numpy.zeros((4, 3)), SIZES), rtol=1e-14)


def test_mismatched_shapes_are_refused_in_one_sentence():
    rng = numpy.random.default_rng(3)
    x, w, _ = operands(rng, SIZES)
    with pytest.raises(ag.InputError, match="grouped_matmul takes rows"):
        ag.grouped_matmul(x, w, ag.RowBlocks([3, 6], numpy))


def run_on(xp, host, sizes):
    """(output, x's, w's and b's gradients) as host arrays, computed on arrays of module xp."""
    x, w, b = (Tensor(xp.asarray(a), requires_grad=True) for a in host)
    blocks = ag.RowBlocks(sizes, xp)
    y = ag.grouped_bias(ag.grouped_matmul(x, w, blocks), b, blocks)
    (y * y).sum().backward()
    get = lambda a: a.get() if hasattr(a, "get") else a  # noqa: E731
    return [get(a) for a in (y.data, x.grad, w.grad, b.grad)]


def launches_for(cp, groups):
    """The stand-in's launches for grouped_matmul + grouped_bias each way on `groups` blocks, some
    empty; checks the numbers against NumPy's and that the four GEMMs are batched over the blocks."""
    rng = numpy.random.default_rng(groups)
    sizes = [3 * (i % 3) for i in range(groups)]        # 0, 3, 6, 0, ...
    host = [a.data for a in operands(rng, sizes)]
    cp._strict.reset()
    on_device = run_on(cp, host, sizes)
    for got, want in zip(on_device, run_on(numpy, host, sizes)):
        numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    gemms = cp._strict.launches("gemm")
    # the product each way, the weights' gradient and the bias's (a row of ones times each block)
    assert len(gemms) == 4 and all(r.fields.get("batch") == groups for r in gemms), gemms
    return len(cp._strict.launches())


def test_the_stand_in_runs_one_padded_batch_equal_to_numpy_in_launches_independent_of_the_blocks(
        fresh_strict_cupy):
    assert launches_for(fresh_strict_cupy, 2) == launches_for(fresh_strict_cupy, 8)
