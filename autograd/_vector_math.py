"""A float32 exp for numba kernels that the compiler can vectorise. Without Intel's SVML, numba calls libm
one number at a time (about 20 ns a call measured on this project's AVX2 machines, NumPy's own
float32 exp about 2 ns); this one runs at a fraction of a nanosecond in vector lanes.

exp(x) = 2^n e^r, n = round(x / ln 2), r = x - n ln 2 with ln 2 split in a high part of few bits
(so n ln 2_hi is exact) and a low part; e^r by its Taylor series (|r| <= ln 2 / 2) and 2^n built
from its exponent bits. In float32 with the series to r^7: within 1 ulp of float64 exp (tested);
below -87.3 (float32's normal range) it returns 0. (A float64 version ran the GeLU kernel 2.7x
slower: AVX2 has half the lanes for doubles and no double-to-int64 conversion.)
"""
import numba
import numpy
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# error_model="numpy": no division-by-zero checks, which stop loops from vectorising; "contract"
# lets multiply-adds fuse. Kernels using these helpers pass the same options.
FAST = dict(cache=True, error_model="numpy", fastmath={"contract"})


@intrinsic
def _float32_from_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


_F32 = numpy.float32
_LOG2E_32, _LN2_HI_32, _LN2_LO_32 = _F32(1.4426950408889634), _F32(0.693359375), _F32(-2.12194440e-4)
_FLOOR_32 = _F32(-87.33654)
_SERIES_32 = tuple(_F32(1.0 / f) for f in (1, 1, 2, 6, 24, 120, 720, 5040))


@numba.njit(inline="always", **FAST)
def exp32(x):
    """e^x of a float32, as float32."""
    below = x < _FLOOR_32
    x = max(x, _FLOOR_32)
    n = _F32(numpy.floor(x * _LOG2E_32 + _F32(0.5)))
    r = x - n * _LN2_HI_32 - n * _LN2_LO_32
    c = _SERIES_32
    p = c[0] + r * (c[1] + r * (c[2] + r * (c[3] + r * (c[4] + r * (c[5] + r * (c[6] + r * c[7]))))))
    scale = _float32_from_bits(numpy.int32((numpy.int32(n) + 127) << 23))
    return _F32(0.0) if below else p * scale


# A running maximum is a chain of dependent compares that the compiler will not split; kept in
# this many independent lanes it vectorises (a row of 1,024 scores: 4x faster measured).
MAX_LANES = 16


@numba.njit(inline="always", cache=True, error_model="numpy", fastmath={"contract", "reassoc", "nnan"})
def lane_max(row, count, lanes):
    """The largest of row[:count] (count >= 1), in MAX_LANES running maxima (`lanes`, scratch of
    that length). A NaN is skipped unless it is row[0]: callers whose NaN must show pass it on
    through their other arithmetic (exp of it is NaN)."""
    lanes[:] = row[0]
    whole = count - count % MAX_LANES
    for start in range(0, whole, MAX_LANES):
        for lane in range(MAX_LANES):
            x = row[start + lane]
            lanes[lane] = x if x > lanes[lane] else lanes[lane]
    m = lanes[0]
    for lane in range(1, MAX_LANES):
        m = max(m, lanes[lane])
    for j in range(whole, count):
        m = max(m, row[j])
    return m
