"""`npmegatron plan` for mixture-of-experts models: parameters per rank against the models this
project builds (one process, a fake grid), the activations against the autograd tape, the
dispatcher's all-to-all bytes against the counts its multi-rank test asserts, the TP and EP
communication by hand, the refusals, and model FLOPs from the active parameters."""
import json
from dataclasses import replace
from types import SimpleNamespace

import numpy
import pytest
from click.testing import CliRunner

from npmegatron.autograd import InputError
from npmegatron.cli import main
from npmegatron.config import GPTConfig
from npmegatron.model import GPT, gpt_num_parameters, model_flops
from npmegatron.perf import ParallelShape, load_profile, memory_plan, step_time
from npmegatron.perf.memory import (check_shape, expert_parameters, moe_layer_activation_bytes, rank_expert_parameters,
                                    rank_parameters)
from npmegatron.perf.search import plan, search
from npmegatron.perf.time_model import (all_gather_time, all_reduce_time, all_to_all_time, dispatch_bytes,
                                        moe_tp_collectives)
from npmegatron.perf.work import moe_layer_gemms
from npmegatron.run import build_model
from npmegatron.tensor_parallel import pad_vocab_size

SMALL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=200, max_position_embeddings=32,
             num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
LLAMA = dict(model_family="llama", num_attention_heads=8, group_query_attention=True, num_query_groups=4)
FAMILIES = {"gpt2": {}, "llama": LLAMA,
            "shared, gated, every 2nd": {"moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True,
                                         "moe_layer_freq": "2"}}


class FakeGroup:
    def __init__(self, size, rank):
        self.size, self.rank = size, rank


def fake_grid(tp, tp_rank, pp, pp_rank, ep=1, ep_rank=0, etp=None):
    """Enough of a ProcessGrid to construct a shard with its experts (construction does not
    communicate): EP ranks holding E / EP experts each, split over TP or whole (etp 1)."""
    expert_tp = FakeGroup(tp, tp_rank) if etp in (None, tp) else FakeGroup(1, 0)
    return SimpleNamespace(tp_group=FakeGroup(tp, tp_rank), tp_rank=tp_rank, tp_size=tp, pp_size=pp,
                           pp_rank=pp_rank, embedding_group=FakeGroup(1, 0), ep_group=FakeGroup(ep, ep_rank),
                           expert_tp_group=expert_tp)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp,pp,ep,etp", [(1, 1, 1, None), (2, 1, 1, None), (2, 2, 1, None), (1, 1, 2, None),
                                          (2, 1, 2, None), (1, 2, 4, None), (2, 1, 4, 1)])
def test_parameters_per_rank_are_the_built_models(family, tp, pp, ep, etp):
    """Every (TP, PP, EP) rank's elements, and of them its experts', as the model allocates them."""
    cfg = GPTConfig(**{**SMALL, **FAMILIES[family]})
    shape = ParallelShape(tp=tp, pp=pp, dp=ep, ep=ep, etp=etp)
    for pp_rank in range(pp):
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                model = build_model(cfg, fake_grid(tp, tp_rank, pp, pp_rank, ep, ep_rank, etp))
                held = sum(p.data.size for p in model.parameters())
                experts = sum(p.data.size for _, p, spec in model.named_specs() if spec.expert)
                assert rank_parameters(cfg, shape, pp_rank) == held
                assert rank_expert_parameters(cfg, shape, pp_rank) == experts


