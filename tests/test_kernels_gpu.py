"""The hand-made GPU kernels on a real GPU, against NumPy: cuBLAS through autograd.gemm (every
layout the model hands it, 16-bit inputs, TF32, accumulation into `out=` slices), the fused
dropout mask, the fused LayerNorm and the cross-entropy chains. tests/test_gemm.py and
tests/test_dropout_on_device.py check the same calls on the strict stand-in, whose cuBLAS and
fusion are emulations; this file is the check that the emulations tell the truth. It skips
without CuPy or a CUDA device."""
import importlib
import itertools

import ml_dtypes
import numpy
import pytest

from helpers import real_gpu_cupy

cupy = real_gpu_cupy()

from npmegatron import autograd as ag  # noqa: E402
from npmegatron.autograd import gemm, row_kernels  # noqa: E402
from npmegatron.tensor_parallel import random as dropout_random  # noqa: E402


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch):
    monkeypatch.setitem(gemm._settings, "tf32", False)


def operand(rng, shape, transposed, dtype=numpy.float64):
    if transposed:
        host = rng.standard_normal(shape[:-2] + shape[-2:][::-1]).astype(dtype)
        return cupy.asarray(host).swapaxes(-1, -2), host.swapaxes(-1, -2)
    host = rng.standard_normal(shape).astype(dtype)
    return cupy.asarray(host), host


@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("shapes", [((5, 3), (3, 4)), ((2, 5, 3), (3, 4)), ((2, 3, 5, 3), (2, 3, 3, 4)),
                                    ((2, 1, 5, 3), (3, 3, 4)), ((1, 3), (3, 1)), ((4, 5, 3), (4, 3, 1)),
                                    ((3, 70, 33), (33, 65))])
def test_every_layout_equals_numpy(ta, tb, shapes):
    rng = numpy.random.default_rng(0)
    (a, ha), (b, hb) = operand(rng, shapes[0], ta), operand(rng, shapes[1], tb)
    numpy.testing.assert_allclose(cupy.asnumpy(gemm.matmul(a, b)), ha @ hb, rtol=1e-12, atol=1e-12)


def test_strided_heads_of_a_fused_qkv_and_accumulation_into_slices():
    rng = numpy.random.default_rng(2)
    for b in (1, 2):
        qkv_host = rng.standard_normal((b, 7, 3, 4, 8))
        q, k = (cupy.asarray(qkv_host)[:, :, i].transpose(0, 2, 1, 3) for i in (0, 1))
        hq, hk = (qkv_host[:, :, i].transpose(0, 2, 1, 3) for i in (0, 1))
        numpy.testing.assert_allclose(cupy.asnumpy(gemm.matmul(q, k.swapaxes(-1, -2))),
                                      hq @ hk.swapaxes(-1, -2), rtol=1e-12, atol=1e-12)
    (a, ha), (g, hg) = operand(rng, (2, 3, 5, 4), True), operand(rng, (2, 3, 5, 6), False)
    total_host = rng.standard_normal((2, 3, 9, 6))
    total = cupy.asarray(total_host)
    gemm.matmul(a.swapaxes(-1, -2), g, out=total[..., 2:6, :], accumulate=True)
    total_host[..., 2:6, :] += ha.swapaxes(-1, -2) @ hg
    numpy.testing.assert_allclose(cupy.asnumpy(total), total_host, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,out_dtype", [(numpy.float16, numpy.float16), (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
                                             (ml_dtypes.bfloat16, numpy.float32), (numpy.float16, numpy.float32)])
def test_16_bit_inputs_accumulate_in_float32(dtype, out_dtype):
    """cuBLAS sums in another order than NumPy: the result is the float32 product within a few
    float32 ulps, rounded once to the output's grid (so at most one 16-bit ulp apart)."""
    rng = numpy.random.default_rng(4)
    (a, ha), (b, hb) = operand(rng, (3, 40, 256), False, dtype), operand(rng, (3, 256, 50), True, dtype)
    out = cupy.zeros((3, 40, 50), out_dtype)
    gemm.matmul(a, b, out=out)
    exact = ha.astype(numpy.float64) @ hb.astype(numpy.float64)
    got = cupy.asnumpy(out).astype(numpy.float64)
    ulp = numpy.spacing(numpy.abs(exact).astype(out_dtype)).astype(numpy.float64)
    assert numpy.all(numpy.abs(got - exact) <= ulp + 1e-4 * numpy.abs(exact).max())


