"""The mixture-of-experts layer (npmegatron/moe/) against an independent NumPy reference written
from Megatron-Core's routing rules (moe_utils.topk_routing_with_score_function, the Switch
load-balancing loss, the ST-MoE z-loss), its gradients by finite differences in float64, and its
flags' checks."""
import math

import numpy as np
import pytest

from npmegatron import autograd as ag
from npmegatron.autograd import InputError, gradcheck
from npmegatron.config import GPTConfig, parse_moe_layer_freq
from npmegatron.model import GPT
from npmegatron.moe import MoELayer, aux_loss
from npmegatron.moe.router import balancing_loss, z_loss

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=40, max_position_embeddings=16,
            hidden_dropout=0.0, attention_dropout=0.0, dtype="float64", num_experts=6, moe_router_topk=2,
            moe_ffn_hidden_size=12)

ROUTINGS = {
    "softmax": {},
    "pre-softmax": {"moe_router_pre_softmax": True},
    "sigmoid, expert bias": {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
    "grouped, scaled": {"moe_router_num_groups": 3, "moe_router_group_topk": 2,
                        "moe_router_topk_scaling_factor": 2.5},
    "top-1 sigmoid": {"moe_router_score_function": "sigmoid", "moe_router_topk": 1},
    "capacity 0.7, probs": {"moe_expert_capacity_factor": 0.7},
    "capacity 0.5, position": {"moe_expert_capacity_factor": 0.5, "moe_token_drop_policy": "position"},
}
FAMILIES = {"gpt2": {}, "llama": {"model_family": "llama"}, "swiglu, biases": {"swiglu": True},
            "shared, gated": {"moe_shared_expert_intermediate_size": 20, "moe_shared_expert_gate": True}}


def layer_and_input(seed=0, **options):
    cfg = GPTConfig(**{**BASE, **options})
    layer = MoELayer(cfg, np, np.float64, 0)
    layer.initialize(cfg.seed, None)
    for i, p in enumerate(layer.parameters()):      # biases away from zero and unlike each other,
        p.data += np.random.default_rng((seed, i)).normal(0, 0.05, p.shape)     # so each is checked
    if layer.router.expert_bias is not None:
        layer.router.expert_bias[...] = np.random.default_rng(seed + 1).normal(0, 0.3, cfg.num_experts)
    x = np.random.default_rng(seed + 2).standard_normal((2, 5, cfg.hidden_size))
    return cfg, layer, x


def test_adamw_spares_the_experts_biases_weight_decay_as_every_other_bias():
    """A stacked bias is 2-D (an expert a row), but a bias: AdamW decays the experts' weights only,
    as Megatron spares every bias (and, in the model, every 1-D parameter)."""
    from npmegatron.optim.adamw import AdamW
    for family in ("gpt2", "swiglu, biases"):
        cfg, layer, _ = layer_and_input(**FAMILIES[family])
        named = dict(layer.named_parameters())
        optimizer = AdamW(list(named.values()), weight_decay=0.1)
        mask = np.asarray(optimizer.decayed)
        decayed = {name for name, p in named.items() if mask[optimizer.layout.where[id(p)]].all()}
        spared = {name for name, p in named.items() if not mask[optimizer.layout.where[id(p)]].any()}
        assert decayed | spared == set(named)
        assert {name for name in named if name.startswith("experts.") and name.endswith(".bias")} <= spared
        assert {name for name in named if name.endswith(".weight") and named[name].ndim >= 2} == decayed, family


def reference_choice(logits, cfg, bias):
    """(experts, weights) of one token's logits, Megatron-Core's rules written out."""
    k, e = cfg.moe_router_topk, cfg.num_experts
    if cfg.moe_router_score_function == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
        choosing = scores + (0 if bias is None else bias)
    else:
        softmax = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        scores = softmax if cfg.moe_router_pre_softmax else logits
        choosing = scores
    allowed = np.ones(e, bool)
    if cfg.moe_router_group_topk:
        groups = choosing.reshape(cfg.moe_router_num_groups, -1)
        group_score = np.sort(groups, axis=1)[:, ::-1][:, :k // cfg.moe_router_group_topk].sum(axis=1)
        chosen_groups = np.argsort(-group_score)[:cfg.moe_router_group_topk]
        allowed = np.repeat(np.isin(np.arange(cfg.moe_router_num_groups), chosen_groups), e // cfg.moe_router_num_groups)
    experts = np.argsort(-np.where(allowed, choosing, -np.inf))[:k]
    if cfg.moe_router_score_function == "sigmoid":
        weights = scores[experts]
        weights = weights / (weights.sum() + 1e-20) if k > 1 else weights
    elif cfg.moe_router_pre_softmax:
        weights = scores[experts]
    else:
        chosen = logits[experts]
        weights = np.exp(chosen - chosen.max()) / np.exp(chosen - chosen.max()).sum()
    return experts, weights * (cfg.moe_router_topk_scaling_factor or 1.0)


def reference_mlp(x, mlp, cfg, expert=None):
    """The MLP on one row: the shared expert's, or routed expert `expert` of the stacked weights."""
    weight = lambda p: p.data if expert is None else p.data[expert]  # noqa: E731
    biased = lambda part: x @ weight(part.weight) + (0 if part.bias is None else weight(part.bias))  # noqa: E731
    if cfg.swiglu:
        gate, up = biased(mlp.gate), biased(mlp.up)
        hidden = gate / (1 + np.exp(-gate)) * up
        return hidden @ weight(mlp.proj.weight) + (0 if mlp.proj.bias is None else weight(mlp.proj.bias))
    h = biased(mlp.fc)
    hidden = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    return hidden @ weight(mlp.proj.weight) + weight(mlp.proj.bias)


def reference_kept(choices, cfg):
    """{(token, expert)} each expert keeps under the capacity factor: its choices ranked by weight
    (probs; earlier token first on ties) or by token (position), the first ceil(k T / E x factor)."""
    if cfg.moe_expert_capacity_factor is None:
        return {(t, e) for t, pairs in enumerate(choices) for e, _ in pairs}
    capacity = math.ceil(len(choices) * cfg.moe_router_topk / cfg.num_experts * cfg.moe_expert_capacity_factor)
    kept = set()
    for expert in range(cfg.num_experts):
        mine = [(-w if cfg.moe_token_drop_policy == "probs" else 0, t) for t, pairs in enumerate(choices)
                for e, w in pairs if e == expert]
        kept |= {(t, expert) for _, t in sorted(mine)[:capacity]}
    return kept


def reference_layer(x, layer, cfg):
    """(output, load-balancing loss, z-loss) token by token."""
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ layer.router.weight.data.T
    out = np.zeros_like(flat)
    choices = [list(zip(*reference_choice(logits[t], cfg, layer.router.expert_bias))) for t in range(len(flat))]
    kept = reference_kept(choices, cfg)
    for t, row in enumerate(flat):
        out[t] = sum(w * reference_mlp(row, layer.experts, cfg, e) for e, w in choices[t] if (t, e) in kept)
        if layer.shared_expert is not None:
            gate = 1 / (1 + np.exp(-(row @ layer.shared_expert_gate.data[0])))
            out[t] += gate * reference_mlp(row, layer.shared_expert, cfg)
    if cfg.moe_router_score_function == "sigmoid":
        probs = 1 / (1 + np.exp(-logits))
        probs /= probs.sum(axis=1, keepdims=True) + 1e-20
    else:
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
    tokens = flat.shape[0]
    # the loss's counts: a plain top k of those scores (Megatron's compute_routing_scores_for_aux_loss)
    plain = np.bincount(np.argsort(-probs, axis=1)[:, :cfg.moe_router_topk].reshape(-1), minlength=cfg.num_experts)
    balance = cfg.num_experts / (cfg.moe_router_topk * tokens ** 2) * (probs.sum(axis=0) * plain).sum()
    top = logits.max(axis=1)
    lse = np.log(np.exp(logits - top[:, None]).sum(axis=1)) + top
    return out.reshape(x.shape), balance, (lse ** 2).mean()


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_moe_layer_equals_the_numpy_reference(routing, family):
    cfg, layer, x = layer_and_input(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
                                    **ROUTINGS[routing], **FAMILIES[family])
    aux_loss.take_values()
    out, bias = layer(ag.Tensor(x, requires_grad=True))
    expected, balance, z = reference_layer(x, layer, cfg)
    assert bias is None
    np.testing.assert_allclose(out.data, expected, rtol=1e-12, atol=1e-13)
    values = aux_loss.take_values()
    assert math.isclose(values["load_balancing_loss"][0], balance, rel_tol=1e-12)   # logged without the
    assert math.isclose(values["z_loss"][0], z, rel_tol=1e-12)                      # coefficients
    choices = x.shape[0] * x.shape[1] * cfg.moe_router_topk
    dropped = layer.router.interval_dropped
    assert layer.router.tokens_per_expert.sum() == choices - dropped
    assert (dropped > 0) == (cfg.moe_expert_capacity_factor is not None)


@pytest.mark.parametrize("routing", ["softmax", pytest.param("pre-softmax", marks=pytest.mark.slow),
                                     "sigmoid, expert bias", pytest.param("capacity 0.7, probs", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_moe_layers_gradients_pass_finite_differences(routing, family, monkeypatch):
    """Every input of the layer (the tokens, the router's weight, the experts' and the shared
    expert's weights and biases) by central differences, the routing held by its margins; the
    auxiliary losses' seeds off here (checked below)."""
    cfg, layer, x = layer_and_input(**ROUTINGS[routing], **FAMILIES[family])
    monkeypatch.setitem(aux_loss._scale, "value", 0.0)
    params = list(layer.parameters())
    xt = ag.Tensor(x, requires_grad=True)
    assert gradcheck(lambda a, *_: layer(a)[0], [xt] + params, tol=1e-6, max_entries=24) < 1e-6


@pytest.mark.parametrize("factor", [0.7, 3.0])
def test_padding_to_capacity_runs_every_expert_on_its_capacity_and_changes_no_number(factor):
    """--moe-pad-expert-input-to-capacity: each expert's block is padded to ceil(k T / E x factor)
    rows in a GPU's batched GEMMs, and the layer's output and every gradient are the unpadded layer's."""
    results = []
    for pad in (False, True):
        cfg, layer, x = layer_and_input(moe_expert_capacity_factor=factor, moe_pad_expert_input_to_capacity=pad)
        widths = []
        run = layer.experts.forward
        layer.experts.forward = lambda rows, blocks, finish=None: widths.append(blocks.width) or run(rows, blocks, finish)
        xt = ag.Tensor(x, requires_grad=True)
        out = layer(xt)[0]
        ag.sum(out * out).backward()
        results.append([out.data, xt.grad] + [p.grad for p in layer.parameters()])
    capacity = math.ceil(x.shape[0] * x.shape[1] * cfg.moe_router_topk / cfg.num_experts * factor)
    assert widths == [capacity]
    for padded, plain in zip(results[1], results[0]):
        np.testing.assert_allclose(padded, plain, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_the_balancing_and_z_losses_pass_finite_differences(score_function):
    cfg = GPTConfig(**{**BASE, "moe_router_score_function": score_function})
    logits = ag.Tensor(np.random.default_rng(3).standard_normal((10, cfg.num_experts)), requires_grad=True)
    for kind in ("aux_loss", "seq_aux_loss"):
        assert gradcheck(lambda z: balancing_loss(z, cfg, kind, sequences=2), [logits]) < 1e-7
    assert gradcheck(z_loss, [logits]) < 1e-7


def test_an_auxiliary_loss_enters_backward_with_the_main_losss_seed(monkeypatch):
    """The losses ride on the router's output: backward adds seed x d(loss), the seed being the
    one the schedule gives the main loss (loss scale / micro-batches)."""
    cfg, layer, x = layer_and_input(moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.02)
    grads = {}
    for seed in (0.0, 0.5):
        monkeypatch.setitem(aux_loss._scale, "value", seed)
        layer.router.weight.grad = None
        out, _ = layer(ag.Tensor(x))
        ag.backward(ag.sum(out))
        grads[seed] = layer.router.weight.grad.copy()
    flat = ag.Tensor(x.reshape(-1, cfg.hidden_size))
    layer.router.weight.grad = None
    logits = ag.linear(flat, layer.router.weight.T)
    ag.backward(balancing_loss(logits, cfg, "aux_loss") * 0.3 + z_loss(logits) * 0.02)
    np.testing.assert_allclose(grads[0.5] - grads[0.0], 0.5 * layer.router.weight.grad, rtol=1e-10, atol=1e-14)


def test_a_gpt_with_moe_layers_trains_its_experts_and_routers():
    """--moe-layer-freq's pattern places the layers; each MoE layer's router and every expert
    that took tokens get gradients; the dense layer keeps its MLP."""
    cfg = GPTConfig(**{**BASE, "moe_layer_freq": "([0]*1+[1]*1)", "moe_aux_loss_coeff": 0.01})
    model = GPT(cfg)
    assert not hasattr(model.blocks[0].mlp, "router") and hasattr(model.blocks[1].mlp, "router")
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9))
    _, loss = model(ids[:, :-1], ids[:, 1:])
    ag.backward(loss)
    moe = model.blocks[1].mlp
    assert moe.router.weight.grad is not None and np.abs(moe.router.weight.grad).max() > 0
    used = np.flatnonzero(moe.router.tokens_per_expert)
    assert all(np.abs(moe.experts.fc.weight.grad[e]).max() > 0 for e in used)


def test_the_expert_bias_moves_towards_balance():
    cfg, layer, x = layer_and_input(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                    moe_router_bias_update_rate=0.01)
    before = layer.router.expert_bias.copy()
    layer(ag.Tensor(x))
    counts = layer.router.tokens_per_expert
    layer.router.update_expert_bias()
    np.testing.assert_allclose(layer.router.expert_bias - before, 0.01 * np.sign(counts.mean() - counts), atol=1e-7)


def test_moe_layer_freq_takes_an_integer_or_megatrons_pattern():
    assert parse_moe_layer_freq("1", 3) == [1, 1, 1]
    assert parse_moe_layer_freq(2, 5) == [1, 0, 1, 0, 1]
    assert parse_moe_layer_freq("([0]*1+[1]*3)", 4) == [0, 1, 1, 1]
    assert parse_moe_layer_freq("[1,0]*2", 4) == [1, 0, 1, 0]


@pytest.mark.parametrize("options,match", [
    ({"moe_router_topk": 7}, "more than the 6 experts"),
    ({"moe_layer_freq": "([0]*1+[1]*3)"}, "gives 4 layers, but the model has 2"),
    ({"moe_layer_freq": "__import__('os')"}, "neither an integer nor a list pattern"),
    ({"moe_layer_freq": "0"}, "must be a positive integer"),
    ({"num_experts": None, "moe_shared_expert_intermediate_size": 8}, "--num-experts is not given"),
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 2}, "must divide the 6 experts"),
    ({"moe_router_num_groups": 3}, "needs both"),
    ({"moe_router_num_groups": 3, "moe_router_group_topk": 1, "moe_router_topk": 4}, "shares a group can give"),
    ({"moe_router_enable_expert_bias": True}, "needs --moe-router-score-function sigmoid"),
    ({"moe_shared_expert_gate": True}, "is not given"),
    ({"moe_expert_capacity_factor": 0.0}, "must be positive"),
    ({"moe_pad_expert_input_to_capacity": True}, "--moe-expert-capacity-factor is not given"),
])
def test_bad_moe_flags_get_one_sentence(options, match):
    with pytest.raises(InputError, match=match):
        GPTConfig(**{**BASE, **options})


MOE_TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "8", "--log-interval", "1",
            "--eval-interval", "100", "--eval-iters", "1", "--lr-warmup-iters", "2", "--lr", "3e-3",
            "--sample-tokens", "0", "--dtype", "float64", "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-aux-loss-coeff", "0.05", "--moe-z-loss-coeff", "0.01", "--moe-layer-freq", "([1]*1+[0]*1)"]


def family_of(layout):
    """The model's flags among a layout's arguments (its family, its balancing loss), which the
    serial run takes too."""
    return [word for i, word in enumerate(layout)
            for flag in [layout[i - 1] if word[:2] != "--" else word]
            if flag in ("--model-family", "--moe-router-load-balancing-type", "--num-layers", "--moe-layer-freq")]


@pytest.mark.parametrize("layout", [["--tp", "2"], pytest.param(["--pp", "2"], marks=pytest.mark.slow),
                                    pytest.param([], marks=pytest.mark.slow),
                                    pytest.param(["--pp", "2", "--tp", "2"], marks=pytest.mark.slow),
                                    pytest.param(["--tp", "2", "--sequence-parallel"], marks=pytest.mark.slow),
                                    pytest.param(["--tp", "2", "--model-family", "llama"], marks=pytest.mark.slow),
                                    ["--cp", "2"],
                                    pytest.param(["--cp", "2", "--moe-router-load-balancing-type", "seq_aux_loss"],
                                                 marks=pytest.mark.slow)],
                         ids=["tp2", "pp2", "dp2", "tp2xpp2", "tp2-sp", "tp2-llama", "cp2", "cp2-seq-aux"])
def test_moe_training_follows_the_serial_trajectory(tmp_path, layout):
    """Two ranks (TP 2 with every expert split over the TP ranks, with sequence parallelism too;
    PP 2 with the MoE layer on the first stage, whose auxiliary losses are seeded there; or DP 2
    with the expert bias's counts summed over the replicas) follow one rank's losses to 1e-10 over
    8 steps with the load-balancing and z-losses on and sigmoid routing with DeepSeek-V3's expert bias."""
    import json
    from helpers import launch
    args = MOE_TINY + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    curves = {}
    ranks = 4 if {"--pp", "--tp"} <= set(layout) else 2
    for name, extra, n in (("serial", family_of(layout), 0), ("layout", layout, ranks)):
        log = tmp_path / f"{name}.jsonl"
        run = launch(n, args + extra + ["--log-file", str(log)])
        assert run.returncode == 0, run.stdout + run.stderr
        curves[name] = [json.loads(line)["loss"] for line in open(log)]
    assert len(curves["serial"]) == 8
    assert curves["layout"] == pytest.approx(curves["serial"], rel=1e-10, abs=0)


@pytest.mark.parametrize("ranks,case", [(2, "balanced"), (4, "balanced"), (3, "idle")])
def test_experts_split_over_ranks_equal_the_whole_layer(mpirun, ranks, case):
    """Expert parallelism's two all-to-alls each way (npmegatron/moe/expert_parallel.py) give the
    whole layer's output, input and router gradients, and each expert's gradient summed over the
    ranks' tokens, at 2, 3 and 4 ranks, also where a rank's experts take no token; comm.stats()
    holds the exchanges to their count and bytes."""
    result = mpirun(ranks, "ranks/moe_expert_parallel.py", args=[case], timeout=120)
    assert result.stdout.count("ep ok") == ranks, result


@pytest.mark.parametrize("ranks,layout", [(2, ["--expert-model-parallel-size", "2"]),
                                          pytest.param(4, ["--expert-model-parallel-size", "2"], marks=pytest.mark.slow),
                                          pytest.param(4, ["--expert-model-parallel-size", "2", "--pp", "2"],
                                                       marks=pytest.mark.slow),
                                          pytest.param(4, ["--expert-model-parallel-size", "2", "--tp", "2"],
                                                       marks=pytest.mark.slow),
                                          pytest.param(4, ["--expert-model-parallel-size", "2", "--tp", "2",
                                                           "--sequence-parallel"], marks=pytest.mark.slow),
                                          (4, ["--expert-model-parallel-size", "2", "--tp", "2", "--sequence-parallel",
                                               "--model-family", "llama"]),
                                          pytest.param(4, ["--expert-model-parallel-size", "2", "--tp", "2",
                                                           "--expert-tensor-parallel-size", "1"],
                                                       marks=pytest.mark.slow),
                                          (2, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]),
                                          pytest.param(4, ["--expert-model-parallel-size", "2",
                                                           "--use-distributed-optimizer"], marks=pytest.mark.slow),
                                          pytest.param(4, ["--expert-model-parallel-size", "2", "--cp", "2"],
                                                       marks=pytest.mark.slow),
                                          (2, ["--expert-model-parallel-size", "2", "--cp", "2"]),
                                          pytest.param(4, ["--expert-model-parallel-size", "4", "--cp", "2"],
                                                       marks=pytest.mark.slow),
                                          pytest.param(2, ["--expert-model-parallel-size", "2",
                                                           "--recompute-granularity", "full", "--recompute-method", "uniform",
                                                           "--recompute-num-layers", "1"], marks=pytest.mark.slow),
                                          pytest.param(4, ["--expert-model-parallel-size", "2", "--pp", "2",
                                                           "--num-layers", "4", "--moe-layer-freq", "2",
                                                           "--num-layers-per-virtual-pipeline-stage", "1"],
                                                       marks=pytest.mark.slow),
                                          pytest.param(4, ["--expert-model-parallel-size", "2", "--pp", "2",
                                                           "--use-distributed-optimizer"], marks=pytest.mark.slow)],
                         ids=["ep2", "ep2xdp2", "ep2xpp2", "ep2xtp2", "ep2xtp2-sp", "ep2xtp2-sp-llama", "ep2xtp2-etp1",
                              "ep2-distopt",
                              "ep2xdp2-distopt", "ep2-in-dp2xcp2", "ep2-over-cp2", "ep4-over-dp2xcp2", "ep2-recompute", "ep2xpp2-interleaved",
                              "ep2xpp2-distopt"])
def test_expert_parallel_training_follows_the_serial_trajectory(tmp_path, ranks, layout):
    """EP 2 (the two DP ranks split the experts), EP 2 x expert-DP 2 (4 DP ranks), EP over the CP
    ranks (the two CP ranks of one DP rank; all of DP 2 x CP 2 at EP 4), EP 2 x PP 2 and
    EP 2 x TP 2 (each expert split over the TP ranks; with sequence parallelism; or whole on each
    TP rank), and EP 2 with the distributed optimizer (the experts' AdamW state sharded over the
    expert-data-parallel ranks, the dense weights' over DP) against one rank over 8 steps, float64,
    to 1e-10: the experts' gradients summed over the
    expert-data-parallel ranks and divided by DP (the shared expert's, a dense weight, averaged
    over DP), the gradient norm (clipping binds at 0.3)
    counting each expert once, the load-balancing and z-losses on and the expert bias's counts
    summed over all replicas. The global batch of 8 is 4, 2 or 1 accumulation steps a rank."""
    import json
    from helpers import launch
    args = MOE_TINY + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                       "--global-batch-size", "8", "--clip-grad", "0.3",
                       "--moe-shared-expert-intermediate-size", "24", "--moe-shared-expert-gate"]
    curves, norms = {}, {}
    for name, extra, n in (("serial", family_of(layout), 0), ("layout", layout, ranks)):
        log = tmp_path / f"{name}.jsonl"
        run = launch(n, args + extra + ["--log-file", str(log)])
        assert run.returncode == 0, run.stdout + run.stderr
        records = [json.loads(line) for line in open(log)]
        curves[name], norms[name] = [r["loss"] for r in records], [r["grad_norm"] for r in records]
    assert len(curves["serial"]) == 8 and max(norms["serial"]) > 0.3
    assert curves["layout"] == pytest.approx(curves["serial"], rel=1e-10, abs=0)
    assert norms["layout"] == pytest.approx(norms["serial"], rel=1e-10, abs=0)