@pytest.mark.parametrize("family", FAMILIES)
def test_parameters_follow_the_formula_over_expert_parallelism(family):
    """At EP 1 and TP 1 the whole model (gpt_num_parameters, plus the padded vocabulary); at EP 2
    and 4 each rank holds 1 / EP of the experts, whole (ETP 1) or split over TP."""
    cfg = GPTConfig(**{**SMALL, **FAMILIES[family]})
    h, f, moe_layers = cfg.hidden_size, cfg.moe_ffn_hidden_size, sum(cfg.moe_layers)
    tables = 2 if cfg.untie_embeddings_and_output_weights else 1
    padded = (pad_vocab_size(cfg.vocab_size, 1) - cfg.vocab_size) * h * tables
    assert rank_parameters(cfg, ParallelShape(), 0) == gpt_num_parameters(cfg) + padded
    expert = h * f * (3 if cfg.swiglu else 2) + ((f + h) if cfg.add_bias_linear else 0)
    one = rank_parameters(cfg, ParallelShape(), 0)
    for ep in (2, 4):
        held = rank_parameters(cfg, ParallelShape(dp=ep, ep=ep), 0)
        assert held == one - moe_layers * cfg.num_experts * expert * (ep - 1) // ep
        experts = rank_expert_parameters(cfg, ParallelShape(dp=ep, ep=ep), 0)
        assert experts == moe_layers * cfg.num_experts // ep * expert
    split = expert_parameters(cfg, ParallelShape(tp=2, dp=2, ep=2))
    bias = h if cfg.add_bias_linear else 0       # the proj bias whole on every TP rank
    assert split == cfg.num_experts // 2 * ((expert - bias) // 2 + bias)
    assert expert_parameters(cfg, ParallelShape(tp=2, dp=2, ep=2, etp=1)) == cfg.num_experts // 2 * expert


