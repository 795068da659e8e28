"""16-bit storage by rounding (autograd/precision.py): the rounding equals NumPy's float16 cast and
ml_dtypes' bfloat16 cast bit for bit, ops round their outputs and their input gradients, the loss
stays in float32, and parameter gradients accumulate in float32."""
import numpy as np
import pytest

from npmegatron import autograd as ag
from npmegatron.autograd import precision

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (the test extra) is the bfloat16 reference")


def reference(x, fmt):
    """The 16-bit cast and back, from NumPy (float16) and ml_dtypes (bfloat16)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(np.float16 if fmt == "fp16" else ml_dtypes.bfloat16).astype(np.float32)


def float32_sweep(step=9973):
    """Every step-th float32 bit pattern (all exponents, both signs, subnormals, inf, NaN)."""
    bits = np.arange(0, 2 ** 32, step, dtype=np.uint64).astype(np.uint32)
    specials = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0x477FEFFF, 0x477FF000, 0x7F7FFFFF,
                         0x33000000, 0x33000001, 0x387FFFFF, 0x00000001], np.uint32)
    return np.concatenate([bits, specials]).view(np.float32)


def same_bits(got, want):
    nan = np.isnan(want)
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("fmt", precision.FORMATS)
def test_the_compiled_rounding_equals_the_cast_over_a_sweep_of_float32(fmt):
    x = float32_sweep()
    assert x.size >= precision.COMPILED_ROUND_SIZE
    same_bits(precision.round_(x.copy(), fmt), reference(x, fmt))


@pytest.mark.parametrize("fmt", precision.FORMATS)
def test_small_and_strided_arrays_take_the_array_module_path_with_the_same_result(fmt):
    x = float32_sweep(step=3_000_017)
    assert x.size < precision.COMPILED_ROUND_SIZE
    same_bits(precision.round_(x.copy(), fmt), reference(x, fmt))
    big = float32_sweep()[: 2 * precision.COMPILED_ROUND_SIZE].reshape(-1, 2)
    strided = big.copy()[:, 0]              # not contiguous: rounded in place through the view
    precision.round_(strided, fmt)
    same_bits(strided, reference(big[:, 0], fmt))


def test_rounding_keeps_integer_arrays_and_copies_read_only_ones():
    ids = np.arange(5)
    assert precision.round_(ids, "fp16") is ids
    frozen = np.full(4, 1.0001, np.float32)
    frozen.flags.writeable = False
    out = precision.round_(frozen, "bf16")
    assert out is not frozen and out[0] == 1.0 and frozen[0] == np.float32(1.0001)


def on_grid(a, fmt):
    return np.array_equal(a, reference(a, fmt))


@pytest.mark.parametrize("fmt", precision.FORMATS)
def test_ops_round_outputs_and_input_gradients_the_loss_stays_float32(fmt):
    rng = np.random.default_rng(0)
    x = ag.Tensor(rng.standard_normal((4, 8)).astype(np.float32), requires_grad=True)
    w = ag.Tensor(reference(rng.standard_normal((8, 16)).astype(np.float32), fmt), requires_grad=True)
    targets = rng.integers(0, 16, 4)
    with precision.storage(fmt):
        h = ag.matmul(x, w)
        g = ag.gelu(h)
        loss = ag.cross_entropy(g, targets)
    assert on_grid(h.data, fmt) and on_grid(g.data, fmt)
    assert not on_grid(loss.data.reshape(1), fmt)       # float32: not rounded
    unrounded = float(ag.cross_entropy(ag.Tensor(g.data), targets).data)
    assert float(loss.data) == unrounded
    loss.backward()                 # outside the block: the nodes remember the format
    assert on_grid(x.grad, fmt) and on_grid(w.grad, fmt)


def test_parameter_gradients_accumulate_in_float32():
    """Two uses of one weight: each gradient arrives rounded, their sum is not rounded again."""
    w = ag.Tensor(np.full(1, 1.0, np.float32), requires_grad=True)
    with precision.storage("bf16"):
        a = ag.mul(w, ag.Tensor(np.full(1, 1.0, np.float32)))
        b = ag.mul(w, ag.Tensor(np.full(1, 2.0 ** -9, np.float32)))
        y = ag.add(ag.sum(a), ag.sum(b))
    y.backward()
    assert w.grad[0] == 1.0 + 2.0 ** -9       # not a bfloat16 number (8 fraction bits)


@pytest.mark.parametrize("fmt", precision.FORMATS)
def test_a_parameters_gradient_is_not_rounded_an_input_leafs_is(fmt):
    """Megatron's gradient-accumulation fusion: a weight's gradient adds up in float32 as the
    weight-gradient GEMM computes it, unrounded; a leaf that is not a parameter (a pipeline
    stage's input) gets an activation's rounded gradient."""
    rng = np.random.default_rng(3)
    x = ag.Tensor(reference(rng.standard_normal((16, 8)).astype(np.float32), fmt), requires_grad=True)
    w = ag.Tensor(reference(rng.standard_normal((8, 8)).astype(np.float32), fmt), requires_grad=True)
    w.is_parameter = True
    g = reference(rng.standard_normal((16, 8)).astype(np.float32), fmt)
    with precision.storage(fmt):
        y = ag.matmul(x, w)
    ag.backward([y], [g])
    # float32 as computed, to float32's summation error (the mkl extra's GEMM sums in its own order)
    np.testing.assert_allclose(w.grad, x.data.T @ g, rtol=1e-5, atol=1e-5)
    assert not on_grid(w.grad, fmt)
    assert on_grid(x.grad, fmt)


@pytest.mark.parametrize("fmt", precision.FORMATS)
def test_a_parameter_used_through_its_transpose_gets_an_unrounded_gradient(fmt):
    """The tied output layer multiplies by the embedding's transpose (a Transpose node between
    the Linear and the parameter): that gradient is a parameter's too, not rounded."""
    rng = np.random.default_rng(4)
    x = ag.Tensor(reference(rng.standard_normal((16, 8)).astype(np.float32), fmt))
    w = ag.Tensor(reference(rng.standard_normal((12, 8)).astype(np.float32), fmt), requires_grad=True)
    w.is_parameter = True
    g = reference(rng.standard_normal((16, 12)).astype(np.float32), fmt)
    with precision.storage(fmt):
        y = ag.linear(x, w.T)
    ag.backward([y], [g])
    np.testing.assert_allclose(w.grad, g.T @ x.data, rtol=1e-5, atol=1e-5)     # any BLAS's summation order
    assert not on_grid(w.grad, fmt)


def test_recomputation_replays_under_the_format_of_the_forward():
    rng = np.random.default_rng(1)
    w = ag.Tensor(reference(rng.standard_normal((8, 8)).astype(np.float32), "fp16"), requires_grad=True)
    x = ag.Tensor(rng.standard_normal((2, 8)).astype(np.float32), requires_grad=True)
    grads = []
    for recompute in (False, True):
        w.grad = x.grad = None
        run = lambda t: ag.gelu(ag.matmul(ag.gelu(ag.matmul(t, w)), w))
        with precision.storage("fp16"):
            out = ag.recompute(run, x) if recompute else run(x)
        ag.sum(out).backward()
        grads.append((out.data.copy(), w.grad.copy(), x.grad.copy()))
    for plain, recomputed in zip(*grads):
        np.testing.assert_array_equal(plain, recomputed)


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="fp8"):
        with precision.storage("fp8"):
            pass