@pytest.mark.parametrize("storage", ["--bf16", pytest.param("--fp16", marks=pytest.mark.slow)])
def test_expert_parallel_training_under_16_bit_storage_follows_the_serial_run(tmp_path, storage):
    """Under --bf16 (and --fp16, with its loss scaling) EP 2 follows the serial run's losses to
    1e-4: each expert's block holds its rows in the same order, so the GEMMs round alike, and the
    rare 16-bit value that rounds the other way (the gradients are summed in another order over
    the ranks) moves a loss by about 1e-6."""
    import json
    from helpers import launch
    args = [a for a in MOE_TINY if a not in ("--dtype", "float64")] + [storage]
    curves = {}
    for name, extra, n in (("serial", [], 0), ("ep2", ["--expert-model-parallel-size", "2"], 2)):
        log = tmp_path / f"{name}.jsonl"
        run = launch(n, args + extra + ["--log-file", str(log)])
        assert run.returncode == 0, run.stdout + run.stderr
        curves[name] = [json.loads(line)["loss"] for line in open(log)]
    assert len(curves["serial"]) == 8 and curves["serial"][-1] < curves["serial"][0]
    assert curves["ep2"] == pytest.approx(curves["serial"], rel=1e-4, abs=0)


@pytest.mark.parametrize("options,world,match", [
    ({"expert_model_parallel_size": 2}, 2, "--num-experts is not given"),
    ({"expert_model_parallel_size": 4, "num_experts": 6}, 4, "do not split evenly over 4 ranks"),
    ({"expert_model_parallel_size": 2, "num_experts": 4}, 3, "which 2 does not divide"),
    ({"expert_tensor_parallel_size": 2, "num_experts": 4, "tensor_model_parallel_size": 4}, 4, "choose 1 or 4"),
    ({"expert_tensor_parallel_size": 1, "tensor_model_parallel_size": 2}, 2, "--num-experts is not given"),
])
def test_bad_expert_parallel_layouts_get_one_sentence(options, world, match):
    from npmegatron.config import TrainConfig
    with pytest.raises(InputError, match=match):
        TrainConfig.from_flat(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                              micro_batch_size=2, **options).plan(world)


