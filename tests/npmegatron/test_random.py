"""Stateless dropout randomness: the documented hash (so NumPy and CuPy, both wrapping uint64
arithmetic, draw the same bits), masks that are a pure function of (stream, iteration,
micro-batch, site, element), the streams of paper App. B.2, and a position a checkpoint holds."""
import numpy as np
import pytest

from npmegatron.model import GPT, GPTConfig
from npmegatron.autograd import InputError
from npmegatron.tensor_parallel.random import RNGTracker, site_number

MASK = 2 ** 64 - 1
GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference(seed, words, j, mantissa):
    """Number j of the draw at `words` (iteration, micro-batch, site), in plain Python integers."""
    key = splitmix64(((seed + 1) * GOLDEN) & MASK)
    for word in words:
        key = splitmix64((key + (word + 1) * GOLDEN) & MASK)
    return (splitmix64((key + j * GOLDEN) & MASK) >> (64 - mantissa)) * 2.0 ** -mantissa


def test_draws_are_the_documented_hash_in_both_precisions():
    tracker = RNGTracker(1234, tp_rank=0, xp=np)
    tracker.iteration, tracker.micro_batch = 10 ** 9, 7
    for dtype, mantissa in ((np.float64, 53), (np.float32, 24)):
        got = tracker.site("default", 5).random((2, 3), dtype=dtype)
        assert got.dtype == dtype and got.shape == (2, 3)
        assert got.ravel().tolist() == [reference(1234, (10 ** 9, 7, 5), j, mantissa) for j in range(6)]


def test_a_mask_is_a_pure_function_of_its_position():
    tracker = RNGTracker(7, tp_rank=0, xp=np)
    site = tracker.site("default", 3)
    first = site.random(50)
    tracker.site("default", 4).random(1000)          # other draws in between change nothing
    assert np.array_equal(site.random(50), first)
    assert np.array_equal(site.random(20), first[:20])
    numbers = site.random(100_000)
    assert 0.0 <= numbers.min() and numbers.max() < 1.0 and abs(numbers.mean() - 0.5) < 0.005
    for change in ({"iteration": 1}, {"micro_batch": 1}):
        other = RNGTracker(7, tp_rank=0, xp=np)
        for name, value in change.items():
            setattr(other, name, value)
        assert not np.array_equal(other.site("default", 3).random(50), first), change
    assert not np.array_equal(tracker.site("default", 4).random(50), first)
    assert not np.array_equal(RNGTracker(8, 0, np).site("default", 3).random(50), first)


def test_replicated_streams_agree_over_tp_ranks_and_tp_streams_differ():
    zero, one = RNGTracker(1, 0, np), RNGTracker(1, 1, np)
    assert np.array_equal(zero.site("default", 1).random(8), one.site("default", 1).random(8))
    assert not np.array_equal(zero.site("model-parallel", 1).random(8), one.site("model-parallel", 1).random(8))


def test_sites_are_numbered_by_global_layer():
    numbers = [site_number()] + [site_number(layer, kind) for layer in range(4) for kind in range(3)]
    assert numbers == list(range(13))


def test_position_is_json_integers_that_replay():
    tracker = RNGTracker(1, tp_rank=1, xp=np)
    tracker.iteration, tracker.micro_batch = 12, 3
    states = tracker.get_states()
    assert states == {"iteration": 12, "micro_batch": 3}
    first = tracker.site("model-parallel", 2).random(4)
    fresh = RNGTracker(1, tp_rank=1, xp=np)
    fresh.set_states(states)
    assert np.array_equal(fresh.site("model-parallel", 2).random(4), first)


@pytest.mark.parametrize("states", [{"default": {"bit_generator": "PCG64", "state": {}}},
                                    {"default": 5, "model-parallel": 0}], ids=["generator", "counters"])
def test_states_of_an_older_checkpoint_are_one_sentence(states):
    with pytest.raises(InputError, match="dropout generator states of an older npmegatron"):
        RNGTracker(1, 0, np).set_states(states)


def test_a_pipeline_split_draws_the_serial_models_masks():
    """Layers are keyed by their global number: two stages (own trackers, as on two pipeline
    ranks) give the serial model's loss with dropout on, bitwise."""
    cfg = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32,
                    max_position_embeddings=8, dtype="float64", hidden_dropout=0.3, attention_dropout=0.3)
    ids = np.random.default_rng(0).integers(0, 32, (2, 9))
    serial = GPT(cfg)
    _, want = serial(ids[:, :-1], ids[:, 1:])
    first = GPT(cfg, layers=[0], post_process=False)
    last = GPT(cfg, layers=[1], pre_process=False)
    hidden, _ = first(ids[:, :-1])
    _, got = last(hidden, ids[:, 1:])
    assert got.item() == want.item()
    serial.rng.micro_batch = 1
    assert serial(ids[:, :-1], ids[:, 1:])[1].item() != want.item()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_hash_and_blocks_equal_the_array_code(dtype, monkeypatch):
    """Large draws go through the numba kernel, blocks draw only their part: both give bitwise the
    numbers of the plain array code for the whole draw."""
    from npmegatron.tensor_parallel import random
    shape, block = (2, 3, 70, 90), (10, 45, 60)
    compiled = random.uniform(1234, shape, dtype, np)
    compiled_block = random.uniform(1234, shape, dtype, np, block=block)
    monkeypatch.setattr(random, "_COMPILED_MIN_SIZE", 1 << 62)
    plain = random.uniform(1234, shape, dtype, np)
    assert np.array_equal(compiled, plain) and compiled.dtype == dtype
    assert np.array_equal(compiled_block, plain[..., 10:45, :60])
    assert np.array_equal(random.uniform(1234, shape, dtype, np, block=block), plain[..., 10:45, :60])
    with pytest.raises(ValueError, match="outside the draw"):
        random.uniform(1234, shape, dtype, np, block=(0, 71, 10))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1 - 2 ** -30])
def test_keep_masks_are_the_numbers_compared_with_p(dtype, p, monkeypatch):
    """keep_mask hashes and compares in one compiled pass for large draws (p as the numbers'
    dtype holds it, as NumPy compares them): bitwise uniform >= p, whole, by blocks and by heads,
    and the same as the plain array code's comparison."""
    from npmegatron.tensor_parallel import random
    shape, block, lead = (2, 3, 70, 90), (10, 45, 60), ((1, 2), (0, 3))
    numbers = random.uniform(77, shape, dtype, np)
    keep = random.keep_mask(77, shape, dtype, p, np)
    assert keep.dtype == np.bool_ and np.array_equal(keep, numbers >= p)
    assert np.array_equal(random.keep_mask(77, shape, dtype, p, np, block=block, lead=lead),
                          (numbers >= p)[1:2, :, 10:45, :60])
    monkeypatch.setattr(random, "_COMPILED_MIN_SIZE", 1 << 62)
    assert np.array_equal(random.keep_mask(77, shape, dtype, p, np), keep)