def test_tf32_is_close_to_float32_but_not_equal():
    rng = numpy.random.default_rng(6)
    (a, ha), (b, hb) = operand(rng, (4, 128, 256), False, numpy.float32), operand(rng, (256, 96), True, numpy.float32)
    exact = ha.astype(numpy.float64) @ hb.astype(numpy.float64)
    plain = cupy.asnumpy(gemm.matmul(a, b))
    gemm.enable_tf32()
    fast = cupy.asnumpy(gemm.matmul(a, b))
    assert numpy.abs(plain - exact).max() < 3e-4           # values up to ~50: float32 round-off
    assert 1e-3 < numpy.abs(fast - exact).max() < 0.5      # TF32's 10-bit mantissa: the tensor cores ran


@pytest.mark.parametrize("grid,dtype", [("bf16", ml_dtypes.bfloat16), ("fp16", numpy.float16)])
def test_16_bit_tensor_cores_are_exact_on_the_grid(grid, dtype):
    """float32 operands on the 16-bit grid through 32F_FAST_16BF / 32F_FAST_16F: cuBLAS converts
    them to 16 bits without loss, so the error is float32 summation's, not 16-bit rounding's."""
    rng = numpy.random.default_rng(8)
    ha, hb = (rng.standard_normal(shape).astype(dtype).astype(numpy.float32) for shape in ((8, 512, 768), (768, 1024)))
    exact = ha.astype(numpy.float64) @ hb.astype(numpy.float64)
    got = cupy.asnumpy(gemm.matmul(cupy.asarray(ha), cupy.asarray(hb), grid=grid))
    assert numpy.abs(got - exact).max() < 1e-3 * numpy.abs(exact).max() / 64   # 16-bit rounding: ~4e-3


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
@pytest.mark.parametrize("where", [{}, {"block": (3, 7, 5)}, {"block": (0, 4, 9), "lead": ((1, 2), (0, 3))}])
def test_the_fused_dropout_mask_is_the_cpus(dtype, where):
    key, shape, p = 0x0123456789ABCDEF, (2, 3, 8, 9), 0.3
    expected = dropout_random.keep_mask(key, shape, dtype, p, numpy, **where)
    got = dropout_random.keep_mask(key, shape, dtype, p, cupy, device_rows={}, **where)
    assert numpy.array_equal(cupy.asnumpy(got), expected)


def small_graph(xp, host_arrays):
    """layer_norm -> linear -> cross_entropy, loss and every gradient, on `xp`'s arrays."""
    x, w, b, weight, targets = (xp.asarray(a) for a in host_arrays)
    leaves = [ag.Tensor(a, requires_grad=True) for a in (x, w, b, weight)]
    loss = ag.cross_entropy(ag.linear(ag.layer_norm(*leaves[:3]), leaves[3]), targets)
    loss.backward()
    to_host = cupy.asnumpy if xp is cupy else numpy.asarray
    return [to_host(loss.data)] + [to_host(leaf.grad) for leaf in leaves]