def test_parameter_counts_know_total_and_active_experts():
    """gpt_num_parameters counts every expert (the model's own parameters, summed) or, with
    active, the k a token uses; model FLOPs count the active ones."""
    from npmegatron.model import gpt_num_parameters, model_flops
    for options in ({}, {"model_family": "llama"}, {"moe_shared_expert_intermediate_size": 20,
                                                    "moe_shared_expert_gate": True, "moe_layer_freq": "2"}):
        cfg = GPTConfig(**{**BASE, **options})
        model = GPT(cfg)
        held = sum(p.size for p in model.parameters())
        padded = (model.padded_vocab_size - cfg.vocab_size) * cfg.hidden_size
        padded *= 2 if cfg.untie_embeddings_and_output_weights else 1
        assert gpt_num_parameters(cfg) == held - padded, options
        moe_layers = sum(cfg.moe_layers)
        expert = 16 * 12 * (2 if cfg.swiglu else 1) + 12 * 16 + (0 if cfg.swiglu else 12 + 16)
        assert gpt_num_parameters(cfg) - gpt_num_parameters(cfg, active=True) == moe_layers * 4 * expert
        lookup = cfg.vocab_size * 16 if cfg.untie_embeddings_and_output_weights else 0
        assert model_flops(cfg, gpt_num_parameters(cfg), 2, 8) == \
            6 * (gpt_num_parameters(cfg, active=True) - lookup) * 16 + 12 * 2 * 2 * 64 * 16


