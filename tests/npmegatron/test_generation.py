"""Generation: the key/value cache gives the full forward's logits while feeding one position
per new token; tensor- and pipeline-parallel generation samples what the serial model samples."""
import json

import numpy as np
import pytest

from npmegatron import autograd as ag
from npmegatron.autograd import InputError
from npmegatron.generation import KVCache, generate, sample_token
from npmegatron.model import GPT, GPTConfig

CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=24,
           hidden_dropout=0.0, attention_dropout=0.0, dtype="float64")


LLAMA = dict(model_family="llama", num_attention_heads=8, group_query_attention=True, num_query_groups=2)


MOE = dict(LLAMA, num_experts=4, moe_router_topk=2, moe_layer_freq="([0]*1+[1]*1)",
           moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True)


@pytest.mark.parametrize("family", [{}, LLAMA, MOE], ids=["gpt2", "llama", "llama-moe"])
def test_cached_logits_equal_the_full_forward(family):
    """For the Llama family the cache keeps each key/value group once, rotated at its position;
    an MoE layer routes each new token as the full forward routed it."""
    model = GPT(GPTConfig(**{**CFG, **family})).eval()
    ids = np.random.default_rng(0).integers(0, 256, (2, 20))
    with ag.no_grad():
        full, _ = model(ids)
        cache = KVCache(model)
        parts = [model(ids[:, :7], cache=cache)[0].data]
        for t in range(7, 20):
            parts.append(model(ids[:, t:t + 1], cache=cache)[0].data)
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full.data, rtol=0, atol=1e-12)
    assert cache.length == 20
    cfg = GPTConfig(**{**CFG, **family})
    assert cache.layers[0].k.shape == (2, cfg.num_query_groups, 24, cfg.head_dim)


def test_each_new_token_feeds_one_position():
    model = GPT(GPTConfig(**CFG))
    seen = []
    forward = model.forward
    model.forward = lambda ids, *a, **k: (seen.append(np.shape(ids)), forward(ids, *a, **k))[1]
    out = generate(model, [5, 6, 7], max_new_tokens=10, temperature=0.0)
    assert len(out) == 13 and out[:3] == [5, 6, 7]
    assert seen == [(1, 3)] + [(1, 1)] * 9
    assert model.training                                  # restored


def test_generation_slides_past_the_position_table():
    """Past the table the model sees the last positions it holds: each token is what a full
    forward of the last 24 positions (CFG's table) gives, greedy."""
    model = GPT(GPTConfig(**CFG))
    out = generate(model, list(range(30)), max_new_tokens=50, temperature=0.0)
    assert out[:24] == list(range(6, 30))                  # the prompt's end is kept
    assert len(out) == 24 + 50
    model.eval()
    for position in range(24, len(out)):
        logits, _ = model(np.array([out[position - 24:position]]))
        assert out[position] == int(np.argmax(logits.data[0, -1]))


def test_top_p_keeps_the_fewest_likeliest_tokens_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    assert {sample_token(logits, rng, 1.0, None, top_p=0.5) for _ in range(100)} == {0}
    assert {sample_token(logits, rng, 1.0, None, top_p=0.7) for _ in range(300)} == {0, 1}
    assert {sample_token(logits, rng, 1.0, None, top_p=0.81) for _ in range(500)} == {0, 1, 2}
    assert {sample_token(logits, rng, 1.0, 1, top_p=0.9) for _ in range(50)} == {0}     # after top-k
    with pytest.raises(InputError, match="top-p 0.0 must be in"):
        generate(GPT(GPTConfig(**CFG)), [1], 3, top_p=0.0)


def test_sampling_rules():
    logits = np.array([0.0, 1.0, 3.0, 2.0])
    rng = np.random.default_rng(0)
    assert sample_token(logits, rng, 0.0, None) == 2
    assert {sample_token(logits, rng, 1.0, 2) for _ in range(200)} == {2, 3}
    with pytest.raises(InputError, match="temperature -1"):
        generate(GPT(GPTConfig(**CFG)), [1], 3, temperature=-1)
    with pytest.raises(InputError, match="the prompt is empty"):
        generate(GPT(GPTConfig(**CFG)), [], 3)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), float("-inf")])
def test_temperature_must_be_finite(temperature):
    with pytest.raises(InputError, match=f"temperature {temperature} must be a finite number >= 0"):
        generate(GPT(GPTConfig(**CFG)), [1], 3, temperature=temperature)


def test_a_tiny_temperature_is_greedy_not_nan():
    logits = np.array([0.0, 1.0, 3.0, 2.0])
    assert sample_token(logits, np.random.default_rng(0), 1e-310, None) == 2


def test_tensor_parallel_generation_equals_serial(mpirun):
    result = mpirun(2, "ranks/generation.py", args=["tp-equals-serial", json.dumps(CFG)], timeout=120)
    assert result.stdout.count("same 18") == 2


def test_pipeline_generation_equals_serial(mpirun):
    result = mpirun(2, "ranks/generation.py", args=["pp-equals-serial", json.dumps(CFG)], timeout=120)
    assert result.stdout.count("same 43") == 2       # 3 + 40: past the 24-position table, both slide