def test_the_fused_layernorm_and_cross_entropy_equal_numpy():
    rng = numpy.random.default_rng(7)
    host = [rng.standard_normal((3, 5, 64)), rng.standard_normal(64), rng.standard_normal(64),
            rng.standard_normal((64, 100)), rng.integers(0, 100, (3, 5))]
    for got, expected in zip(small_graph(cupy, host), small_graph(numpy, host)):
        numpy.testing.assert_allclose(got, expected, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
@pytest.mark.parametrize("cols", [7, 64, 768, 1600, 5000])
def test_the_layer_norm_row_kernels_equal_their_numpy_twins(dtype, cols):
    """What the strict stand-in runs in their place (row_kernels.py's twins), to round-off: the
    same formulas, sums in double on both, in another order and with multiply-adds on the GPU."""
    rng = numpy.random.default_rng(cols)
    x, g, pending = (rng.standard_normal((37, cols)).astype(dtype) + 3 for _ in range(3))
    weight, bias = rng.standard_normal(cols).astype(dtype), rng.standard_normal(cols).astype(dtype)
    out, xhat, rstd = (a.get() for a in row_kernels.layer_norm_forward(*map(cupy.asarray, (x, weight, bias)), 1e-5))
    want = [numpy.empty_like(x), numpy.empty_like(x), numpy.empty((37, 1), dtype)]
    row_kernels.layer_norm_forward_rows(x, weight, bias, want[1], want[0], want[2], cols, 1e-5)
    tolerance = dict(rtol=2e-6, atol=2e-6) if dtype == numpy.float32 else dict(rtol=1e-13, atol=1e-13)
    for got, expected in zip((out, xhat, rstd), want):
        numpy.testing.assert_allclose(got, expected, **tolerance)
    for added in (None, pending):
        gx = row_kernels.layer_norm_backward(*map(cupy.asarray, (g, weight, xhat, rstd)),
                                             None if added is None else cupy.asarray(added)).get()
        expected = numpy.empty_like(g)
        row_kernels.layer_norm_backward_rows(g, weight, xhat, rstd, g if added is None else added, expected,
                                             cols, int(added is not None))
        numpy.testing.assert_allclose(gx, expected, **tolerance)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("cols", [7, 768, 1600])
def test_the_kept_input_layer_norm_kernels_give_the_xhat_kernels_numbers_bit_for_bit(fmt, cols):
    """--fp16/--bf16 keep LayerNorm's input in 16 bits and the rows' (mean, 1/std) in double, and
    recompute xhat with forward's expression: the same bits as the kernels that keep xhat."""
    sixteen = numpy.float16 if fmt == "fp16" else ml_dtypes.bfloat16
    rng = numpy.random.default_rng(cols)
    x, g = (cupy.asarray((rng.standard_normal((37, cols)) + 3).astype(sixteen).astype(numpy.float32)) for _ in range(2))
    weight, bias = (cupy.asarray(rng.standard_normal(cols).astype(numpy.float32)) for _ in range(2))
    out, xhat, rstd = row_kernels.layer_norm_forward(x, weight, bias, 1e-5)
    out_kept, kept, stats = row_kernels.layer_norm_forward(x, weight, bias, 1e-5, keep=fmt)
    assert kept.dtype == numpy.dtype(sixteen) and bool((kept.astype(numpy.float32) == x).all())
    assert bool((out_kept == out).all())
    gx, gx_kept = (row_kernels.layer_norm_backward(g, weight, k, s, x) for k, s in ((xhat, rstd), (kept, stats)))
    assert bool((gx_kept == gx).all())
    sums, sums_kept = (row_kernels.layer_norm_column_sums(g, k, s) for k, s in ((xhat, rstd), (kept, stats)))
    for a, b in zip(sums, sums_kept):
        assert bool((a == b).all())


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_arrays_kept_in_16_bits_are_the_casts_of_their_values_and_come_back_whole(fmt):
    """precision.to_16_bit (for bfloat16 an integer shift of the top bits) equals NumPy's and
    ml_dtypes' cast of values on the grid, subnormals, zeros, infinities and strided views
    included, and to_float32 gives the float32 values back bit for bit."""
    from npmegatron.autograd import precision
    sixteen = numpy.float16 if fmt == "fp16" else ml_dtypes.bfloat16
    rng = numpy.random.default_rng(4)
    host = numpy.concatenate([rng.standard_normal(4095) * 10.0 ** rng.integers(-8, 8, 4095),
                              [0.0, -0.0, numpy.inf, -numpy.inf, 1e-40, -3e-39, 65504.0]])
    host = host.astype(sixteen).astype(numpy.float32).reshape(-1, 7)
    for x, h in ((cupy.asarray(host), host), (cupy.asarray(host)[:, ::2], host[:, ::2])):
        kept = precision.to_16_bit(x, fmt)
        assert kept.dtype == numpy.dtype(sixteen)
        assert numpy.array_equal(kept.view(numpy.uint16).get(), h.astype(sixteen).view(numpy.uint16))
        back = precision.to_float32(kept)
        assert back.dtype == numpy.float32
        assert bool((back.view(numpy.uint32) == cupy.ascontiguousarray(x).view(numpy.uint32)).all())



def bit_kernels_against_chains(bits, offset):
    """Each bf16_bits kernel on arrays starting `offset` elements into their allocations, against
    its chain run directly; returns the rounded bits, the 16-bit copy and the widened top bits."""
    from npmegatron.autograd import bf16_bits
    n = bits.size

    def placed(host_or_dtype):
        if isinstance(host_or_dtype, numpy.ndarray):
            whole = cupy.empty(n + offset, host_or_dtype.dtype)
            whole[offset:] = cupy.asarray(host_or_dtype)
        else:
            whole = cupy.empty(n + offset, host_or_dtype)
        return whole[offset:]

    x, chained = placed(bits), cupy.asarray(bits)
    bf16_bits.round_in_place(x)
    bf16_bits.bf16_round_bits_(chained)
    assert bool((x == chained).all())
    y, copy, chained_copy = placed(bits), placed(numpy.uint16), cupy.empty(n, numpy.uint16)
    bf16_bits.round_keeping_copy(y, copy)
    bf16_bits.bf16_round_bits_copy_(cupy.asarray(bits), chained_copy)
    assert bool((y == x).all()) and bool((copy == chained_copy).all())
    top, chained_top = placed(numpy.uint16), cupy.empty(n, numpy.uint16)
    bf16_bits.top_bits(placed(bits), top)
    bf16_bits.bf16_top_bits_(cupy.asarray(bits), chained_top)
    assert bool((top == chained_top).all())
    wide, chained_wide = placed(numpy.uint32), cupy.empty(n, numpy.uint32)
    bf16_bits.widen(top, wide)
    bf16_bits.bf16_widen_bits_(chained_top, chained_wide)
    assert bool((wide == chained_wide).all())
    return x.get(), copy.get(), wide.get()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 4099, (1 << 20) + 3])