def test_training_logs_the_moe_losses_and_expert_load_under_megatrons_names(tmp_path):
    """At EP 2, the log file's records carry the load-balancing loss and z-loss (without their
    coefficients) and the busiest expert's tokens over the mean's; TensorBoard gets them as
    Megatron-Core names them."""
    import json
    from helpers import launch
    log, board = tmp_path / "log.jsonl", tmp_path / "tb"
    run = launch(2, MOE_TINY + ["--expert-model-parallel-size", "2", "--log-file", str(log), "--log-interval", "4",
                                "--tensorboard-dir", str(board)])
    assert run.returncode == 0, run.stdout + run.stderr
    records = [json.loads(line) for line in open(log)]
    assert len(records) == 2
    for r in records:
        assert 0.9 < r["load_balancing_loss"] < 2.0     # 1 at perfect balance (E sum f_i P_i)
        assert r["z_loss"] > 0 and 1.0 <= r["tokens_per_expert_max_over_mean"] <= 4.0
    assert "load balancing loss" in run.stdout and "tokens per expert max/mean" in run.stdout
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = event_accumulator.EventAccumulator(str(board))
    events.Reload()
    assert {"load_balancing_loss", "z_loss", "tokens-per-expert-max-over-mean"} <= set(events.Tags()["scalars"])