@pytest.mark.parametrize("dp,ep", [(2, 2), (4, 2), (4, 4)])
def test_the_optimizer_state_per_rank_is_the_expert_distributed_optimizers(dp, ep):
    """Measured: the moments' bytes ExpertParallelDistributedAdamW allocates on each rank, the dense
    weights' sharded over DP, the experts' over DP / EP (construction does not communicate)."""
    from npmegatron.data_parallel.expert_parallel import ExpertParallelBuckets, ExpertParallelDistributedAdamW
    cfg = GPTConfig(**{**SMALL, "num_layers": 2, "vocab_size": 64})
    per_rank = []
    for rank in range(dp):
        grid = fake_grid(1, 0, 1, 0, ep, rank % ep)
        grid.dp_cp_group, grid.expert_dp_group, grid.ep_size = FakeGroup(dp, rank), FakeGroup(dp // ep, rank // ep), ep
        model = build_model(cfg, grid)
        experts = {id(p) for _, p, spec in model.named_specs() if spec.expert}
        buckets = ExpertParallelBuckets(model.parameters(), experts, grid, 4000, sharded=True)
        optimizer = ExpertParallelDistributedAdamW(model.parameters(), buckets, grid, lr=1e-3, betas=(0.9, 0.95),
                                                   eps=1e-8, weight_decay=0.0)
        per_rank.append(sum(a.nbytes for part in optimizer.parts for kind in (part.exp_avg, part.exp_avg_sq)
                            for a in kind))
    planned = memory_plan(cfg, ParallelShape(dp=dp, ep=ep, seq=32, global_batch=dp, distributed_optimizer=True))
    assert len(set(per_rank)) == 1
    assert planned["ranks"][0]["optimizer"] == pytest.approx(per_rank[0], rel=0.01)


def test_the_experts_optimizer_state_is_sharded_over_their_data_parallel_ranks():
    """--use-distributed-optimizer: the dense state over DP x CP, the experts' over DP x CP / EP."""
    cfg = GPTConfig(**SMALL)
    shape = ParallelShape(dp=4, ep=2, micro_batch=2, global_batch=8, seq=32, distributed_optimizer=True)
    rank = memory_plan(cfg, shape)["ranks"][0]
    params, experts = rank_parameters(cfg, shape, 0), rank_expert_parameters(cfg, shape, 0)
    assert rank["expert_parameter_count"] == experts > 0
    assert rank["optimizer"] == pytest.approx(((params - experts) / 4 + experts / 2) * 2 * 4)
    assert rank["experts"] == pytest.approx(experts * 4 * 2 + experts / 2 * 8)
    whole = memory_plan(cfg, replace(shape, distributed_optimizer=False))["ranks"][0]
    assert whole["optimizer"] == 2 * 4 * params


@pytest.mark.parametrize("dp,ep,bf16", [(4, 2, False), (4, 2, True), (4, 4, True), (2, 1, False)])
def test_the_run_header_counts_the_experts_adamw_state_as_the_plan_does(dp, ep, bf16):
    """The training header's AdamW bytes per parameter (training/log.py memory_note), times the
    rank's parameters, are the plan's optimizer bytes: under --use-distributed-optimizer the dense
    state over DP, the experts' over DP / EP, not all of it over DP. The trainer is the model of
    one rank of the layout on a fake grid, with the header's other inputs beside it."""
    import re
    from npmegatron.perf.memory import rank_memory
    from npmegatron.training.log import memory_note
    cfg = GPTConfig(**{**SMALL, "num_layers": 2, "vocab_size": 64, "bf16": bf16})
    grid = fake_grid(1, 0, 1, 0, ep, 0)
    grid.dp_size, grid.cp_size, grid.ep_size = dp, 1, ep
    model = build_model(cfg, grid)
    config = SimpleNamespace(seq_length=32, micro_batch_size=2,
                             parallel=SimpleNamespace(use_distributed_optimizer=True))
    trainer = SimpleNamespace(cfg=cfg, grid=grid, config=config, model=model, params=model.parameters())
    note = memory_note(trainer)
    per_parameter = float(re.search(r"\+ ([\d.]+) B AdamW state", note).group(1))
    shape = ParallelShape(dp=dp, ep=ep, seq=32, micro_batch=2, global_batch=2 * dp, distributed_optimizer=True)
    planned = rank_memory(cfg, shape, 0)
    assert per_parameter * planned["parameter_count"] == pytest.approx(planned["optimizer"], rel=1e-3)
    experts = f"1/{dp // ep}" if dp > ep else "whole (one rank holds each)"
    sharing = f"the dense weights' 1/{dp}, the experts' {experts})" if ep > 1 else f"1/{dp}: distributed)"
    assert sharing in note


@pytest.mark.parametrize("options", [{}, {"moe_router_topk": 1}, LLAMA,
                                     {**LLAMA, "moe_shared_expert_intermediate_size": 40,
                                      "moe_shared_expert_gate": True},
                                     {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.1},
                                     {"moe_router_score_function": "sigmoid", "moe_aux_loss_coeff": 0.01},
                                     {"moe_router_pre_softmax": True, "moe_router_topk": 3}])
def test_moe_activations_are_the_autograd_tape_of_one_layer(options):
    """One more MoE layer adds the plan's bytes to what backward keeps (parameters excluded): the
    k T routed rows through the experts, the router's scores, the permutation's indices."""
    from npmegatron.autograd.memory import saved_bytes_by_function
    kw = dict(SMALL, vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0, **options)
    ids = numpy.random.default_rng(0).integers(0, 64, (2, 33))
    kept = []
    for layers in (1, 2):
        model = GPT(GPTConfig(**{**kw, "num_layers": layers}))
        _, loss = model(ids[:, :-1], ids[:, 1:])
        kept.append(sum(saved_bytes_by_function([loss], exclude=[p.data for p in model.parameters()]).values()))
    cfg = GPTConfig(**{**kw, "num_layers": 1})
    per_layer = moe_layer_activation_bytes(cfg, ParallelShape(seq=32, micro_batch=2), 4)
    assert kept[1] - kept[0] == pytest.approx(per_layer, rel=0.01)


def test_the_dispatch_bytes_are_those_comm_stats_counts():
    """tests/ranks/moe_expert_parallel.py's counts: 4 all_to_all_v, 2 mine x row + 2 received x row
    bytes (received = mine when routing is balanced), and one all_to_all of the E int64 counts."""
    cfg = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=40, max_position_embeddings=16,
                    dtype="float64", num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=12)
    shape = ParallelShape(dp=4, ep=4, micro_batch=2, seq=4)
    mine = shape.micro_batch * shape.seq * cfg.moe_router_topk
    row, received = cfg.hidden_size * 8, mine
    assert dispatch_bytes(cfg, shape, 8) == {"all_to_all_v": (4, 2 * mine * row + 2 * received * row),
                                             "all_to_all": (1, cfg.num_experts * 8)}


def flat_profile():
    """dgx2h's links with one FLOP rate (no published kernels): compute is model FLOPs / rate."""
    profile = dict(load_profile("dgx2h"), flops=39e12, flops_recompute="none")
    del profile["published"]
    return profile