def test_the_bf16_bit_kernels_equal_their_chains_bit_for_bit(n, monkeypatch):
    """autograd/bf16_bits.py's vectorised kernels against the fused chains they stand in for and
    the NumPy reference, on random bits (NaNs with payloads, infinities, subnormals, ties) and
    lengths that leave each remainder of four; arrays one element past an aligned address take
    the chains, with the same numbers."""
    from npmegatron.autograd import bf16_bits, precision
    rng = numpy.random.default_rng(n)
    bits = rng.integers(0, 1 << 32, n, dtype=numpy.uint64).astype(numpy.uint32)
    bits[:4] = [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F800001][:n]    # ties both ways, to inf, a NaN
    reference = precision._round_bf16_(numpy, bits.copy().view(numpy.float32)).view(numpy.uint32)
    for offset in (0, 1):
        with monkeypatch.context() as patch:
            for kernel in bf16_bits.KERNELS.values():
                # aligned arrays must take the kernels; misaligned ones must take the chains
                patch.setattr(kernel, "chain", _refuse("chain") if offset == 0 else kernel.chain)
                patch.setattr(kernel, "_compiled", kernel._compiled if offset == 0 else _refuse("kernel"))
            rounded, copy, wide = bit_kernels_against_chains(bits, offset)
        assert numpy.array_equal(rounded, reference)
        assert numpy.array_equal(copy, (reference >> 16).astype(numpy.uint16))
        assert numpy.array_equal(wide, reference & 0xFFFF0000)         # NaNs lose their low bits


def _refuse(what):
    def refused(*args, **kwargs):
        raise AssertionError(f"the {what} ran where the other path should have")
    return refused