@pytest.mark.parametrize("ranks,ep,pad", [(2, "2", []), pytest.param(4, "2", [], marks=pytest.mark.slow),
                                          (2, "2", ["--moe-pad-expert-input-to-capacity"])],
                         ids=["ep2", "ep2xdp2", "ep2-padded"])
def test_expert_parallel_drops_the_tokens_its_data_parallel_layout_drops(tmp_path, ranks, ep, pad):
    """Under a capacity factor each rank drops over its own tokens' choices, so EP 2 follows the
    same ranks at EP 1 (plain data parallelism) step by step, dropped choices included; also with
    every expert's rows padded to its capacity at EP 2 (and not at EP 1)."""
    import json
    from helpers import launch
    args = MOE_TINY + ["--moe-expert-capacity-factor", "0.6", "--global-batch-size", "8"]
    curves = {}
    for name, extra in (("dp", []), ("ep", ["--expert-model-parallel-size", ep] + pad)):
        log = tmp_path / f"{name}.jsonl"
        run = launch(ranks, args + extra + ["--log-file", str(log)])
        assert run.returncode == 0, run.stdout + run.stderr
        curves[name] = [(r["loss"], r["dropped_tokens"]) for r in map(json.loads, open(log))]
    assert all(dropped > 0 for _, dropped in curves["dp"])
    assert [d for _, d in curves["ep"]] == [d for _, d in curves["dp"]]
    assert [l for l, _ in curves["ep"]] == pytest.approx([l for l, _ in curves["dp"]], rel=1e-10, abs=0)


