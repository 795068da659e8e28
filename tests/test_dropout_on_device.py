"""Dropout's keep mask on a GPU (the strict stand-in): one fused kernel per draw, the hash
computed inside it from a row-start and a column vector kept on the device (nothing uploaded
after the first draw of a shape), and bitwise the CPU's mask, for whole draws and for the
blocks blockwise attention draws."""
import numpy
import pytest

from npmegatron.tensor_parallel import random as dropout_random


@pytest.fixture
def cp(fresh_strict_cupy):
    return fresh_strict_cupy


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
@pytest.mark.parametrize("where", [{}, {"block": (3, 7, 5)}, {"block": (0, 4, 9), "lead": ((1, 2), (0, 3))}])
def test_the_device_mask_is_the_cpus_in_one_kernel_and_no_upload_after_the_first(cp, dtype, where):
    key, shape, p = 0x0123456789ABCDEF, (2, 3, 8, 9), 0.3
    expected = dropout_random.keep_mask(key, shape, dtype, p, numpy, **where)
    kept = {}
    first = dropout_random.keep_mask(key, shape, dtype, p, cp, device_rows=kept, **where)
    cp._strict.reset()
    again = dropout_random.keep_mask(key ^ 1, shape, dtype, p, cp, device_rows=kept, **where)
    assert [(r.kind, r.name) for r in cp._strict.launches()] == [("fused", "hashed_keep")]
    assert numpy.array_equal(cp.asnumpy(first), expected)
    assert numpy.array_equal(cp.asnumpy(again), dropout_random.keep_mask(key ^ 1, shape, dtype, p, numpy, **where))


@pytest.mark.parametrize("p", [0.0, 1e-9, 0.5, 0.999999])
def test_the_integer_threshold_is_the_float_comparison(cp, p):
    """number >= p as top bits >= ceil(p * 2**mantissa), at the edges of p."""
    shape = (64, 257)
    for dtype in (numpy.float32, numpy.float64):
        numbers = dropout_random.uniform(7, shape, dtype, numpy)
        got = cp.asnumpy(dropout_random.keep_mask(7, shape, dtype, p, cp))
        assert numpy.array_equal(got, numbers >= dtype(p))