def test_a_transposed_array_is_rounded_in_place_by_the_kernel(monkeypatch):
    """A permutation of a C-ordered array's axes goes to the kernel as that C-ordered view."""
    from npmegatron.autograd import bf16_bits, precision
    bits = numpy.random.default_rng(5).integers(0, 1 << 32, 8 * 12 * 16 * 8, dtype=numpy.uint64).astype(numpy.uint32)
    bits = bits.reshape(8, 16, 12, 8)
    for kernel in bf16_bits.KERNELS.values():
        monkeypatch.setattr(kernel, "chain", _refuse("chain"))
    x = cupy.asarray(bits).transpose(0, 2, 1, 3)
    bf16_bits.round_in_place(x)
    reference = precision._round_bf16_(numpy, bits.copy().view(numpy.float32)).view(numpy.uint32)
    assert numpy.array_equal(x.get(), reference.transpose(0, 2, 1, 3))


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("dropout", [False, True])
def test_the_residual_stream_kernel_equals_its_twin_and_layer_norm_reads_its_output(fmt, dropout):
    """The 16-bit residual stream's bias + dropout + residual kernel against its NumPy twin, bit
    for bit, with y and the residual float32 or 16-bit; LayerNorm reading that 16-bit output gives
    the numbers it gives for the output's float32 widening."""
    from npmegatron.autograd import precision, sixteen_bit_kernels
    sixteen = precision.sixteen_bit_dtype(fmt)
    rng = numpy.random.default_rng(11)
    shape = (3, 37, 200)
    on_grid = [(rng.standard_normal(shape) * 4).astype(sixteen) for _ in range(2)]
    bias = (rng.standard_normal(shape[-1:]) * 3).astype(sixteen)
    keep = rng.random(shape) >= 0.1 if dropout else None
    for y, residual in itertools.product((on_grid[0].astype(numpy.float32) * 1.0001, on_grid[0]),
                                         (on_grid[1].astype(numpy.float32), on_grid[1])):
        out = sixteen_bit_kernels.bias_dropout_add(*(None if a is None else cupy.asarray(a) for a in (y, bias, keep, residual)),
                                                1 / 0.9 if dropout else None, fmt)
        expected = numpy.empty(shape, sixteen)
        sixteen_bit_kernels.bias_dropout_add_twin(y, bias, y if keep is None else keep, residual, expected,
                                               1 / 0.9 if dropout else 1.0, y.size, shape[-1])
        assert numpy.array_equal(cupy.asnumpy(out).view(numpy.uint16), expected.view(numpy.uint16))
    weight, ln_bias = (cupy.asarray(rng.standard_normal(shape[-1]).astype(sixteen)) for _ in range(2))
    rows = out.reshape(-1, shape[-1])
    from_16, kept, _ = row_kernels.layer_norm_forward(rows, weight, ln_bias, 1e-5, keep=fmt)
    from_32, _, _ = row_kernels.layer_norm_forward(rows.astype(numpy.float32), weight, ln_bias, 1e-5, keep=fmt)
    assert kept is rows and bool((from_16 == from_32).all())


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_the_16_bit_bias_gelu_and_layer_norm_gradient_kernels_against_their_twins(fmt):
    """The Linear's bias kernel bit for bit its twin; bias + GeLU each way within one 16-bit step of
    its twin (CUDA's tanhf against NumPy's tanh: an ulp of float32 may move a rounding); LayerNorm's
    16-bit-gradient kernels bit for bit the float32-gradient kernels on the widened gradient, the
    input gradient then rounded (and, with the fork's pending gradient, added and rounded again)."""
    from npmegatron.autograd import precision, sixteen_bit_kernels
    from npmegatron.autograd.ops import elementwise
    sixteen = precision.sixteen_bit_dtype(fmt)
    rng = numpy.random.default_rng(3)
    shape = (5, 33, 96)
    y32 = rng.standard_normal(shape).astype(numpy.float32) * 2
    y16, g16 = ((rng.standard_normal(shape) * 2).astype(sixteen) for _ in range(2))
    b16 = rng.standard_normal(shape[-1]).astype(sixteen)
    out = cupy.asnumpy(sixteen_bit_kernels.bias_add(cupy.asarray(y32), cupy.asarray(b16), fmt))
    twin = numpy.empty(shape, sixteen)
    sixteen_bit_kernels.bias_add_twin(y32, b16, twin, y32.size, shape[-1])
    assert numpy.array_equal(out.view(numpy.uint16), twin.view(numpy.uint16))
    constants = (elementwise._GELU_CUBIC, elementwise._SQRT_2_OVER_PI)
    out = cupy.asnumpy(sixteen_bit_kernels.bias_gelu_tanh(cupy.asarray(y16), cupy.asarray(b16), fmt, *constants))
    elementwise.bias_gelu_tanh_twin(y16, b16, twin, twin, *map(numpy.float32, constants), y16.size, shape[-1])
    assert numpy.abs(out.astype(numpy.float64) - twin.astype(numpy.float64)).max() <= \
        numpy.abs(twin.astype(numpy.float64)).max() * 2.0 ** -7
    # from float32 sums, also keeping GeLU's input (GeluMLP without nvmath-python): that bit for bit
    out, kept = (cupy.asnumpy(a) for a in sixteen_bit_kernels.bias_gelu_tanh(
        cupy.asarray(y32), cupy.asarray(b16), fmt, *constants, keep_input=True))
    kept_twin = numpy.empty(shape, sixteen)
    elementwise.bias_gelu_tanh_keeping_input_twin(y32, b16, twin, kept_twin, *map(numpy.float32, constants),
                                                  y32.size, shape[-1])
    assert numpy.array_equal(kept.view(numpy.uint16), kept_twin.view(numpy.uint16))
    assert numpy.abs(out.astype(numpy.float64) - twin.astype(numpy.float64)).max() <= \
        numpy.abs(twin.astype(numpy.float64)).max() * 2.0 ** -7
    out = cupy.asnumpy(sixteen_bit_kernels.bias_gelu_tanh_backward(
        cupy.asarray(g16), cupy.asarray(y16), cupy.asarray(b16), fmt, *constants, elementwise._GELU_CUBIC_GRAD))
    elementwise.bias_gelu_tanh_backward_twin(g16, y16, b16, twin, *map(numpy.float32, constants),
                                             numpy.float32(elementwise._GELU_CUBIC_GRAD), y16.size, shape[-1])
    assert numpy.abs(out.astype(numpy.float64) - twin.astype(numpy.float64)).max() <= \
        numpy.abs(twin.astype(numpy.float64)).max() * 2.0 ** -7
    rows = cupy.asarray(y16.reshape(-1, shape[-1]))
    weight = cupy.asarray(rng.standard_normal(shape[-1]).astype(sixteen))
    _, kept, stats = row_kernels.layer_norm_forward(rows, weight, weight, 1e-5, keep=fmt)
    g = cupy.asarray(g16.reshape(rows.shape))
    gx16 = row_kernels.layer_norm_backward(g, weight, kept, stats)
    gx32 = row_kernels.layer_norm_backward(g.astype(numpy.float32), weight, kept, stats)
    assert gx16.dtype == sixteen and bool((gx16 == gx32.astype(sixteen)).all())
    # the fork's pending 16-bit gradient: added to the rounded gradient, the sum rounded again
    pending = cupy.asarray(rng.standard_normal(rows.shape).astype(sixteen))
    summed = row_kernels.layer_norm_backward(g, weight, kept, stats, pending)
    want = (pending.astype(numpy.float32) + gx32.astype(sixteen).astype(numpy.float32)).astype(sixteen)
    assert bool((summed == want).all())
    for a, b in zip(row_kernels.layer_norm_column_sums(g, kept, stats),
                    row_kernels.layer_norm_column_sums(g.astype(numpy.float32), kept, stats)):
        assert bool((a == b).all())