@pytest.mark.parametrize("ranks,layout", [pytest.param(0, [], marks=pytest.mark.slow),
                                          (2, ["--expert-model-parallel-size", "2"]),
                                          pytest.param(4, ["--expert-model-parallel-size", "2",
                                                           "--use-distributed-optimizer"], marks=pytest.mark.slow),
                                          pytest.param(4, ["--expert-model-parallel-size", "4", "--cp", "2"],
                                                       marks=pytest.mark.slow)],
                         ids=["serial", "ep2", "ep2xdp2-distopt", "ep4-over-dp2xcp2"])
def test_a_moe_run_resumes_bitwise(tmp_path, ranks, layout):
    """Saved at step 3 of 6 and resumed, a run with MoE layers (load-balancing and z-losses, a
    capacity factor; at EP 2, with and without the distributed optimizer, sigmoid routing with the
    expert bias, which the checkpoint holds) logs steps 4 to 6 exactly as the run that went
    straight through."""
    import json
    from helpers import launch
    args = MOE_TINY + ["--moe-expert-capacity-factor", "0.8", "--train-iters", "6", "--save-interval", "3",
                       "--global-batch-size", "8"] + layout
    if layout:
        args += ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    run = launch(ranks, args + ["--save", str(tmp_path / "a"), "--log-file", str(straight)])
    assert run.returncode == 0, run.stdout + run.stderr
    run = launch(ranks, args + ["--save", str(tmp_path / "b"), "--exit-interval", "3",
                                "--log-file", str(tmp_path / "x")])
    assert run.returncode == 0, run.stdout + run.stderr
    run = launch(ranks, args + ["--load", str(tmp_path / "b"), "--log-file", str(resumed)])
    assert run.returncode == 0, run.stdout + run.stderr
    expected = [json.loads(line)["loss"] for line in open(straight)][3:]
    assert [json.loads(line)["loss"] for line in open(resumed)] == expected


