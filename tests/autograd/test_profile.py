"""Time per op (autograd.profile) and `bench step --threads/--profile`: off it records nothing; on,
every Function's forward and backward is timed under its name, and bench step splits its step
into kinds of op, the optimizer and the autograd's own overhead."""
import numpy as np

from npmegatron import autograd as ag
from npmegatron.autograd import profile
from npmegatron.bench.step import OP_KINDS, bench_step, format_table
from npmegatron.model import GPTConfig


def small_graph():
    x = ag.Tensor(np.ones((4, 3)), requires_grad=True)
    w = ag.Tensor(np.ones((3, 2)), requires_grad=True)
    return (ag.tanh(x @ w)).sum()


def test_off_records_nothing_and_on_times_forward_and_backward():
    small_graph().backward()
    assert not profile.active()
    with profile.op_profile() as table:
        assert profile.active()
        small_graph().backward()
    assert not profile.active()
    assert {"MatMul", "Tanh", "Sum"} <= set(table)
    forward, backward, calls = table["MatMul"]
    assert forward > 0 and backward > 0 and calls == 1


def test_bench_step_profile_splits_the_step():
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64,
                    max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    result = bench_step(cfg, 2, 16, warmup=1, iters=2, threads=1, profile=True)
    kinds = result["profile_s"]
    assert set(OP_KINDS) | {"other ops", "optimizer", "autograd and Python overhead"} == set(kinds)
    assert kinds["matmul"] > 0 and kinds["layernorm"] > 0 and kinds["loss"] > 0
    assert sum(v for k, v in kinds.items() if k != "autograd and Python overhead") < 2 * result["step_s"]
    assert result["threads"] == 1 and "matmul (per step)" in format_table(result)


def test_bench_step_profile_gives_each_kind_its_gemms_alone():
    """--profile sets the Linears' and attention's time in the step beside their GEMMs' in the
    ceiling's rounds; the two parts are the whole round."""
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64,
                    max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    result = bench_step(cfg, 2, 16, warmup=1, iters=2, threads=1, profile=True)
    alone = result["profile_gemms_alone_s"]
    assert set(alone) == {"matmul", "attention"} and min(alone.values()) > 0
    rounds = result["gemm_rounds_s"]
    assert min(rounds) * (1 - 1e-9) <= sum(alone.values()) <= max(rounds) * (1 + 1e-9)
    table = format_table(result)
    assert "matmul (per step)" in table and table.count("its GEMMs alone, best of 3") == 2
    assert "profile_gemms_alone_s" not in bench_step(cfg, 2, 16, warmup=1, iters=1, threads=1)
