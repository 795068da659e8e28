"""bfloat16's bit kernels on a GPU (the strict stand-in, autograd/bf16_bits.py): C-ordered arrays at
aligned addresses go to the vectorised CUDA kernel, one launch each, and anything else to the fused
chain; either way the numbers are the NumPy reference's, bit for bit, NaN, infinities, subnormals,
ties and a length that is not a multiple of four included. tests/test_kernels_gpu.py holds the
kernels themselves to the chains on a real card."""
import numpy
import pytest

from npmegatron.autograd import bf16_bits, precision

#: every float32 class: NaNs (quiet, signalling, negative), infinities, the largest finite value
#: (which rounds to inf), ties to even both ways, subnormals, zeros
SPECIAL = numpy.array([0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x3F808000,
                       0x3F818000, 0x3F80FFFF, 0x00000001, 0x807FFFFF, 0x00000000, 0x80000000], numpy.uint32)


@pytest.fixture
def cp(fresh_strict_cupy):
    return fresh_strict_cupy


def host_bits(n, seed=0):
    bits = numpy.random.default_rng(seed).integers(0, 1 << 32, n, dtype=numpy.uint64).astype(numpy.uint32)
    bits[:min(n, SPECIAL.size)] = SPECIAL[:n]
    return bits


def rounded(bits):
    return precision._round_bf16_(numpy, bits.copy().view(numpy.float32)).view(numpy.uint32)


def calls(cp, kernel, arrays):
    cp._strict.reset()
    kernel(*arrays)
    return [(launch.kind, launch.name) for launch in cp._strict.launches()]


@pytest.mark.parametrize("n", [1, 3, 4, 13, 4099])
def test_each_kernel_is_one_launch_and_equals_the_reference(cp, n):
    bits = host_bits(n)
    reference = rounded(bits)
    x = cp.asarray(bits)
    assert calls(cp, bf16_bits.round_in_place, (x,)) == [("raw", "bf16_round_bits")]
    assert numpy.array_equal(cp.asnumpy(x), reference)

    x, copy = cp.asarray(bits), cp.empty(n, numpy.uint16)
    assert calls(cp, bf16_bits.round_keeping_copy, (x, copy)) == [("raw", "bf16_round_bits_copy")]
    assert numpy.array_equal(cp.asnumpy(x), reference)
    assert numpy.array_equal(cp.asnumpy(copy), (reference >> 16).astype(numpy.uint16))

    x, top = cp.asarray(bits), cp.empty(n, numpy.uint16)
    assert calls(cp, bf16_bits.top_bits, (x, top)) == [("raw", "bf16_top_bits")]
    assert numpy.array_equal(cp.asnumpy(top), (reference >> 16).astype(numpy.uint16))
    assert numpy.array_equal(cp.asnumpy(x), bits)          # read only

    wide = cp.empty(n, numpy.uint32)
    assert calls(cp, bf16_bits.widen, (top, wide)) == [("raw", "bf16_widen_bits")]
    assert numpy.array_equal(cp.asnumpy(wide), reference & 0xFFFF0000)     # NaNs lose their low bits


def test_strided_and_misaligned_arrays_take_the_chain_with_the_same_numbers(cp):
    bits = host_bits(4 * 64 + 1).reshape(1, -1)
    whole = cp.asarray(bits)
    misaligned = whole[0, 1:]                   # 4 bytes past an aligned address
    strided = cp.asarray(bits[0, 1:].reshape(32, 8))[:, ::2]       # every other column: gaps
    for view, host in ((misaligned, bits[0, 1:]), (strided, bits[0, 1:].reshape(32, 8)[:, ::2])):
        assert calls(cp, bf16_bits.round_in_place, (view,)) == [("fused", "bf16_round_bits_")]
        assert numpy.array_equal(cp.asnumpy(view), rounded(numpy.ascontiguousarray(host)))
    half = cp.empty(4 * 64 + 1, numpy.uint16)[1:]    # 2 bytes past: a 16-bit array must sit at 8
    assert calls(cp, bf16_bits.top_bits, (cp.asarray(bits[0, 1:]), half)) == [("fused", "bf16_top_bits_")]
    assert numpy.array_equal(cp.asnumpy(half), (rounded(bits[0, 1:]) >> 16).astype(numpy.uint16))


def test_precision_routes_bfloat16_rounding_through_the_kernels(cp):
    """round_, round_keeping_copy, to_16_bit and to_float32 on C-ordered float32 device arrays: one
    kernel launch each, the same numbers as NumPy's rounding and ml_dtypes' cast."""
    rng = numpy.random.default_rng(1)
    host = (rng.standard_normal((3, 70)) * 10.0 ** rng.integers(-40, 38, (3, 70))).astype(numpy.float32)
    host[0, :4] = numpy.inf, -numpy.inf, 0.0, 3.4e38       # no NaN: ml_dtypes makes every NaN quiet
    expected = rounded(host.reshape(-1).view(numpy.uint32)).view(numpy.float32).reshape(3, 70)
    x = cp.asarray(host)
    cp._strict.reset()
    precision.round_(x, "bf16")
    copy = precision.round_keeping_copy(cp.asarray(host), "bf16")
    kept = precision.to_16_bit(x, "bf16")
    back = precision.to_float32(kept)
    assert [launch.name for launch in cp._strict.launches() if launch.kind == "raw"] == [
        "bf16_round_bits", "bf16_round_bits_copy", "bf16_top_bits", "bf16_widen_bits"]
    assert numpy.array_equal(cp.asnumpy(x).view(numpy.uint32), expected.view(numpy.uint32))
    assert numpy.array_equal(cp.asnumpy(copy).view(numpy.uint16), host.astype(precision.sixteen_bit_dtype("bf16"))
                             .view(numpy.uint16))
    assert numpy.array_equal(cp.asnumpy(back).view(numpy.uint32), expected.view(numpy.uint32))


def test_every_kernel_source_names_its_twin_and_defines_its_kernel():
    for name, kernel in bf16_bits.KERNELS.items():
        assert f"// twin: {bf16_bits.__name__}:" in kernel.source
        assert f'extern "C" __global__ void {name}(' in kernel.source


def test_a_transposed_array_is_rounded_by_the_kernel_over_its_memory(cp):
    """A permutation of a C-ordered array's axes (attention's heads-first gradient, the tied
    embedding's transposed gradient) lies in memory without gaps: one kernel rounds it in place."""
    bits = host_bits(2 * 3 * 5 * 4, seed=3).reshape(2, 3, 5, 4)
    x = cp.asarray(bits).transpose(0, 2, 1, 3)
    assert not x.flags.c_contiguous
    assert calls(cp, bf16_bits.round_in_place, (x,)) == [("raw", "bf16_round_bits")]
    assert numpy.array_equal(cp.asnumpy(x), rounded(bits.reshape(-1)).reshape(bits.shape).transpose(0, 2, 1, 3))
