"""Rank program for tests/npmegatron/test_moe.py: the MoE layer with its experts split over the
world (expert parallelism) against the whole layer on every rank.

    mpiexec -n N python tests/ranks/moe_expert_parallel.py {balanced,idle}
        Each rank routes its own tokens; with "idle" no token picks the last rank's experts (it
        receives no rows, and still takes part in every exchange). Checks: the output and the
        input's and router's gradients equal the whole layer's on the rank's tokens, each local
        expert's gradient equals the whole layer's summed over the ranks, and comm.stats() counts
        one all-to-all of counts and two of rows forward, two of rows backward, with their bytes.
        Prints "ep ok <rank>".
"""
import sys

import numpy as np


def main(case):
    from npmegatron import autograd as ag, comm
    from npmegatron.config import GPTConfig
    from npmegatron.moe import MoELayer
    world = comm.init()
    ep = comm.Group("ep", world.mpi, tuple(range(world.size)))
    cfg = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=40, max_position_embeddings=16,
                    hidden_dropout=0.0, attention_dropout=0.0, dtype="float64", num_experts=2 * world.size,
                    moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    whole, split = MoELayer(cfg, np, np.float64, 0), MoELayer(cfg, np, np.float64, 0, ep_group=ep)
    for layer in (whole, split):
        layer.initialize(cfg.seed, None)
        if case == "idle":          # the last rank's experts are never chosen
            layer.router.expert_bias[-2:] = -100.0
    x = np.random.default_rng(10 + world.rank).standard_normal((2, 3 + world.rank, cfg.hidden_size))
    cotangent = np.random.default_rng(20 + world.rank).standard_normal(x.shape)
    results = {}
    for name, layer in (("whole", whole), ("split", split)):
        comm.reset_stats()
        xt = ag.Tensor(x, requires_grad=True)
        out, _ = layer(xt)
        ag.backward(out, cotangent)
        results[name] = (out.data, xt.grad, layer, comm.stats())
    (out, gx, _, _), (sout, sgx, _, stats) = results["whole"], results["split"]
    np.testing.assert_allclose(sout, out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(sgx, gx, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(split.router.weight.grad, whole.router.weight.grad, rtol=1e-12, atol=1e-14)
    local = cfg.num_experts // ep.size
    for full, mine in zip(whole.experts.parameters(), split.experts.parameters()):  # every expert's, summed
        summed = comm.all_reduce(np.zeros(full.shape) if full.grad is None else full.grad, ep)
        got = np.zeros(mine.shape) if mine.grad is None else mine.grad
        np.testing.assert_allclose(got, summed[ep.rank * local:(ep.rank + 1) * local], rtol=1e-11, atol=1e-13)
    received = check_counts(stats, x, cfg, whole, ep)
    assert case != "idle" or ep.rank != ep.size - 1 or received == 0, received
    print(f"ep ok {world.rank} received {received}", flush=True)


def check_counts(stats, x, cfg, whole, ep):
    """1 all-to-all of the E counts, 2 of rows forward and 2 backward: this rank's k T rows out and
    their gradients home, and the rows its experts received back and their gradients out again."""
    counts = comm_counts(whole, ep)
    local = cfg.num_experts // ep.size
    received = int(counts[ep.rank * local:(ep.rank + 1) * local].sum())
    row = cfg.hidden_size * 8
    assert stats.count("all_to_all", "ep") == 1 and stats.bytes("all_to_all", "ep") == cfg.num_experts * 8, stats
    assert stats.count("all_to_all_v", "ep") == 4, stats
    mine = x.shape[0] * x.shape[1] * cfg.moe_router_topk
    assert stats.bytes("all_to_all_v", "ep") == 2 * mine * row + 2 * received * row, (stats, mine, received)
    return received


def comm_counts(whole, ep):
    from npmegatron import comm
    return comm.all_reduce(np.asarray(whole.router.tokens_per_expert, np.int64), ep)


if __name__ == "__main__":
    main(sys.argv[1])