def test_the_all_to_alls_by_hand():
    """Per MoE layer and micro-batch 4 all-to-alls of the k T rows and 1 of the counts, each timed
    as an all-gather of its bytes on the all-gather link; 3 more forward for a recomputed layer."""
    profile = flat_profile()
    cfg = GPTConfig(**{**SMALL, "moe_layer_freq": "2", "max_position_embeddings": 64})
    shape = ParallelShape(dp=4, ep=2, micro_batch=2, global_batch=16, seq=64)
    link = profile["intra"]["all_gather"]
    links = (link["alpha_s"], link["beta_s_per_byte"], link["base_s"])
    rows = all_to_all_time(2, 2 * 2 * 64 * 64 * 4, *links)
    counts = all_to_all_time(2, 4 * 8, *links)
    assert all_to_all_time(2, 1000, *links) == all_gather_time(2, 1000, *links)
    micro_batches, moe_layers = 2, 2
    timing = step_time(cfg, shape, profile)
    assert timing["ep_comm"] == pytest.approx(micro_batches * moe_layers * (4 * rows + counts))
    full = step_time(cfg, replace(shape, recompute="full"), profile)
    assert full["ep_comm"] == pytest.approx(micro_batches * moe_layers * (6 * rows + 2 * counts))
    assert step_time(cfg, replace(shape, ep=1), profile)["ep_comm"] == 0


@pytest.mark.parametrize("options,etp,sp,expected", [
    (LLAMA, None, False, [("all_reduce", 2, 1, 0), ("all_reduce", 1, 0, 1)]),      # one g of k T rows, one f
    (LLAMA, 1, False, []),                                                          # whole experts
    ({}, None, False, [("all_reduce", 2, 1, 0), ("all_reduce", 1, 0, 1)]),     # biases: added after the g
    ({**LLAMA, "moe_shared_expert_intermediate_size": 32}, None, True,     # the shared SwiGLU: g, two f's
     [("all_gather", 1, 1, 1), ("all_reduce", 1, 1, 2), ("all_reduce", 2, 1, 0), ("all_reduce", 1, 0, 1)]),
    ({**LLAMA, "disable_bias_linear": False}, None, False, [("all_reduce", 2, 1, 0), ("all_reduce", 1, 0, 1)]),
])
def test_the_moe_layers_tp_collectives(options, etp, sp, expected):
    """The MoE layer's MLP part in the TP group (moe/layer.py), in units of T h w bytes."""
    cfg = GPTConfig(**{**SMALL, **options})
    shape = ParallelShape(tp=2, dp=2, ep=2, etp=etp, micro_batch=2, seq=32, sequence_parallel=sp)
    unit = 2 * 32 * cfg.hidden_size * 4
    assert [(op, n / unit, f, b) for op, n, f, b in moe_tp_collectives(cfg, shape, 4)] == expected


def test_tp_communication_of_an_moe_model_by_hand():
    """Llama MoE every other layer at TP 2: a dense layer's four all-reduces of T h, an MoE layer's
    attention's two, its experts' g of the k T rows and f of the T tokens; the ends' two and the
    loss's three of a float32 number a token."""
    profile = flat_profile()
    cfg = GPTConfig(**{**SMALL, **LLAMA, "moe_layer_freq": "2"})
    shape = ParallelShape(tp=2, micro_batch=2, global_batch=2, seq=32)
    link = profile["intra"]["all_reduce"]
    reduce = lambda n: all_reduce_time(2, n, link["alpha_s"], link["beta_s_per_byte"], link["base_s"])
    tokens = 2 * 32 * 64 * 4
    by_hand = (2 * 4 * reduce(tokens) + 2 * (3 * reduce(tokens) + reduce(2 * tokens)) + 2 * reduce(tokens)
               + 3 * reduce(2 * 32 * 4))
    assert step_time(cfg, shape, profile)["tp_comm"] == pytest.approx(by_hand)


