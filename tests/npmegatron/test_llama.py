"""The Llama family (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, an untied output
layer, no biases) split the Megatron way equals the serial model in float64 under mpiexec: tensor
parallelism with and without sequence parallelism, pipeline schedules, data parallelism; with
GPT-2's communication counts per layer."""
import json

import numpy as np
import pytest

from helpers import SCHEDULES

from npmegatron.autograd import InputError
from npmegatron.config import GPTConfig
from npmegatron.model import GPT, gpt_num_parameters


def llama(**kw):
    base = dict(model_family="llama", num_layers=2, hidden_size=32, num_attention_heads=8, vocab_size=50,
                max_position_embeddings=8, dtype="float64", hidden_dropout=0.0, attention_dropout=0.0,
                group_query_attention=True, num_query_groups=4, ffn_hidden_size=40)
    return GPTConfig(**{**base, **kw})


@pytest.mark.quick_variants("2")
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_equals_serial(mpirun, tp):
    result = mpirun(tp, "ranks/tensor_parallel.py", args=["equals-serial-llama"], timeout=180)
    reports = [json.loads(l) for l in result.stdout.splitlines() if l.startswith("{")]
    assert [r["sp"] for r in reports] == [False, True]
    assert all(r["max_rel_error"] < 1e-10 for r in reports)


def test_communication_per_layer_is_gpt2s(mpirun):
    """SwiGLU's gate and up enter the TP region as one GEMM: still 2 all-reduces each way per
    layer (4 collective pairs under SP); the untied output layer's f and the loss's 3 outside."""
    result = mpirun(2, "ranks/tensor_parallel.py", args=["counts-llama"])
    reports = {r["sp"]: r for r in (json.loads(l) for l in result.stdout.splitlines() if l.startswith("{"))}
    assert reports[False]["per_layer"] == {"all_reduce": [2, 2], "all_gather": [0, 0], "reduce_scatter": [0, 0]}
    assert reports[True]["per_layer"] == {"all_reduce": [0, 0], "all_gather": [2, 2], "reduce_scatter": [2, 2]}
    assert reports[False]["one_layer_model"]["all_reduce"] == [2 + 1 + 3, 2 + 1]


@pytest.mark.slow
def test_pipeline_schedules_and_data_parallelism_equal_serial(mpirun):
    """PP 2 with each schedule (the untied output layer on the last stage, no embedding
    all-reduce), and TP 2 x DP 2 with its buckets."""
    cases = [dict(tp=1, pp=2, m=4, family="llama", **s) for s in SCHEDULES]
    result = mpirun(2, "ranks/pipeline_parallel.py", args=["check", json.dumps(cases)], timeout=300)
    assert float(result.stdout.split("worst relative error")[1].split()[0]) < 1e-10
    cases = [dict(tp=2, pp=1, m=2, schedule="1f1b", family="llama"), dict(tp=1, pp=2, m=2, schedule="1f1b",
                                                                          family="llama", sp=False)]
    result = mpirun(4, "ranks/pipeline_parallel.py", args=["check", json.dumps(cases)], timeout=300)
    assert float(result.stdout.split("worst relative error")[1].split()[0]) < 1e-10


def test_parameter_count_and_names():
    cfg = llama()
    model = GPT(cfg)
    names = [name for name, _, _ in model.named_specs()]
    assert sum(int(np.prod(spec.shape)) for _, _, spec in model.named_specs()) == gpt_num_parameters(cfg)
    assert "output_layer.weight" in names and "wpe" not in names
    assert not [n for n in names if n.endswith(".bias")]
    assert model.named_specs and dict((n, s.shape) for n, _, s in model.named_specs())[
        "blocks.0.attn.qkv.weight"] == (32, (8 + 2 * 4) * 4)


def test_gpt2_stays_the_default_and_the_family_flags_override():
    assert GPTConfig().normalization == "LayerNorm" and not GPTConfig().swiglu
    cfg = GPTConfig(model_family="llama", hidden_size=768, num_attention_heads=12, normalization="LayerNorm")
    assert cfg.normalization == "LayerNorm" and cfg.swiglu and cfg.ffn_hidden_size == 2048


@pytest.mark.parametrize("fields, words", [
    (dict(num_query_groups=3), "does not divide the 8 attention heads"),
    (dict(group_query_attention=False, num_query_groups=4), "needs --group-query-attention"),
    (dict(rotary_percent=1.5), "must be in (0, 1]"),
])
def test_bad_llama_settings_are_one_sentence(fields, words):
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        llama(**fields)


def test_key_value_groups_not_divisible_by_tp_are_refused():
    from npmegatron.comm import Group

    class FakeGroup(Group):
        def __init__(self, size):
            self.size, self.rank, self.name = size, 0, "tp"

    from npmegatron.model import ParallelAttention
    from npmegatron.tensor_parallel import RNGTracker
    with pytest.raises(InputError, match="4 key/value groups .* not divisible by tensor-parallel size 8"):
        ParallelAttention(llama(num_attention_heads=8), np, np.float64, FakeGroup(8), RNGTracker(0, 0, np), 0)
