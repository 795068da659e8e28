"""The RNG tracker of paper Appendix B.2: dropout outside tensor-parallel regions (embeddings,
residual branches) draws from a stream seeded the same on every TP rank, so replicated
activations get identical masks; dropout inside TP regions (attention probabilities of this
rank's heads) draws from a stream seeded per TP rank (Megatron: seed + 2718 + tp_rank).

Each stream is counter-based: the k-th number it draws is a hash of (seed, k) computed with
integer array arithmetic. NumPy and CuPy therefore draw bitwise the same numbers, and a stream's
whole state is its counter, an integer a checkpoint can hold (a CuPy generator's state cannot be
saved)."""
import numpy

from ..autograd import InputError

DEFAULT = "default"
MODEL_PARALLEL = "model-parallel"
MODEL_PARALLEL_SEED_OFFSET = 2718

_GOLDEN = 0x9E3779B97F4A7C15        # splitmix64's increment and finaliser (Steele et al., 2014)
_MIX_1, _MIX_2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(z, xp):
    """splitmix64's finaliser, in place on a uint64 array (wrapping arithmetic): a bijection that
    spreads every input bit over the output."""
    for shift, multiplier in ((30, _MIX_1), (27, _MIX_2)):
        z ^= z >> xp.uint64(shift)
        z *= xp.uint64(multiplier)
    z ^= z >> xp.uint64(31)
    return z


class CounterStream:
    """Uniform numbers in [0, 1): number k of the stream is mix64(key + k * golden), with the key
    a hash of the seed. `random(shape)` returns the next prod(shape) numbers."""

    def __init__(self, seed, xp):
        self.xp, self.counter = xp, 0
        self.key = int(mix64(numpy.array([seed], numpy.uint64) * numpy.uint64(_GOLDEN), numpy)[0])

    def random(self, shape, dtype=numpy.float64):
        xp, dtype = self.xp, numpy.dtype(dtype)
        size = int(numpy.prod(shape, dtype=numpy.int64))
        bits = xp.arange(self.counter, self.counter + size, dtype=xp.uint64)
        self.counter += size
        bits *= xp.uint64(_GOLDEN)
        bits += xp.uint64(self.key)
        mix64(bits, xp)
        # The top 24 (float32) or 53 (float64) bits, scaled exactly: the same float on any device.
        mantissa = 24 if dtype == numpy.float32 else 53
        bits >>= xp.uint64(64 - mantissa)
        uniform = bits.astype(dtype).reshape(shape)
        uniform *= dtype.type(2.0 ** -mantissa)
        return uniform


class RNGTracker:
    def __init__(self, seed, tp_rank, xp):
        self.streams = {
            DEFAULT: CounterStream(seed, xp),
            MODEL_PARALLEL: CounterStream(seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank, xp),
        }

    def __getitem__(self, name):
        return self.streams[name]

    def get_states(self):
        """{stream: counter}, to save in a checkpoint."""
        return {name: stream.counter for name, stream in self.streams.items()}

    def set_states(self, states):
        for name, counter in states.items():
            if not isinstance(counter, int):
                raise InputError("the checkpoint holds dropout generator states of an older npmegatron "
                                 "(not stream counters); resume it with the version that saved it")
            self.streams[name].counter = counter