def _within_a_16_bit_step(got, want):
    """Each value within one 16-bit rounding step of the twin's (a float32 sum in another order,
    or CUDA's expf against NumPy's exp, may move a rounding by one step)."""
    got, want = (numpy.asarray(a).astype(numpy.float64) for a in (got, want))
    step = 2.0 ** -7 if want.size else 0.0
    assert numpy.all(numpy.abs(got - want) <= step * numpy.maximum(numpy.abs(want), 1e-3)), \
        numpy.abs(got - want).max()


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("cols", [7, 64, 768, 1600])
def test_the_rms_norm_kernels_against_their_twins(fmt, cols):
    """RMSNorm's 16-bit kernels (llama_kernels.py) against their twins, the chains on the widened
    arrays: the row sums of squares to float32 summation's error, the outputs and input gradients
    (with the pending gradient added too) within one 16-bit step, the gain's gradient (written
    and accumulated) to float32 summation's error."""
    from npmegatron.autograd import llama_kernels, precision
    rms_norm = importlib.import_module("npmegatron.autograd.ops.rms_norm")      # the package exports the function
    sixteen = precision.sixteen_bit_dtype(fmt)
    rng = numpy.random.default_rng(cols)
    rows = 37
    x, g, pending = ((rng.standard_normal((rows, cols)) * 2).astype(sixteen) for _ in range(3))
    weight = rng.standard_normal(cols).astype(sixteen)
    out, squares = llama_kernels.rms_norm_forward(cupy.asarray(x), cupy.asarray(weight), 1e-5, fmt)
    twin_out, twin_squares = numpy.empty(x.shape, sixteen), numpy.empty(rows, numpy.float32)
    rms_norm.rms_norm_forward_twin(x, weight, twin_out, twin_squares, cols, numpy.float32(cols), numpy.float32(1e-5))
    numpy.testing.assert_allclose(cupy.asnumpy(squares), twin_squares, rtol=1e-5)
    _within_a_16_bit_step(cupy.asnumpy(out), twin_out)
    for g_in in (g, g.astype(numpy.float32)):
        for added in (None, pending):
            gx = llama_kernels.rms_norm_backward(cupy.asarray(g_in), cupy.asarray(weight), cupy.asarray(x),
                                                 cupy.asarray(twin_squares), 1e-5, fmt,
                                                 None if added is None else cupy.asarray(added))
            twin = numpy.empty(x.shape, sixteen)
            rms_norm.rms_norm_backward_twin(g_in, weight, x, twin_squares, x if added is None else added, twin, cols,
                                            numpy.float32(cols), numpy.float32(1e-5), int(added is not None))
            _within_a_16_bit_step(cupy.asnumpy(gx), twin)
        for accumulate in (False, True):
            start = rng.standard_normal(cols).astype(numpy.float32)
            into = cupy.asarray(start)
            got = llama_kernels.rms_norm_weight_grad(cupy.asarray(g_in), cupy.asarray(x), cupy.asarray(twin_squares),
                                                     1e-5, fmt, (into, accumulate))
            twin = start.copy()
            rms_norm.rms_norm_weight_grad_twin(g_in, x, twin_squares, twin, rows, cols, numpy.float32(cols),
                                               numpy.float32(1e-5), int(accumulate))
            assert got is into
            numpy.testing.assert_allclose(cupy.asnumpy(got), twin, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_the_swiglu_and_rotary_kernels_against_their_twins(fmt):
    """SwiGLU each way and the rotary embedding (a strided head view in, as the QKV projection's
    output gives it, and a transposed gradient) within one 16-bit step of their twins; the residual
    add without a bias bit for bit its twin."""
    from npmegatron.autograd import llama_kernels, precision, sixteen_bit_kernels
    rotary, swiglu = (importlib.import_module(f"npmegatron.autograd.ops.{name}") for name in ("rotary", "swiglu"))
    sixteen = precision.sixteen_bit_dtype(fmt)
    rng = numpy.random.default_rng(5)
    y, g = (rng.standard_normal(s).astype(sixteen) for s in ((3, 17, 2 * 40), (3, 17, 40)))
    out = llama_kernels.swiglu_forward(cupy.asarray(y), fmt)
    twin = numpy.empty(g.shape, sixteen)
    swiglu.swiglu_forward_twin(y, twin, numpy.int64(g.size), numpy.int64(40))
    _within_a_16_bit_step(cupy.asnumpy(out), twin)
    for g_in in (g, g.astype(numpy.float32)):
        grad = llama_kernels.swiglu_backward(cupy.asarray(g_in), cupy.asarray(y), fmt)
        twin = numpy.empty(y.shape, sixteen)
        swiglu.swiglu_backward_twin(g_in, y, twin, numpy.int64(g.size), numpy.int64(40))
        _within_a_16_bit_step(cupy.asnumpy(grad), twin)
    b, t, groups, d = 2, 9, 3, 16
    qkv = rng.standard_normal((b, t, groups, 4, d)).astype(sixteen)     # 2 query heads, a key and a value a group
    angles = rotary.rotary_angles(range(t), 12, 10000.0)
    cos, sin = (cupy.asarray(f(angles).astype(numpy.float32)) for f in (numpy.cos, numpy.sin))
    device = cupy.asarray(qkv)
    for x in (device[:, :, :, 2], device.transpose(0, 2, 1, 3, 4)[:, :, :, 0].transpose(0, 2, 1, 3)):
        got = llama_kernels.rotary(x, cos, sin, fmt)
        flat, strides = llama_kernels._strided(x)
        twin = numpy.empty(x.shape, sixteen)
        rotary.rotary_twin(cupy.asnumpy(flat), cupy.asnumpy(cos), cupy.asnumpy(sin), twin, numpy.int64(twin.size),
                           t, x.shape[2], d, 6, *strides)
        _within_a_16_bit_step(cupy.asnumpy(got), twin)
    residual, y2 = (rng.standard_normal((4, 50)).astype(sixteen) for _ in range(2))
    out = sixteen_bit_kernels.bias_dropout_add(cupy.asarray(y2), None, None, cupy.asarray(residual), None, fmt)
    twin = numpy.empty(y2.shape, sixteen)
    sixteen_bit_kernels.dropout_add_twin(y2, y2, y2, residual, twin, 1.0, y2.size, 50)
    assert numpy.array_equal(cupy.asnumpy(out).view(numpy.uint16), twin.view(numpy.uint16))


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_the_gemm_epilogues_against_the_emulations_numbers(fmt):
    """nvmath-python's cuBLASLt epilogues (autograd/epilogues.py) on 16-bit operands: x w + b, GeLU
    of it with GeLU's input kept, and (g w^T) times GeLU's derivative there, each within one 16-bit
    step of the CPU's emulation (float32 sums in cuBLASLt's order, its own tanh); then each again on
    new operands through the cached plan, and the same under a CUDA graph's capture and replay."""
    pytest.importorskip("nvmath")
    from npmegatron.autograd import epilogues, precision
    from npmegatron.autograd.ops import elementwise
    sixteen = precision.sixteen_bit_dtype(fmt)
    rng = numpy.random.default_rng(5)

    def operands():
        x, w, g = ((rng.standard_normal(s) * 0.5).astype(sixteen) for s in ((3, 40, 64), (64, 96), (3, 40, 64)))
        b = rng.standard_normal(96).astype(sixteen)
        return x, w, b, g

    for _ in range(2):          # the second call: the plans made by the first, new operands
        x, w, b, g = operands()
        wide = [a.astype(numpy.float32) for a in (x, w, b, g)]
        pre = wide[0] @ wide[1] + wide[2]
        xd, wd, bd, gd = map(cupy.asarray, (x, w, b, g))
        assert epilogues.takes(xd, wd, bd, fmt, gelu=True)
        _within_a_16_bit_step(cupy.asnumpy(epilogues.linear_bias(xd, wd, bd)).astype(numpy.float32), pre)
        h, a = epilogues.linear_bias_gelu(xd, wd, bd)
        assert h.flags.c_contiguous and a.flags.c_contiguous and h.dtype == a.dtype == sixteen
        _within_a_16_bit_step(cupy.asnumpy(a).astype(numpy.float32), pre)
        _within_a_16_bit_step(cupy.asnumpy(h).astype(numpy.float32), elementwise._gelu_tanh(numpy, pre.copy())[0])
        a_wide = cupy.asnumpy(a).astype(numpy.float32)
        # the MLP's second weight w2 (96, 64) = w^T: (g w2^T) gelu'(a), g w2^T = g w
        d = epilogues.gelu_input_grad(gd, cupy.asarray(numpy.ascontiguousarray(w.T)), a)
        want = elementwise._gelu_tanh_grad(numpy, wide[3] @ wide[1], a_wide,
                                           elementwise._gelu_tanh(numpy, a_wide.copy())[1])
        _within_a_16_bit_step(cupy.asnumpy(d).astype(numpy.float32), want)
    stream, eager = cupy.cuda.Stream(non_blocking=True), cupy.cuda.get_allocator()
    with stream:
        epilogues.linear_bias(xd, wd, bd)       # the plan for this stream, before the capture
        cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)      # the graph's own pool
        try:
            stream.begin_capture()
            y = epilogues.linear_bias(xd, wd, bd)
            graph = stream.end_capture()
        finally:
            cupy.cuda.set_allocator(eager)
        graph.launch(stream)
    stream.synchronize()
    _within_a_16_bit_step(cupy.asnumpy(y).astype(numpy.float32), pre)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_the_embeddings_end_and_dropout_backward_kernels_equal_their_twins(fmt):
    """dropout(x + rows) and dropout's backward in 16 bits: bit for bit their twins (one add, one
    rounding, two products each, all with _rn intrinsics), from 16-bit and float32 inputs."""
    from npmegatron.autograd import precision, sixteen_bit_kernels
    sixteen = precision.sixteen_bit_dtype(fmt)
    rng = numpy.random.default_rng(12)
    shape = (3, 37, 96)
    rows = (rng.standard_normal(shape[1:]) * 2).astype(sixteen)
    keep = rng.random(shape) >= 0.1
    for x in ((rng.standard_normal(shape) * 3).astype(sixteen), rng.standard_normal(shape).astype(numpy.float32)):
        for r, k in ((rows, keep), (rows, None), (None, keep)):
            out = sixteen_bit_kernels.add_rows_dropout(cupy.asarray(x), None if r is None else cupy.asarray(r),
                                                       None if k is None else cupy.asarray(k), 1 / 0.9, fmt)
            twin = numpy.empty(shape, sixteen)
            sixteen_bit_kernels.add_rows_dropout_twin(x, x if r is None else r, x if k is None else k, twin,
                                                      numpy.float32(1 / 0.9), x.size, 0 if r is None else r.size)
            assert numpy.array_equal(cupy.asnumpy(out).view(numpy.uint16), twin.view(numpy.uint16))
        out = sixteen_bit_kernels.dropout_backward(cupy.asarray(x), cupy.asarray(keep), 1 / 0.9, fmt)
        twin = numpy.empty(shape, sixteen)
        sixteen_bit_kernels.dropout_backward_twin(x, keep, twin, numpy.float32(1 / 0.9), x.size)
        assert numpy.array_equal(cupy.asnumpy(out).view(numpy.uint16), twin.view(numpy.uint16))


