"""bfloat16 rounding as integer arithmetic on float32 bits: the fused chains, and on a GPU four
CUDA kernels that equal them and run at memory speed.

The chains (`@fused`) are the definition: nearest-even on the top 16 bits, NaN kept. NumPy runs
them on the CPU. On a GPU `cupy.fuse` compiles them, but its kernels load and store one element a
thread: on an H200 they moved 0.9-1.7 TB/s, where a plain copy moves 2.3-4.2 and these passes are
nothing but memory traffic (docs/gpu.md). So C-ordered device arrays at 16-byte-aligned addresses
go through the kernels below, which move four float32 values a thread in one 16-byte load or store
and ran at 2.4-4.1 TB/s on the same card, bitwise equal to the chains. Any other array (a strided
view, a misaligned slice of a flat buffer, a NumPy array) runs the chain.

Each kernel's source names its twin (row_kernels.py's convention): the function that computes the
same numbers from the same arguments, in place on the output arrays. The twins run the chains, so
the strict CuPy stand-in (tests/fakes/strict_cupy), which runs the twin where CuPy would run the
kernel, counts and checks these launches in the CPU tests; tests/test_kernels_gpu.py holds the
kernels to the chains on a real card.
"""
import numpy

from .fusion import fused


def _nearest_even_increment(xp, bits):
    """(what float32 `bits` gain before their low 16 bits are dropped, whether they are a number):
    nearest-even on the top 16 bits, NaN kept. Every constant fits in 31 bits, so it is a weak
    scalar of the uint32 array on both paths. Called inside the chains below."""
    number = xp.less_equal(xp.bitwise_and(bits, 0x7FFFFFFF), 0x7F800000)
    return (xp.bitwise_and(xp.right_shift(bits, 16), 1) + 0x7FFF) * number, number


def _round_bits_in_place(xp, bits):
    increment, number = _nearest_even_increment(xp, bits)
    xp.add(bits, increment, out=bits)
    xp.subtract(bits, xp.bitwise_and(bits, 0xFFFF) * number, out=bits)


@fused
def bf16_round_bits_(xp, bits):
    """float32 bits rounded in place to bfloat16's grid, in one kernel."""
    _round_bits_in_place(xp, bits)


@fused
def bf16_round_bits_copy_(xp, bits, copy):
    """bf16_round_bits_, the bfloat16 bits (the rounded top 16) also written to `copy` (uint16)."""
    _round_bits_in_place(xp, bits)
    xp.right_shift(bits, 16, out=copy)


@fused
def bf16_top_bits_(xp, bits, out):
    """out (uint16) = float32 `bits` rounded to bfloat16 (nearest even, NaN kept), as
    bf16_round_bits_ rounds: on the grid the top 16 bits as they are."""
    xp.right_shift(bits + _nearest_even_increment(xp, bits)[0], 16, out=out)


@fused
def bf16_widen_bits_(xp, bits, out):
    """out (uint32) = bfloat16 `bits` as the float32 of the same value."""
    xp.left_shift(bits.astype(numpy.uint32), 16, out=out)


# The kernels' twins: the chains, with the kernels' arguments (n: the number of values).
def round_twin(bits, n):
    bf16_round_bits_(bits)


def round_copy_twin(bits, copy, n):
    bf16_round_bits_copy_(bits, copy)


def top_twin(bits, out, n):
    bf16_top_bits_(bits, out)


def widen_twin(bits, out, n):
    bf16_widen_bits_(bits, out)


_PRELUDE = r"""
// _round_bits_in_place's arithmetic on one value
__device__ __forceinline__ unsigned int round_bits(unsigned int b) {
    unsigned int number = (b & 0x7FFFFFFFu) <= 0x7F800000u;
    b += (((b >> 16) & 1u) + 0x7FFFu) * number;
    return b - (b & 0xFFFFu) * number;
}
// the top halves of two rounded values, the first in the low half: two bfloat16s in memory order
__device__ __forceinline__ unsigned int pair(unsigned int a, unsigned int b) {
    return (a >> 16) | (b & 0xFFFF0000u);
}
// Four values a thread (one 16-byte access of float32, 8 of bfloat16) over a grid-stride loop;
// block 0 then does the last n % 4 one at a time.
#define EACH_VECTOR for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n / 4; \
                         i += (long long)gridDim.x * blockDim.x)
#define TAIL_INDEX (n / 4 * 4 + threadIdx.x)
#define IN_TAIL (blockIdx.x == 0 && TAIL_INDEX < n)
"""