def test_a_checkpoint_saved_at_ep4_loads_at_ep1_and_at_ep2_x_tp2(tmp_path):
    """Saved at step 3 of 6 by EP 4 (each rank writes its expert's shard, rank 0 the dense weights
    and the routers' expert biases too), the checkpoint resumes on one rank and at EP 2 x TP 2
    (each expert then split over the TP ranks), both logging steps 4 to 6 as EP 4 went on, to
    1e-10; a run without the expert bias refuses a checkpoint that has none only the other way."""
    import json
    from helpers import launch
    args = MOE_TINY + ["--train-iters", "6", "--save-interval", "3", "--global-batch-size", "8",
                       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                       "--moe-shared-expert-intermediate-size", "24"]
    straight = tmp_path / "straight.jsonl"
    run = launch(4, args + ["--expert-model-parallel-size", "4", "--save", str(tmp_path / "ck"),
                            "--log-file", str(straight)])
    assert run.returncode == 0, run.stdout + run.stderr
    folder = tmp_path / "ck" / "iter_0000003"
    assert sorted(p.name for p in folder.glob("*.safetensors")) == [f"mp_rank_00_000_{e:03d}.safetensors"
                                                                     for e in range(4)]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["grid"]["ep"] == 4 and set(manifest["expert_bias"]) == {"blocks.0.mlp.router"}
    expected = [json.loads(line)["loss"] for line in open(straight)][3:]
    for name, ranks, layout in (("ep1", 0, []), ("ep2xtp2", 4, ["--expert-model-parallel-size", "2", "--tp", "2"])):
        log = tmp_path / f"{name}.jsonl"
        run = launch(ranks, args + layout + ["--load", str(folder), "--log-file", str(log)])
        assert run.returncode == 0, run.stdout + run.stderr
        assert [json.loads(line)["loss"] for line in open(log)] == pytest.approx(expected, rel=1e-10, abs=0)
    without_bias = [a for a in args if a != "--moe-router-enable-expert-bias"]
    run = launch(0, without_bias + ["--save", str(tmp_path / "plain"), "--train-iters", "3",
                                    "--log-file", str(tmp_path / "p.jsonl")])
    assert run.returncode == 0, run.stdout + run.stderr
    run = launch(0, args + ["--load", str(tmp_path / "plain"), "--log-file", str(tmp_path / "q.jsonl")])
    assert run.returncode != 0 and "saved without --moe-router-enable-expert-bias" in run.stdout + run.stderr


