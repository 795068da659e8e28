"""The counter-based dropout streams: the documented hash (so NumPy and CuPy, both wrapping uint64
arithmetic, draw the same bits), counter semantics, and a state that is one integer."""
import numpy as np

from npmegatron.tensor_parallel.random import CounterStream, RNGTracker

MASK = 2 ** 64 - 1


def splitmix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference(seed, k, mantissa):
    """Number k of stream `seed`, in plain Python integers."""
    key = splitmix64((seed * 0x9E3779B97F4A7C15) & MASK)
    return (splitmix64((key + k * 0x9E3779B97F4A7C15) & MASK) >> (64 - mantissa)) * 2.0 ** -mantissa


def test_streams_draw_the_documented_hash_in_both_precisions():
    for dtype, mantissa in ((np.float64, 53), (np.float32, 24)):
        stream = CounterStream(1234, np)
        stream.counter = 10 ** 12               # far along a long run, still exact
        got = stream.random((2, 3), dtype=dtype)
        assert got.dtype == dtype and got.shape == (2, 3)
        want = [reference(1234, 10 ** 12 + k, mantissa) for k in range(6)]
        assert got.ravel().tolist() == want


def test_a_stream_is_its_counter():
    a, b = CounterStream(7, np), CounterStream(7, np)
    first, second = a.random(10), a.random(20)
    assert np.array_equal(np.concatenate([first, second]), b.random(30))
    assert a.counter == 30
    numbers = CounterStream(7, np).random(100_000)
    assert 0.0 <= numbers.min() and numbers.max() < 1.0 and abs(numbers.mean() - 0.5) < 0.005
    assert not np.array_equal(CounterStream(8, np).random(10), first)


def test_tracker_state_is_json_integers_that_replay():
    tracker = RNGTracker(1, tp_rank=1, xp=np)
    tracker["default"].random(5)
    states = tracker.get_states()
    assert states == {"default": 5, "model-parallel": 0}
    later = tracker["default"].random(4)
    tracker.set_states(states)
    assert np.array_equal(tracker["default"].random(4), later)
    assert not np.array_equal(RNGTracker(1, 0, np)["model-parallel"].random(4),
                              RNGTracker(1, 1, np)["model-parallel"].random(4))   # per TP rank


def test_generator_states_of_an_older_checkpoint_are_one_sentence():
    import pytest
    from npmegatron.autograd import InputError
    with pytest.raises(InputError, match="dropout generator states of an older npmegatron"):
        RNGTracker(1, 0, np).set_states({"default": {"bit_generator": "PCG64", "state": {}}})