_SOURCES = {
    "bf16_round_bits": r"""
// twin: {module}:round_twin
extern "C" __global__ void bf16_round_bits(unsigned int* bits, long long n) {
    uint4* v4 = (uint4*)bits;
    EACH_VECTOR {
        uint4 v = v4[i];
        v4[i] = make_uint4(round_bits(v.x), round_bits(v.y), round_bits(v.z), round_bits(v.w));
    }
    if (IN_TAIL) bits[TAIL_INDEX] = round_bits(bits[TAIL_INDEX]);
}
""",
    "bf16_round_bits_copy": r"""
// twin: {module}:round_copy_twin
extern "C" __global__ void bf16_round_bits_copy(unsigned int* bits, unsigned short* copy, long long n) {
    uint4* v4 = (uint4*)bits;
    EACH_VECTOR {
        uint4 v = v4[i];
        v = make_uint4(round_bits(v.x), round_bits(v.y), round_bits(v.z), round_bits(v.w));
        v4[i] = v;
        ((uint2*)copy)[i] = make_uint2(pair(v.x, v.y), pair(v.z, v.w));
    }
    if (IN_TAIL) {
        unsigned int r = round_bits(bits[TAIL_INDEX]);
        bits[TAIL_INDEX] = r;
        copy[TAIL_INDEX] = (unsigned short)(r >> 16);
    }
}
""",
    "bf16_top_bits": r"""
// twin: {module}:top_twin
extern "C" __global__ void bf16_top_bits(const unsigned int* bits, unsigned short* out, long long n) {
    EACH_VECTOR {
        uint4 v = ((const uint4*)bits)[i];
        ((uint2*)out)[i] = make_uint2(pair(round_bits(v.x), round_bits(v.y)),
                                      pair(round_bits(v.z), round_bits(v.w)));
    }
    if (IN_TAIL) out[TAIL_INDEX] = (unsigned short)(round_bits(bits[TAIL_INDEX]) >> 16);
}
""",
    "bf16_widen_bits": r"""
// twin: {module}:widen_twin
extern "C" __global__ void bf16_widen_bits(const unsigned short* bits, unsigned int* out, long long n) {
    EACH_VECTOR {
        uint2 v = ((const uint2*)bits)[i];
        ((uint4*)out)[i] = make_uint4(v.x << 16, v.x & 0xFFFF0000u, v.y << 16, v.y & 0xFFFF0000u);
    }
    if (IN_TAIL) out[TAIL_INDEX] = (unsigned int)bits[TAIL_INDEX] << 16;
}
""",
}

#: threads a block, and at most this many blocks (each thread then loops): 16 blocks a
#: multiprocessor on a 132-SM H100/H200 is what the measured kernels ran with
THREADS, MAX_BLOCKS = 256, 4096


class BitsKernel:
    """One of the kernels above, compiled on first use; falls back to its chain (module docstring)."""

    def __init__(self, name, chain):
        self.name, self.chain = name, chain
        self.source = (_PRELUDE + _SOURCES[name]).replace("{module}", __name__)
        self._compiled = None
        KERNELS[name] = self

    def __call__(self, *arrays):
        if not _vectorisable(arrays):
            self.chain(*arrays)
            return
        if self._compiled is None:
            import cupy
            self._compiled = cupy.RawKernel(self.source, self.name)
        n = arrays[0].size
        blocks = max(1, min(MAX_BLOCKS, -(-(n // 4) // THREADS)))
        self._compiled((blocks,), (THREADS,), tuple(arrays) + (numpy.int64(n),))


def _vectorisable(arrays):
    """Whether the kernel may take these arrays: device arrays of one size, C-ordered, each at an
    address four of its elements can be loaded from at once (16 bytes for 32-bit values, 8 for
    16-bit ones; CuPy's allocations are aligned, a view into a flat buffer may not be)."""
    first = arrays[0]
    if not type(first).__module__.startswith("cupy") or first.size == 0:
        return False
    for a in arrays:        # a loop, not all(...): no generator for the host to resume per array
        if a.size != first.size or not a.flags.c_contiguous or a.data.ptr % (4 * a.itemsize):
            return False
    return True


#: Every kernel by name (a test's fresh CuPy stand-in forgets what an earlier one compiled).
KERNELS = {}

_round_kernel = BitsKernel("bf16_round_bits", bf16_round_bits_)


def round_in_place(bits):
    """float32 `bits` (uint32) rounded in place to bfloat16's grid. Rounding in place does not
    care in which order the values lie, so an array whose axes are a permutation of a C-ordered
    one (a transposed gradient) is rounded as that C-ordered view of the same memory."""
    _round_kernel(bits if bits.flags.c_contiguous else _c_ordered_permutation(bits))


def _c_ordered_permutation(a):
    """a with its axes ordered by falling stride, where that view is C-ordered; else a itself."""
    if a.flags.c_contiguous or a.ndim < 2:
        return a
    permuted = a.transpose(tuple(sorted(range(a.ndim), key=lambda axis: -a.strides[axis])))
    return permuted if permuted.flags.c_contiguous else a


round_keeping_copy = BitsKernel("bf16_round_bits_copy", bf16_round_bits_copy_)
"""round_in_place, the bfloat16 bits also written to `copy` (uint16)."""
top_bits = BitsKernel("bf16_top_bits", bf16_top_bits_)
"""out (uint16) = float32 `bits` rounded to bfloat16."""
widen = BitsKernel("bf16_widen_bits", bf16_widen_bits_)
"""out (uint32) = bfloat16 `bits` as float32."""


def all_sources():
    """(kernel name, CUDA source) of every kernel here, for the NVRTC compile in CI
    (tests/test_cuda_sources_compile.py)."""
    return [(kernel.name, kernel.source) for kernel in KERNELS.values()]