def test_sigmoid_routing_stays_finite_far_from_zero():
    """The router's sigmoid takes exp of -|x| only: logits of +-1000 give 1 and 0 and finite
    gradients (1 / (1 + exp(-x)) would overflow and make them NaN)."""
    from npmegatron.moe.router import sigmoid
    x = ag.Tensor(np.array([-1000.0, -20.0, 0.0, 20.0, 1000.0]), requires_grad=True)
    s = sigmoid(x)
    ag.backward(ag.sum(s))
    np.testing.assert_allclose(s.data, 1 / (1 + np.exp(-np.clip(x.data, -700, 700))), rtol=1e-15, atol=1e-300)
    assert np.isfinite(x.grad).all() and x.grad[2] == 0.25
    assert gradcheck(sigmoid, [ag.Tensor(np.linspace(-30, 30, 13), requires_grad=True)]) < 1e-6


def test_forwards_without_gradients_record_no_moe_losses_or_drops():
    """Evaluation (and recomputation's first pass) runs without gradients: the z-loss and the
    dropped choices are training's only, as Megatron-Core records them."""
    cfg, layer, x = layer_and_input(moe_z_loss_coeff=0.01, moe_aux_loss_coeff=0.1, moe_expert_capacity_factor=0.5)
    aux_loss.take_values()
    with ag.no_grad():
        layer(ag.Tensor(x))
    assert aux_loss.take_values() == {} and layer.router.interval_dropped == 0
    layer(ag.Tensor(x, requires_grad=True))
    assert set(aux_loss.take_values()) == {"z_loss", "load_balancing_loss"} and layer.router.interval_dropped > 0


@pytest.mark.parametrize("router_dtype", ["fp32", "fp64"])
def test_the_router_dtype_keeps_the_routing_unrounded_under_bf16(router_dtype):
    """--moe-router-dtype under --bf16: the routing weights are off the bf16 grid (by default they
    are rounded onto it, as every op's output), come back as float32, and the router's weight and
    input still get their gradients."""
    from npmegatron.autograd import precision
    from npmegatron.moe import TopKRouter
    x = precision.round_(np.random.default_rng(0).standard_normal((10, 16)).astype(np.float32), "bf16")
    seen = {}
    for dtype in (None, router_dtype):
        cfg = GPTConfig(**{**BASE, "dtype": "float32", "moe_router_dtype": dtype, "moe_aux_loss_coeff": 0.1})
        router = TopKRouter(cfg, np, np.float32, 0)
        router.initialize(cfg.seed, "bf16")
        xt = ag.Tensor(x.copy(), requires_grad=True)
        with precision.storage("bf16"):
            weights, _, _ = router(xt)
            ag.sum(weights * weights).backward()
        assert weights.dtype == np.float32 and np.abs(router.weight.grad).sum() > 0 and np.abs(xt.grad).sum() > 0
        seen[dtype] = weights.data
    on_grid = lambda a: np.array_equal(a, precision.round_(a.copy(), "bf16"))      # noqa: E731
    assert on_grid(seen[None]) and not on_grid(seen[router_dtype])


def test_the_router_in_float64_passes_finite_differences():
    cfg, layer, x = layer_and_input(moe_router_dtype="fp64", moe_router_pre_softmax=True)
    params = list(layer.parameters())
    xt = ag.Tensor(x, requires_grad=True)
    assert gradcheck(lambda a, *_: layer(a)[0], [xt] + params, tol=1e-6, max_entries=24) < 1e-6


def test_the_fp32_routers_backward_reads_its_own_unrounded_softmax_under_bf16():
    """Under --bf16 the ops after the router round their outputs in place (a reshape's is a view
    of its input): the router hands on a copy, so its backward reads the unrounded softmax it
    saved, and its gradients are those of a float32 router on the same (bf16) inputs."""
    from npmegatron.autograd import precision
    from npmegatron.moe import TopKRouter
    x = precision.round_(np.random.default_rng(0).standard_normal((10, 16)).astype(np.float32), "bf16")
    c = precision.round_(np.random.default_rng(1).standard_normal(20).astype(np.float32), "bf16")
    grads = []
    for storage in ("bf16", None):
        cfg = GPTConfig(**{**BASE, "dtype": "float32", "moe_router_dtype": "fp32"})
        router = TopKRouter(cfg, np, np.float32, 0)
        router.initialize(cfg.seed, "bf16")
        with precision.storage(storage):
            weights, _, _ = router(ag.Tensor(x.copy()))
            ag.sum(ag.reshape(weights, (20,)) * ag.Tensor(c)).backward()
        grads.append(router.weight.grad.copy())
    np.testing.assert_array_equal(grads[0], grads[1])


def test_a_checkpoint_with_one_tensor_an_expert_is_refused_in_one_sentence():
    """Checkpoints from before the experts were stacked name one tensor an expert; loading one
    says so, not that a shard is missing."""
    from npmegatron.checkpointing import reshard
    model = GPT(GPTConfig(**BASE))
    covered = {name: np.full(p.shape, ".experts." not in name) for name, p, _ in model.named_specs()}
    saved = {"mp_rank_00_000.safetensors": {"blocks.0.mlp.experts.3.fc.weight": [[0, 16], [0, 12]]}}
    with pytest.raises(InputError, match="holds its MoE experts one tensor each \\(such as "
                                         "blocks.0.mlp.experts.3.fc.weight\\)"):
        reshard._check_covered("ck", model, reshard.places(model), covered, saved)
