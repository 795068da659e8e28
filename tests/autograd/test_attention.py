"""Blockwise causal attention: values and gradients equal the dense path's (causal softmax,
dropout with the same masks, @ v) in float64, gradcheck, and nothing of size t_q x t_k kept."""
import numpy as np
import pytest

import npmegatron.autograd as ag
from npmegatron.autograd import InputError, Tensor, gradcheck
from npmegatron.autograd.memory import saved_bytes_by_function
from npmegatron.tensor_parallel.random import MODEL_PARALLEL, RNGTracker

RNG = np.random.default_rng(0)
SCALE = 0.4


def leaves(b, h, t_q, t_k, d):
    return [Tensor(RNG.standard_normal(shape), requires_grad=True)
            for shape in ((b, h, t_q, d), (b, h, t_k, d), (b, h, t_k, d))]


def site(micro_batch=0):
    tracker = RNGTracker(seed=5, tp_rank=0, xp=np)
    tracker.iteration, tracker.micro_batch = 3, micro_batch
    return tracker.site(MODEL_PARALLEL, 4)


def dense(q, k, v, p, generator):
    """The path ParallelAttention took before: every (t_q, t_k) probability materialised."""
    probs = ag.softmax(q @ k.transpose(0, 1, 3, 2), scale=SCALE, causal=True)
    return ag.dropout(probs, p, generator) @ v


def gradients(out, inputs, weights):
    for x in inputs:
        x.grad = None
    ag.backward([out], [weights])
    return [x.grad.copy() for x in inputs]


def assert_close(got, want):
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-12 * scale


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("t_q, t_k", [(13, 13), (5, 13), (1, 9)])
@pytest.mark.parametrize("block_size", [1, 4, 5, 13, 128])
def test_values_and_gradients_equal_the_dense_path(p, t_q, t_k, block_size):
    inputs = leaves(2, 3, t_q, t_k, 4)
    generator = site().frozen()
    out = ag.causal_attention(*inputs, SCALE, p, generator, block_size=block_size)
    reference = dense(*inputs, p, generator)
    assert_close(out.data, reference.data)
    weights = RNG.standard_normal(out.shape)
    for got, want in zip(gradients(out, inputs, weights), gradients(reference, inputs, weights)):
        assert_close(got, want)


def test_large_blocks_through_the_cpu_engine_equal_the_dense_path():
    """Blocks of more than 2**18 scores (on one thread the chains run on row blocks)."""
    inputs = leaves(2, 4, 300, 300, 8)
    generator = site().frozen()
    out = ag.causal_attention(*inputs, SCALE, 0.1, generator, block_size=128)
    reference = dense(*inputs, 0.1, generator)
    assert_close(out.data, reference.data)
    weights = RNG.standard_normal(out.shape)
    for got, want in zip(gradients(out, inputs, weights), gradients(reference, inputs, weights)):
        assert_close(got, want)


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("t_q, t_k, block_size", [(7, 7, 3), (3, 7, 2), (6, 6, 64)])
def test_gradcheck(p, t_q, t_k, block_size):
    generator = site().frozen()
    fn = lambda q, k, v: ag.causal_attention(q, k, v, SCALE, p, generator, block_size=block_size)
    assert gradcheck(fn, leaves(2, 2, t_q, t_k, 3)) < 1e-6


def test_no_dropout_when_not_training_and_masks_follow_the_position():
    inputs = leaves(1, 2, 6, 6, 3)
    plain = ag.causal_attention(*inputs, SCALE, 0.0, None).data
    evaluated = ag.causal_attention(*inputs, SCALE, 0.5, site().frozen(), training=False).data
    np.testing.assert_array_equal(evaluated, plain)
    first = ag.causal_attention(*inputs, SCALE, 0.5, site(0).frozen()).data
    again = ag.causal_attention(*inputs, SCALE, 0.5, site(0).frozen()).data
    other = ag.causal_attention(*inputs, SCALE, 0.5, site(1).frozen()).data
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other) and not np.array_equal(first, plain)