def test_an_moe_layers_gemms_are_its_active_weights():
    """Balanced routing: the rank's E / EP experts run k T EP / E rows each, k T in all, so the
    layer's GEMM FLOPs are 2 T x its active weights (attention, router, k experts, shared
    expert, gate) on this rank, whatever EP; whole experts (ETP 1) under TP repeat theirs."""
    cfg = GPTConfig(**{**SMALL, **LLAMA, "moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True})
    h, f, k, tokens = 64, 48, 2, 2 * 32
    attention = h * (8 + 2 * 4) * 8 + h * h
    for tp, ep, etp in ((1, 1, None), (1, 4, None), (2, 2, None), (2, 2, 1)):
        shape = ParallelShape(tp=tp, dp=4, ep=ep, etp=etp, micro_batch=2, seq=32)
        flops = sum(2 * m * inner * n for m, inner, n in moe_layer_gemms(cfg, shape))
        experts = k * 3 * h * f // shape.expert_tp
        assert flops == pytest.approx(2 * tokens * (attention // tp + 4 * h + experts + 3 * h * 32 // tp + h))


@pytest.mark.parametrize("shape,match", [
    (dict(dp=2, ep=2), "--expert-model-parallel-size 2 splits MoE layers' experts, but --num-experts is not given"),
    (dict(tp=2, etp=1), "--expert-tensor-parallel-size 1 splits MoE layers' experts"),
])
def test_expert_flags_without_experts_are_refused(shape, match):
    with pytest.raises(InputError, match=match):
        check_shape(GPTConfig(**{**SMALL, "num_experts": None, "moe_ffn_hidden_size": None}), ParallelShape(**shape))


@pytest.mark.parametrize("options,shape,match", [
    ({}, dict(dp=3, ep=3), "the 4 experts do not split evenly over EP 3 ranks"),
    ({}, dict(dp=2, ep=4), "expert-parallel size 4 does not divide the data-parallel x context-parallel size 2"),
    ({}, dict(tp=4, etp=2), "expert tensor-parallel size 2 is neither 1 nor TP 4"),
    ({"moe_ffn_hidden_size": 50}, dict(tp=4), "expert FFN size 50 is not divisible by the experts' TP 4"),
    ({"moe_shared_expert_intermediate_size": 30}, dict(tp=4), "shared expert size 30 is not divisible by TP 4"),
])
def test_bad_expert_layouts_get_one_sentence(options, shape, match):
    cfg = GPTConfig(**{**SMALL, **options})
    with pytest.raises(InputError, match=match) as error:
        check_shape(cfg, ParallelShape(**shape))
    assert "\n" not in str(error.value) and str(error.value).count(". ") == 0


def test_model_flops_count_the_active_parameters():
    """E experts, top 1, each the dense MLP's size: about the dense model's model FLOPs (its
    router's more), not E times; the utilisation follows them."""
    shape_of = dict(num_layers=4, hidden_size=512, num_attention_heads=8, vocab_size=256, max_position_embeddings=256)
    dense = GPTConfig(**shape_of)
    moe = GPTConfig(**shape_of, num_experts=8, moe_router_topk=1)      # experts of the dense MLP's size
    assert gpt_num_parameters(moe) > 5 * gpt_num_parameters(dense)     # the MLPs are 8 times as large
    shape = ParallelShape(dp=2, ep=2, seq=256, micro_batch=8, global_batch=16)
    profile = load_profile("dgx2h")
    planned = plan(moe, shape, profile)
    flops = planned["time"]["model_flops"]
    router = 6 * 4 * 8 * 512 * 16 * 256
    assert flops == model_flops(dense, gpt_num_parameters(dense), 16, 256) + router
    assert flops == pytest.approx(model_flops(dense, gpt_num_parameters(dense), 16, 256), rel=0.01)
    assert planned["throughput"]["mfu"] == pytest.approx(flops / planned["time"]["total"] / 2 / profile["peak_flops"])
    assert planned["active_parameters"] == gpt_num_parameters(moe, active=True) < planned["parameters"]


def test_cli_plan_prints_an_moe_models_parameters_experts_and_all_to_alls():
    runner = CliRunner()
    args = ["plan", "--model-family", "llama", "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads",
            "8", "--num-experts", "8", "--moe-router-topk", "2", "--layout", "2x1x2", "--expert-model-parallel-size",
            "2", "--seq-length", "512", "--micro-batch-size", "4", "--device", "gpu", "--fp16"]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    planned = json.loads(runner.invoke(main, args + ["--json"]).output)
    assert planned["layout"] == "2x1x2 ep2" and planned["ep"] == 2 and planned["etp"] == 2
    total, active = planned["parameters"], planned["active_parameters"]
    assert f"in 4 of 4 layers; {total:,} parameters, {active:,} active per token" in result.output
    rank = planned["memory"]["ranks"][0]
    assert f"pp rank 0 {rank['expert_parameter_count']:,} (" in result.output
    assert "expert all-to-alls" in result.output and planned["time"]["ep_comm"] > 0
    refused = runner.invoke(main, ["plan", "--num-experts", "8", "--layout", "1x1x2", "--expert-model-parallel-size",
                                   "4"])
    assert refused.exit_code == 1 and refused.output.count("\n") == 1
    assert "expert-parallel size 4 does not divide the data-parallel x context-parallel size 2" in refused.output


def test_search_tries_each_expert_parallel_size():
    """An MoE model's search ranks every EP dividing DP x CP and the experts; a given EP is kept."""
    cfg = GPTConfig(**SMALL)
    profile = load_profile("dgx2h")
    base = ParallelShape(seq=32, micro_batch=2, global_batch=16)
    layouts = {r["layout"] for r in search(cfg, base, profile, 4)}
    assert {"1x1x4", "1x1x4 ep2", "1x1x4 ep4", "2x1x2 ep2", "1x2x2 ep2"} <= layouts
    assert not any("ep8" in name for name in layouts)
    fixed = {r["layout"] for r in search(cfg, replace(base, ep=2), profile, 4)}
    assert fixed == {"1x1x4 ep2", "1x2x2 ep2", "2x1x2 ep2"}
    text = CliRunner().invoke(main, ["plan", "--search", "4", "--num-experts", "4", "--global-batch-size",
                                     "64"]).output.splitlines()
    assert text[0].split()[:5] == ["layout", "step", "ms", "compute", "TP"] and text[0].split()[5] == "EP"


def test_measured_rates_time_an_moe_layers_gemms_and_dispatch():
    """With one GEMM rate and one bandwidth (a calibrated profile's tables, made constant): the GEMM
    seconds are the layers' FLOPs (moe_layer_gemms: forward and two backward products each) over
    the rate, and an MoE layer adds the dispatch's passes to the memory-bound bytes."""
    from npmegatron.perf.profiles import normalise
    from npmegatron.perf.work import layer_gemms, moe_layer_traffic
    gemm, bandwidth, two = 1e11, 1e10, lambda value: [value, value]
    attention = {"seqs": [128, 1024], "head_dims": [32, 128]}
    for kind in ("none", "dropout"):
        attention[f"{kind}_forward"] = attention[f"{kind}_backward"] = [two(1e-9)] * 2
    rates = {"gemm": {"dims": [64, 4096], "flops": [[two(gemm)] * 2] * 2}, "attention": attention,
             "bandwidth": {"stream": {"elements": [1 << 16, 1 << 24], "bytes_per_s": two(bandwidth)}},
             "bandwidth_bytes_per_s": bandwidth, "layer_overhead_s": 0.0, "micro_batch_overhead_s": 0.0}
    link = {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9}
    profile = normalise({"name": "test", "flops": 1e11, "devices_per_node": 2, "device_memory_bytes": 1e10,
                         "intra": link, "inter": link, "measured": {"threads": {"1": rates}}})
    cfg = GPTConfig(**{**SMALL, "moe_layer_freq": "2", "max_position_embeddings": 128})
    shape = ParallelShape(dp=2, ep=2, seq=128, micro_batch=2, global_batch=8)
    flops = lambda gemms: 3 * sum(2 * m * k * n for m, k, n in gemms)
    vocab = pad_vocab_size(cfg.vocab_size, 1, cfg.make_vocab_size_divisible_by)
    by_hand = 2 * flops(layer_gemms(cfg, shape)) + 2 * flops(moe_layer_gemms(cfg, shape)) + flops([(256, 64, vocab)])
    parts = step_time(cfg, shape, profile)["compute_parts"]
    assert parts["gemm"] == pytest.approx(2 * by_hand / gemm)
    passes = {kind: n for kind, n, _, _ in moe_layer_traffic(cfg, shape, 4)}
    assert passes["dispatch"] == passes["regroup"] == 2 * 256 * 64 and passes["activation"] == 2 * 256 * 48


def grouped_bias_elements(out):
    """The elements of every GroupedBias on the tape behind `out`: its rows times its bias's width."""
    sizes, seen, stack = [], set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.name == "GroupedBias":
            sizes.append(node.ctx.blocks.rows * node.ctx.bias_shape[1])
        stack.extend(edge[0] for edge in node.edges if edge is not None)
    return sorted(sizes)


@pytest.mark.parametrize("options", [{}, {"swiglu": True}, LLAMA])
@pytest.mark.parametrize("etp", [None, 1])
def test_the_experts_bias_passes_are_the_grouped_biases_on_the_tape(options, etp):
    """moe_layer_traffic's expert bias passes (streams beyond the attention's) are the GroupedBias
    ops the routed experts record on the tape of their k T rows: GPT-2's two (fc's before the
    fused GeLU, proj's), SwiGLU with biases gate's and up's and proj's, none without biases; on
    one TP rank of two, the first projection's columns split (ETP = TP) or whole (ETP 1)."""
    from collections import Counter
    from npmegatron import autograd as ag
    from npmegatron.moe.experts import GroupedExperts
    from npmegatron.perf.work import layer_traffic, moe_layer_traffic
    cfg = GPTConfig(**{**SMALL, "dtype": "float64", **options})
    shape = ParallelShape(tp=2, seq=8, micro_batch=2, etp=etp)
    experts = GroupedExperts(cfg, numpy, numpy.float64, 0, cfg.num_experts, FakeGroup(shape.expert_tp, 0))
    experts.initialize(cfg.seed, None)
    rows = cfg.moe_router_topk * shape.micro_batch * shape.seq         # routing balanced, as the plan's
    blocks = ag.RowBlocks([rows // cfg.num_experts] * cfg.num_experts, numpy)
    out = experts(ag.Tensor(numpy.ones((rows, cfg.hidden_size)), requires_grad=True), blocks)
    streams = lambda traffic: Counter(n for kind, n, *_ in traffic if kind == "stream")  # noqa: E731
    planned = streams(moe_layer_traffic(cfg, shape, 8)) - streams(layer_traffic(cfg, shape, 8))
    assert sorted(planned.elements()) == grouped_bias_elements(out)
    assert len(grouped_bias_elements(out)) == (2 if cfg.add_bias_linear else 0)


def test_expert_gradients_and_whole_experts_by_hand():
    """Under EP the dense gradients are all-reduced over DP and the experts' over DP / EP (none
    where EP is all of DP); whole experts (ETP 1) under TP run their FLOPs on every TP rank."""
    profile = flat_profile()
    cfg = GPTConfig(**{**SMALL, "max_position_embeddings": 64})
    link = profile["intra"]["all_reduce"]
    reduce = lambda n, nbytes: all_reduce_time(n, nbytes, link["alpha_s"], link["beta_s_per_byte"], link["base_s"])
    for dp, ep in ((4, 2), (4, 4)):
        shape = ParallelShape(dp=dp, ep=ep, micro_batch=2, global_batch=16, seq=64, overlap_grad_reduce=False)
        experts = rank_expert_parameters(cfg, shape, 0)
        dense = rank_parameters(cfg, shape, 0) - experts
        by_hand = reduce(dp, dense * 4) + reduce(dp // ep, experts * 4)
        assert step_time(cfg, shape, profile)["dp_comm"] == pytest.approx(by_hand)
    shape = ParallelShape(tp=2, micro_batch=2, global_batch=2, seq=64)
    split, whole = (step_time(cfg, replace(shape, etp=etp), profile) for etp in (None, 1))
    repeated = 6 * (2 * 64 * 48 + 48 + 64) * 2 * 64 * cfg.moe_router_topk * cfg.num_layers
    assert whole["compute"] - split["compute"] == pytest.approx(repeated / 2 / 39e12)