@pytest.mark.parametrize("dtype", ["float32", "bf16", "fp16"])
@pytest.mark.parametrize("width,real", [(50304, 50257), (96, 96), (1000, 1)])
def test_the_cross_entropy_kernels_against_their_twins(dtype, width, real):
    """The loss's row statistics (maximum and target logit bit for bit, the sum of exponentials to
    float32's round-off: the kernel sums in another order) and its gradient (within a 16-bit step,
    or float32's round-off) against their twins, padded columns included."""
    from npmegatron.autograd import precision
    from npmegatron.tensor_parallel import _cross_entropy_gpu as kernels
    kind = numpy.dtype(numpy.float32) if dtype == "float32" else precision.sixteen_bit_dtype(dtype)
    rng = numpy.random.default_rng(5)
    rows = 9
    logits = (rng.standard_normal((rows, width)) * 4).astype(kind)
    target = rng.integers(0, real, rows).astype(numpy.int64)
    stats = [numpy.empty(rows, numpy.float32) for _ in range(3)]
    kernels.row_statistics_twin(logits, target, *stats, real, width)
    device = kernels.row_statistics(cupy.asarray(logits), real, cupy.asarray(target))
    row_max, sums, target_logit = (cupy.asnumpy(a) for a in device)
    assert numpy.array_equal(row_max, stats[0]) and numpy.array_equal(target_logit, stats[2])
    numpy.testing.assert_allclose(sums, stats[1], rtol=1e-5)
    scale = numpy.array([1 / rows], numpy.float32)
    target[0] = -1                                  # another rank's target
    twin = numpy.empty(logits.shape, kind)
    kernels.softmax_minus_one_hot_twin(logits, stats[0], stats[1], target, scale, 0, twin, real, width)
    grad = cupy.asnumpy(kernels.softmax_minus_one_hot(cupy.asarray(logits), *(cupy.asarray(a) for a in (
        stats[0], stats[1], target, scale)), real, kind))
    step = 2.0 ** -7 if dtype != "float32" else 1e-6
    numpy.testing.assert_allclose(grad.astype(numpy.float64), twin.astype(numpy.float64), rtol=step, atol=1e-7)
    assert not grad[:, real:].astype(numpy.float32).any()