def test_backward_uses_the_forward_masks_after_the_tracker_moves_on():
    tracker = RNGTracker(seed=5, tp_rank=0, xp=np)
    live = tracker.site(MODEL_PARALLEL, 4)
    inputs = leaves(1, 2, 6, 6, 3)
    out = ag.causal_attention(*inputs, SCALE, 0.5, live.frozen(), block_size=4)
    reference = dense(*inputs, 0.5, live)
    weights = RNG.standard_normal(out.shape)
    want = gradients(reference, inputs, weights)
    out = ag.causal_attention(*inputs, SCALE, 0.5, live.frozen(), block_size=4)
    tracker.micro_batch += 1            # the schedule moved on before this backward
    for got, expected in zip(gradients(out, inputs, weights), want):
        assert_close(got, expected)


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_nothing_of_size_t_q_times_t_k_is_kept_for_backward(p):
    b, h, t, d = 2, 3, 64, 4
    qkv = Tensor(RNG.standard_normal((b, t, h, 3, d)), requires_grad=True)
    q, k, v = (x.reshape(b, t, h, d).transpose(0, 2, 1, 3) for x in ag.split(qkv, 3, axis=3))
    out = ag.causal_attention(q, k, v, SCALE, p, site().frozen(), block_size=16)
    kept = saved_bytes_by_function([out])
    # q, k, v are views into the QKV output (one buffer), then the output and one lse per query.
    assert kept == {"CausalAttention": (3 * b * t * h * d + b * h * t * d + b * h * t) * 8}
    assert kept["CausalAttention"] < b * h * t * t * 8


def test_refuses_bad_input():
    q, k, v = leaves(1, 2, 5, 4, 3)
    with pytest.raises(InputError, match="5 queries but 4 keys"):
        ag.causal_attention(q, k, v, SCALE, 0.0, None)
    q, k, v = leaves(1, 2, 4, 4, 3)
    with pytest.raises(InputError, match="dropout probability 1.0"):
        ag.causal_attention(q, k, v, SCALE, 1.0, None)
    with pytest.raises(InputError, match="block size 0"):
        ag.causal_attention(q, k, v, SCALE, 0.0, None, block_size=0)


@pytest.mark.parametrize("threads", [2, 3])
def test_heads_shared_among_threads_give_the_one_call_results_bitwise(threads, monkeypatch):
    """On the CPU the (sample, heads) chunks are shared among the budget's threads, each drawing
    its part of the masks: bitwise what one call on all heads at once computes, with one thread
    or several, and with chunks of one head or of a whole sample's heads."""
    from npmegatron.autograd.ops import attention
    from npmegatron.autograd.threads import set_cpu_threads
    inputs = leaves(2, 3, 9, 9, 4)
    weights = RNG.standard_normal((2, 3, 9, 4))

    def run(count, min_shared, chunk_bytes):
        monkeypatch.setattr(attention, "MIN_SHARED_SCORES", min_shared)
        monkeypatch.setattr(attention, "CHUNK_SCORE_BYTES", chunk_bytes)
        previous = set_cpu_threads(count)
        try:
            out = ag.causal_attention(*inputs, SCALE, 0.3, site().frozen(), block_size=4)
            return [out.data] + gradients(out, inputs, weights)
        finally:
            set_cpu_threads(previous)

    whole = run(1, 1 << 30, 1 << 20)
    for count, chunk_bytes in ((1, 1 << 20), (threads, 1 << 20), (threads, 1), (threads, 2 * 4 * 9 * 8)):
        for got, want in zip(run(count, 1, chunk_bytes), whole):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_packed_qkv_gives_the_split_path_values_and_one_gradient(p):
    """causal_attention_packed on (b, t, heads, 3, d) equals splitting q, k, v and calling
    causal_attention, values and gradient, bitwise; the gradient is one array of the packed shape."""
    qkv = Tensor(RNG.standard_normal((2, 11, 3, 3, 4)), requires_grad=True)
    weights = RNG.standard_normal((2, 3, 11, 4))
    packed = ag.causal_attention_packed(qkv, SCALE, p, site().frozen(), block_size=4)
    ag.backward([packed], [weights])
    packed_grad, qkv.grad = qkv.grad.copy(), None
    q, k, v = (part.reshape(2, 11, 3, 4).transpose(0, 2, 1, 3) for part in ag.split(qkv, 3, axis=3))
    split = ag.causal_attention(q, k, v, SCALE, p, site().frozen(), block_size=4)
    ag.backward([split], [weights])
    np.testing.assert_array_equal(packed.data, split.data)
    np.testing.assert_array_equal(packed_grad, qkv.grad)
    with pytest.raises(InputError, match="packed attention needs qkv"):
        ag.causal_attention_packed(Tensor(np.zeros((2, 11, 3, 4))), SCALE, p, None)
