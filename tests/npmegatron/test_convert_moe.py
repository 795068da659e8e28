"""Hugging Face Mixtral and Qwen2-MoE <-> npmegatron (npmegatron/hf_convert/moe.py): random HF-layout
models (grouped-query attention, an untied head, the top 2 of 8 experts; Qwen2-MoE with q, k, v
biases, a gated shared expert, both norm_topk_prob values and a dense layer from mlp_only_layers)
loaded into the serial GPT give the loss, logits and every gradient of an independent NumPy forward
written with HF's semantics (softmax over all experts, top k, renormalised or not; the shared
expert times sigmoid(x w)) and a backward written by hand, itself held against central
differences; weights, folders and configs round-trip exactly; every refusal is one sentence.
--add-qkv-bias at TP 2 equals the serial model, and a converted Qwen2-MoE runs at TP 2 x PP 2.
With transformers installed, the same against MixtralForCausalLM and Qwen2MoeForCausalLM."""
import dataclasses
import json
import math
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from npmegatron.autograd import InputError
from npmegatron.config import GPTConfig
from npmegatron.convert import (config_from_hf, config_to_hf, export_hf, import_hf, masters_from_hf, masters_to_hf,
                                read_hf_folder, write_hf_folder)
from npmegatron.model import GPT, gpt_num_parameters
from npmegatron.module import load_masters
from test_convert import assembled_gradients, relative_error
from test_convert_llama import (HEAD, ReferenceLlama, assert_backward_is_the_derivative, canonical, ids_for, rms_norm,
                                rms_norm_backward, silu)

SHARED = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 16, "vocab_size": 60, "rms_norm_eps": 1e-5, "rope_theta": 500.0,
          "hidden_act": "silu", "tie_word_embeddings": False, "attention_dropout": 0.0, "initializer_range": 0.02,
          "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0, "output_router_logits": False}
MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], **SHARED, "intermediate_size": 24,
           "num_local_experts": 8, "router_jitter_noise": 0.0, "sliding_window": None}
QWEN2_MOE = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], **SHARED, "num_hidden_layers": 3,
             "intermediate_size": 40, "moe_intermediate_size": 12, "shared_expert_intermediate_size": 20,
             "num_experts": 8, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [0],
             "qkv_bias": True, "use_sliding_window": False}
VARIANTS = {"mixtral": MIXTRAL, "qwen2-moe": QWEN2_MOE, "qwen2-moe-norm-topk": {**QWEN2_MOE, "norm_topk_prob": True},
            "mixtral-tied": {**MIXTRAL, "tie_word_embeddings": True}}


def swiglu_names(module, mixtral):
    """(gate, up, down) of one SwiGLU under `module`, as each family names them."""
    parts = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    return tuple(f"{module}.{part}.weight" for part in parts)


def hf_shapes(hf):
    """{HF name without "model.": shape} of a Mixtral or Qwen2-MoE config, written from HF's
    modules (not from the converter), lm_head when untied."""
    mixtral, h, vocab = hf["model_type"] == "mixtral", hf["hidden_size"], hf["vocab_size"]
    heads, groups, experts = hf["num_attention_heads"], hf["num_key_value_heads"], hf.get("num_experts")
    d, experts = h // heads, hf["num_local_experts"] if mixtral else experts

    def swiglu(module, f):
        return dict(zip(swiglu_names(module, mixtral), ((f, h), (f, h), (h, f))))

    shapes = {"embed_tokens.weight": (vocab, h), "norm.weight": (h,)}
    for i in range(hf["num_hidden_layers"]):
        layer, rows = f"layers.{i}.", {"q": heads * d, "k": groups * d, "v": groups * d}
        shapes.update({layer + "input_layernorm.weight": (h,), layer + "post_attention_layernorm.weight": (h,),
                       layer + "self_attn.o_proj.weight": (h, h)})
        shapes.update({f"{layer}self_attn.{x}_proj.weight": (n, h) for x, n in rows.items()})
        if not mixtral and hf["qkv_bias"]:
            shapes.update({f"{layer}self_attn.{x}_proj.bias": (n,) for x, n in rows.items()})
        if mixtral:
            moe, f = layer + "block_sparse_moe", hf["intermediate_size"]
        elif i in hf["mlp_only_layers"] or (i + 1) % hf["decoder_sparse_step"]:
            shapes.update(swiglu(layer + "mlp", hf["intermediate_size"]))
            continue
        else:
            moe, f = layer + "mlp", hf["moe_intermediate_size"]
            shapes.update({moe + ".shared_expert_gate.weight": (1, h),
                           **swiglu(moe + ".shared_expert", hf["shared_expert_intermediate_size"])})
        shapes[moe + ".gate.weight"] = (experts, h)
        for e in range(experts):
            shapes.update(swiglu(f"{moe}.experts.{e}", f))
    if not hf["tie_word_embeddings"]:
        shapes[HEAD] = (vocab, h)
    return shapes


def random_moe_state(hf, seed=0, dtype=np.float64):
    """An HF state with every value random (RMSNorm gains near 1, linears and routers over their
    fan-in, biases non-zero), so a misplaced row, column or expert changes the logits."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in hf_shapes(hf).items():
        values = rng.standard_normal(shape)
        if name.endswith("norm.weight"):
            values = 1.0 + 0.3 * values
        elif name.endswith(".bias") or name in ("embed_tokens.weight", HEAD):
            values = 0.3 * values
        else:
            values = values / math.sqrt(shape[1])
        state[canonical(name)] = values.astype(dtype)
    return state


# ---- the reference: HF's MoE blocks in NumPy, forward and a hand-written backward --------------------

def softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def swiglu_forward(x, gate, up, down):
    """(silu(x gate^T) * (x up^T)) down^T with HF's (out, in) weights; also what backward needs."""
    a, b = x @ gate.T, x @ up.T
    hidden = silu(a) * b
    return hidden @ down.T, (x, a, b, hidden, gate, up, down)


def swiglu_backward(dy, saved):
    """(dx, (d gate, d up, d down)) of swiglu_forward."""
    x, a, b, hidden, gate, up, down = saved
    dhidden = dy @ down
    s = sigmoid(a)
    da, db = dhidden * b * s * (1.0 + a * (1.0 - s)), dhidden * silu(a)
    return da @ gate + db @ up, (da.T @ x, db.T @ x, dy.T @ hidden)


class ReferenceMoE(ReferenceLlama):
    """MixtralForCausalLM's or Qwen2MoeForCausalLM's loss and every gradient: Llama's reference
    (with Qwen2-MoE's q, k, v biases) whose MoE layers are HF's sparse blocks: router logits x W^T,
    softmax over all experts, its top k, divided by their sum for Mixtral and under norm_topk_prob;
    each token's k experts' outputs weighted and summed; Qwen2-MoE's shared expert added times
    sigmoid(x w). Dense layers (Qwen2-MoE's mlp_only_layers) are Llama's MLP."""

    def __init__(self, state, hf):
        super().__init__(state, hf)
        self.mixtral = hf["model_type"] == "mixtral"
        self.block = "block_sparse_moe" if self.mixtral else "mlp"
        self.k = hf["num_experts_per_tok"]
        self.experts = hf["num_local_experts"] if self.mixtral else hf["num_experts"]
        self.renormalise = self.mixtral or hf["norm_topk_prob"]

    def _mlp(self, x, layer):
        moe = layer + self.block
        if moe + ".gate.weight" not in self.p:
            return super()._mlp(x, layer)
        p = self.p
        c, inverse = rms_norm(x, p[layer + "post_attention_layernorm.weight"], self.eps)
        flat = c.reshape(-1, c.shape[-1])
        probs = softmax(flat @ p[moe + ".gate.weight"].T)
        chosen = np.argsort(-probs, -1)[:, :self.k]
        top = np.take_along_axis(probs, chosen, -1)
        weights = top / top.sum(-1, keepdims=True) if self.renormalise else top
        out, ran = np.zeros_like(flat), {}
        for e in np.unique(chosen):
            rows, slots = np.nonzero(chosen == e)         # a token picks an expert once
            y, saved = swiglu_forward(flat[rows], *self._weights(f"{moe}.experts.{e}"))
            out[rows] += weights[rows, slots, None] * y
            ran[e] = (rows, slots, y, saved)
        shared = None
        if moe + ".shared_expert_gate.weight" in p:
            y, saved = swiglu_forward(flat, *self._weights(moe + ".shared_expert"))
            gate = sigmoid(flat @ p[moe + ".shared_expert_gate.weight"].T)
            out += gate * y
            shared = (y, saved, gate)
        self.tape.append(dict(x=x, inverse=inverse, flat=flat, probs=probs, chosen=chosen, top=top,
                              weights=weights, ran=ran, shared=shared))
        return out.reshape(x.shape)

    def _weights(self, module):
        return [self.p[name] for name in swiglu_names(module, self.mixtral)]

    def _mlp_backward(self, dout, s, layer, grads):
        if "ran" not in s:
            return super()._mlp_backward(dout, s, layer, grads)
        p, moe, d = self.p, layer + self.block, dout.reshape(-1, dout.shape[-1])
        dflat, dweights = np.zeros_like(s["flat"]), np.zeros_like(s["weights"])
        for e in range(self.experts):                 # an expert no token chose has zero gradients
            names = swiglu_names(f"{moe}.experts.{e}", self.mixtral)
            if e not in s["ran"]:
                grads.update({name: np.zeros_like(p[name]) for name in names})
                continue
            rows, slots, y, saved = s["ran"][e]
            dweights[rows, slots] = (d[rows] * y).sum(-1)
            dx, dw = swiglu_backward(s["weights"][rows, slots, None] * d[rows], saved)
            dflat[rows] += dx
            grads.update(zip(names, dw))
        dtop = dweights
        if self.renormalise:          # w = v / sum(v): dv = (dw - sum(dw w)) / sum(v)
            dtop = (dweights - (dweights * s["weights"]).sum(-1, keepdims=True)) / s["top"].sum(-1, keepdims=True)
        dprobs = np.zeros_like(s["probs"])
        np.put_along_axis(dprobs, s["chosen"], dtop, -1)
        dlogits = s["probs"] * (dprobs - (dprobs * s["probs"]).sum(-1, keepdims=True))
        grads[moe + ".gate.weight"] = dlogits.T @ s["flat"]
        dflat += dlogits @ p[moe + ".gate.weight"]
        if s["shared"] is not None:
            y, saved, gate = s["shared"]
            dz = (d * y).sum(-1, keepdims=True) * gate * (1.0 - gate)
            grads[moe + ".shared_expert_gate.weight"] = dz.T @ s["flat"]
            dx, dw = swiglu_backward(gate * d, saved)
            dflat += dx + dz @ p[moe + ".shared_expert_gate.weight"]
            grads.update(zip(swiglu_names(moe + ".shared_expert", self.mixtral), dw))
        dx, grads[layer + "post_attention_layernorm.weight"] = rms_norm_backward(
            dflat.reshape(dout.shape), s["x"], s["inverse"], p[layer + "post_attention_layernorm.weight"])
        return dx


# ---- our model from the same state ---------------------------------------------------------------

def cfg_of(hf, **changes):
    return GPTConfig(**{**config_from_hf(hf), "dtype": "float64", **changes})


def ours_in_hf_layout(hf, masters, ids):
    """(loss, logits, {canonical HF name: gradient}) of our serial GPT on next-token targets, the
    gradients taken back to HF's layout by masters_to_hf (an expert no token chose: zero)."""
    cfg = cfg_of(hf, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPT(cfg)
    load_masters(model, masters)
    model.train()
    logits, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    grads = {name: np.zeros(spec.shape) if param.grad is None else param.grad[tuple(slice(0, n) for n in spec.shape)]
             for name, param, spec in model.named_specs()}
    return float(loss.data), model.full_logits(logits), masters_to_hf(grads, cfg)


def gradient_error(grad, reference):
    """The largest difference relative to the reference's largest entry, or to 1e-3 where that is
    smaller (an expert no token chose has zero gradients on both sides)."""
    return np.abs(grad - reference).max() / max(np.abs(reference).max(), 1e-3)


# ---- 1. loss, logits and every gradient equal the reference ---------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_logits_and_every_gradient_equal_the_hf_reference(variant):
    hf = VARIANTS[variant]
    state, ids = random_moe_state(hf), ids_for(hf)
    reference = ReferenceMoE(state, hf)
    reference_loss, reference_logits = reference.loss(ids[:, :-1], ids[:, 1:])
    reference_grads = reference.gradients()
    loss, logits, grads = ours_in_hf_layout(hf, masters_from_hf(state, cfg_of(hf)), ids)
    assert relative_error(logits, reference_logits) < 1e-12
    assert abs(loss - reference_loss) < 1e-12 * reference_loss
    assert sorted(grads) == sorted(state)
    assert all(len(s["ran"]) >= 5 for s in reference.tape if "ran" in s)   # most experts took tokens
    for name, grad in grads.items():
        assert gradient_error(grad, reference_grads[name]) < 1e-12, name


@pytest.mark.parametrize("variant", ["mixtral", "qwen2-moe", "qwen2-moe-norm-topk"])
def test_the_references_backward_is_its_forwards_derivative(variant):
    """Central differences of the reference's loss on random entries of every HF tensor, so the
    hand-written backward the model is held against is itself right."""
    hf = VARIANTS[variant]
    assert_backward_is_the_derivative(ReferenceMoE, random_moe_state(hf), hf, ids_for(hf, t=8), entries=2)


def test_the_qkv_bias_and_the_experts_are_where_they_belong():
    """q, k, v biases joined without the regrouping, or two experts swapped, keep every shape and
    change the logits: only the values show the converter put each piece in its place."""
    hf, ids = QWEN2_MOE, ids_for(QWEN2_MOE)
    state, cfg = random_moe_state(hf), cfg_of(hf)
    masters = masters_from_hf(state, cfg)
    reference = ReferenceMoE(state, hf).loss(ids[:, :-1], ids[:, 1:])[1]
    plain = {**masters, "blocks.1.attn.qkv.bias": np.concatenate(
        [state[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"])}
    stacked = masters["blocks.2.mlp.experts.up.weight"][[1, 0, *range(2, hf["num_experts"])]]
    swapped = {**masters, "blocks.2.mlp.experts.up.weight": stacked}
    for wrong in (plain, swapped):
        assert relative_error(ours_in_hf_layout(hf, wrong, ids)[1], reference) > 1e-3


# ---- 2. weights, folders and configurations round-trip ------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("variant", VARIANTS)
def test_weights_round_trip_exactly(dtype, variant):
    hf = VARIANTS[variant]
    state, cfg = random_moe_state(hf, dtype=dtype), cfg_of(hf)
    masters = masters_from_hf(state, cfg)
    assert sorted(masters) == sorted(name for name, _, _ in GPT(cfg).named_specs())
    assert sum(a.size for a in masters.values()) == gpt_num_parameters(cfg)
    back = masters_to_hf(masters, cfg)
    assert sorted(back) == sorted(state)
    assert all(back[k].dtype == dtype and np.array_equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("variant", ["mixtral", "qwen2-moe", "qwen2-moe-norm-topk"])
def test_folder_round_trip_through_a_checkpoint(tmp_path, variant):
    """write_hf_folder -> convert --from-hf (a checkpoint) -> convert --to-hf: the same tensors,
    bit for bit, and config.json's fields back as they were."""
    from click.testing import CliRunner
    from npmegatron.cli import main
    hf = VARIANTS[variant]
    state = random_moe_state(hf, dtype=np.float32)
    write_hf_folder(str(tmp_path / "in"), hf, state)
    for args in (["--from-hf", tmp_path / "in", "--save", tmp_path / "ck"], ["--load", tmp_path / "ck", "--to-hf",
                                                                           tmp_path / "out"]):
        run = CliRunner().invoke(main, ["convert", *map(str, args)])
        assert run.exit_code == 0, run.output
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(back) == sorted(state)
    assert all(back[k].dtype == np.float32 and np.array_equal(back[k], state[k]) for k in state)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: written[k] for k in hf} == hf and written["torch_dtype"] == "float32"
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0}


def test_a_converted_checkpoint_resumes_with_its_own_args(tmp_path):
    """--use-checkpoint-args takes the MoE layers' shape and routing and the QKV bias from the
    converted checkpoint, so `train --load CK --use-checkpoint-args` builds the converted model."""
    from npmegatron.checkpointing import checkpoint
    from npmegatron.config import MOE_ARGS, TrainConfig
    write_hf_folder(str(tmp_path / "in"), QWEN2_MOE, random_moe_state(QWEN2_MOE))
    import_hf(str(tmp_path / "in"), str(tmp_path / "ck"))
    config = TrainConfig.from_flat(load=str(tmp_path / "ck"), use_checkpoint_args=True, seq_length=16)
    model = config.with_checkpoint_args(checkpoint.read_manifest(str(tmp_path / "ck"))[1]).model
    converted = cfg_of(QWEN2_MOE)
    assert all(getattr(model, name) == getattr(converted, name) for name in MOE_ARGS + ("add_qkv_bias",))
    assert model.moe_layers == [0, 1, 1] and model.add_qkv_bias
    dense = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}, "args": {}}
    assert TrainConfig.from_flat(num_experts=4).with_checkpoint_args(dense).model.num_experts is None


CONFIGS = {
    "mixtral": dict(num_experts=8, moe_ffn_hidden_size=24, ffn_hidden_size=24, moe_router_topk=2),
    "qwen2_moe": dict(num_experts=6, moe_ffn_hidden_size=12, ffn_hidden_size=40, moe_router_topk=3,
                      moe_layer_freq="([0]*1+[1]*2+[0]*1)", moe_shared_expert_intermediate_size=20,
                      moe_shared_expert_gate=True, add_qkv_bias=True, moe_router_pre_softmax=True),
    "qwen2_moe-no-qkv-bias": dict(num_experts=4, moe_ffn_hidden_size=12, moe_shared_expert_intermediate_size=20,
                                  moe_shared_expert_gate=True, moe_aux_loss_coeff=0.01),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_config_round_trips(name):
    cfg = GPTConfig(model_family="llama", num_layers=4, hidden_size=48, num_attention_heads=6,
                    group_query_attention=True, num_query_groups=2, vocab_size=300, max_position_embeddings=64,
                    hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-6, rotary_base=1e6,
                    **CONFIGS[name])
    hf = config_to_hf(cfg)
    assert hf["model_type"] == name.split("-")[0] and json.loads(json.dumps(hf)) == hf
    again = GPTConfig(**{**config_from_hf(hf), "dtype": cfg.dtype})
    assert again == cfg and config_to_hf(again) == hf


def test_qwen2_moe_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    hf = {**QWEN2_MOE, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    cfg = cfg_of(hf)
    assert [int(cfg.is_moe_layer(n)) for n in range(6)] == [0, 1, 0, 0, 0, 1]
    assert config_to_hf(cfg)["mlp_only_layers"] == [0, 2, 3, 4] and config_to_hf(cfg)["decoder_sparse_step"] == 1


def test_config_defaults_are_transformers():
    """Absent fields mean what MixtralConfig and Qwen2MoeConfig assume."""
    mixtral, qwen = config_from_hf({"model_type": "mixtral"}), config_from_hf({"model_type": "qwen2_moe"})
    assert (mixtral["num_experts"], mixtral["moe_router_topk"], mixtral["moe_ffn_hidden_size"],
            mixtral["num_query_groups"], mixtral["rotary_base"], mixtral["moe_aux_loss_coeff"]) == (8, 2, 14336, 8, 1e6,
                                                                                                   0.001)
    assert (qwen["num_experts"], qwen["moe_router_topk"], qwen["moe_ffn_hidden_size"], qwen["ffn_hidden_size"],
            qwen["moe_shared_expert_intermediate_size"], qwen["add_qkv_bias"], qwen["moe_router_pre_softmax"],
            qwen["moe_layer_freq"]) == (60, 4, 1408, 5632, 5632, True, True, "1")


# ---- 3. refusals, one sentence each ---------------------------------------------------------------

@pytest.mark.parametrize("base, change, words", [
    (MIXTRAL, {"router_jitter_noise": 0.01}, "router_jitter_noise 0.01; npmegatron supports only 0"),
    (MIXTRAL, {"sliding_window": 8}, "sliding_window 8; npmegatron supports only null or at least "
                                     "max_position_embeddings 16"),
    (MIXTRAL, {"num_experts_per_tok": 9}, "num_experts_per_tok 9, more than num_local_experts 8"),
    (MIXTRAL, {"num_local_experts": 0}, "num_local_experts 0; it must be a positive integer"),
    (MIXTRAL, {"hidden_act": "gelu"}, "hidden_act 'gelu'; npmegatron supports only \"silu\""),
    (MIXTRAL, {"rope_scaling": {"type": "yarn"}}, "rope_scaling .*; npmegatron supports only null"),
    (MIXTRAL, {"router_aux_loss_coef": -1}, "router_aux_loss_coef -1; it must be a finite number, not negative"),
    (QWEN2_MOE, {"use_sliding_window": True}, "use_sliding_window True; npmegatron supports only false"),
    (QWEN2_MOE, {"layer_types": ["sliding_attention"] * 3}, "layer_types .*; npmegatron supports only 3 times"),
    (QWEN2_MOE, {"norm_topk_prob": 1}, "norm_topk_prob 1; it must be true or false"),
    (QWEN2_MOE, {"qkv_bias": "yes"}, "qkv_bias 'yes'; it must be true or false"),
    (QWEN2_MOE, {"mlp_only_layers": [3]}, "mlp_only_layers \\[3\\]; it must be a list of layer numbers from 0 to 2"),
    (QWEN2_MOE, {"decoder_sparse_step": 0}, "decoder_sparse_step 0; it must be a positive integer"),
    (QWEN2_MOE, {"shared_expert_intermediate_size": None}, "shared_expert_intermediate_size None; it must be"),
])
def test_unsupported_configs_are_refused_in_one_sentence(base, change, words):
    with pytest.raises(InputError, match=words) as error:
        config_from_hf({**base, **change})
    assert "\n" not in str(error.value)


LLAMA_MOE = dict(model_family="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_experts=4)


@pytest.mark.parametrize("parts, words", [
    (dict(moe_router_score_function="sigmoid"), "sigmoid routing, which neither Hugging Face's MixtralForCausalLM "
                                                "nor Qwen2MoeForCausalLM computes; route with softmax"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), "group-limited routing, which neither"),
    (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True), "sigmoid routing"),
    (dict(moe_router_topk_scaling_factor=2.5), "a top-k scaling factor, which neither"),
    (dict(moe_expert_capacity_factor=1.0), "an expert capacity factor, which drops tokens"),
    (dict(add_qkv_bias=True), "QKV biases \\(--add-qkv-bias\\), which Hugging Face's MixtralForCausalLM does not, "
                              "and no shared expert, which its Qwen2MoeForCausalLM needs"),
    (dict(moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=8),
     "a shared expert, which .* does not, and no gate on its shared expert \\(--moe-shared-expert-gate\\)"),
    (dict(moe_layer_freq=2), "dense layers \\(--moe-layer-freq\\), which"),
    (dict(disable_bias_linear=False), "disable_bias_linear False, but Hugging Face's MixtralForCausalLM and "
                                      "Qwen2MoeForCausalLM have True"),
    (dict(model_family="gpt2", num_attention_heads=4), "MoE layers \\(--num-experts\\), but Hugging Face's "
                                                       "GPT2LMHeadModel has none"),
    (dict(num_experts=None, add_qkv_bias=True), "QKV biases \\(--add-qkv-bias\\), but Hugging Face's LlamaForCausalLM"),
])
def test_models_neither_family_computes_are_not_written(parts, words):
    cfg = GPTConfig(**{**LLAMA_MOE, **parts})
    with pytest.raises(InputError, match=words) as error:
        config_to_hf(cfg)
    assert "\n" not in str(error.value)
    with pytest.raises(InputError, match=words):
        masters_to_hf({}, cfg)


def without(state, key):
    return {k: v for k, v in state.items() if k != key}


@pytest.mark.parametrize("hf, edit, hf_change, words", [
    (MIXTRAL, lambda s: without(s, "model.layers.1.block_sparse_moe.experts.7.w3.weight"), {},
     "has no tensor 'layers.1.block_sparse_moe.experts.7.w3.weight' \\(shape \\(24, 32\\)\\); it does not hold a "
     "Mixtral of this configuration"),
    (MIXTRAL, lambda s: {**s, "model.layers.0.block_sparse_moe.experts.8.w1.weight": np.ones((24, 32))}, {},
     "unexpected tensor 'model.layers.0.block_sparse_moe.experts.8.w1.weight'; only Mixtral's own tensors"),
    (MIXTRAL, lambda s: {**s, "model.layers.0.mlp.experts.gate_up_proj": np.ones((8, 48, 32))}, {},
     "unexpected tensor 'model.layers.0.mlp.experts.gate_up_proj'; only Mixtral's own tensors \\(MixtralForCausalLM, "
     "its experts one by one"),
    (MIXTRAL, lambda s: s, {"num_local_experts": 4}, "config.json has num_local_experts 4, but tensor "
     "'model.layers.0.block_sparse_moe.gate.weight' has shape \\(8, 32\\)"),
    (MIXTRAL, lambda s: s, {"intermediate_size": 20}, "config.json has intermediate_size 20, but tensor "
     "'model.layers.0.block_sparse_moe.experts.0.w1.weight' has shape \\(24, 32\\)"),
    (QWEN2_MOE, lambda s: without(s, "model.layers.2.self_attn.v_proj.bias"), {},
     "has no tensor 'layers.2.self_attn.v_proj.bias' \\(shape \\(16,\\)\\); it does not hold a Qwen2-MoE"),
    (QWEN2_MOE, lambda s: s, {"qkv_bias": False}, "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"),
    (QWEN2_MOE, lambda s: s, {"mlp_only_layers": []}, "has no tensor 'layers.0.mlp.shared_expert_gate.weight'"),
    (QWEN2_MOE, lambda s: s, {"moe_intermediate_size": 16}, "config.json has moe_intermediate_size 16, but tensor "
     "'model.layers.1.mlp.experts.0.gate_proj.weight' has shape \\(12, 32\\)"),
    (QWEN2_MOE, lambda s: s, {"shared_expert_intermediate_size": 8}, "shared_expert_intermediate_size 8, but tensor"),
    (QWEN2_MOE, lambda s: {**s, "model.layers.1.mlp.shared_expert_gate.weight": np.ones((2, 32))}, {},
     "'model.layers.1.mlp.shared_expert_gate.weight' has shape \\(2, 32\\), but the configuration needs \\(1, 32\\)"),
    (QWEN2_MOE, lambda s: {**s, "model.layers.1.mlp.gate.weight": np.full((8, 32), np.inf)}, {},
     "'model.layers.1.mlp.gate.weight' holds NaN or infinite values"),
])
def test_bad_weights_are_refused_in_one_sentence(hf, edit, hf_change, words):
    with pytest.raises(InputError, match=words) as error:
        masters_from_hf(edit(random_moe_state(hf)), cfg_of({**hf, **hf_change}))
    assert "\n" not in str(error.value)


def test_the_qkv_bias_is_counted():
    """--add-qkv-bias adds (nq + 2G) d parameters a layer, in the model, its count and the
    performance model's per-rank elements, and the flag is generated from the field."""
    from npmegatron.perf.memory import layer_parameters
    cfg = GPTConfig(model_family="llama", num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50,
                    group_query_attention=True, num_query_groups=2, add_qkv_bias=True)
    specs = {name: spec.shape for name, _, spec in GPT(cfg).named_specs()}
    assert specs["blocks.0.attn.qkv.bias"] == ((4 + 2 * 2) * 8,) and "blocks.0.attn.proj.bias" not in specs
    assert sum(math.prod(shape) for shape in specs.values()) == gpt_num_parameters(cfg)
    assert gpt_num_parameters(cfg) - gpt_num_parameters(dataclasses.replace(cfg, add_qkv_bias=False)) == 2 * 64
    layer = sum(math.prod(shape) for name, shape in specs.items() if name.startswith("blocks.0."))
    assert layer_parameters(cfg, 1) == layer and layer_parameters(cfg, 2) == layer - (layer - 2 * 32) // 2
    from click.testing import CliRunner
    from npmegatron.cli import main
    assert "--add-qkv-bias" in CliRunner().invoke(main, ["train", "--help"]).output


# ---- 4. multi-rank: --add-qkv-bias at TP 2, and a converted Qwen2-MoE at TP 2 x PP 2 ----------------------

def test_the_qkv_bias_at_tp2_equals_serial(mpirun):
    """The bias's columns are split like the weight's, whole key/value groups on each rank."""
    result = mpirun(2, "ranks/tensor_parallel.py", args=["equals-serial-qkv-bias"], timeout=180)
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["sp"] for r in reports] == [False, True]
    assert all(r["max_rel_error"] < 1e-10 for r in reports)


def test_converted_qwen2_moe_runs_at_tp2_pp2_and_converts_back_out_exactly(tmp_path, mpirun):
    """A Qwen2-MoE folder through `convert --from-hf`, loaded at TP = 2 x PP = 2 (one key/value
    group and half of each q, k, v bias a TP rank), gives the reference's loss, logits and every
    gathered gradient; `convert --to-hf` gives the folder's tensors back bit for bit."""
    from click.testing import CliRunner
    from npmegatron.cli import main
    hf = {**QWEN2_MOE, "num_hidden_layers": 2}
    state = random_moe_state(hf)
    os.makedirs(tmp_path / "in")
    save_file(state, str(tmp_path / "in" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "in" / "config.json").write_text(json.dumps(hf))
    run = CliRunner().invoke(main, ["convert", "--from-hf", str(tmp_path / "in"), "--save", str(tmp_path / "ck")])
    assert run.exit_code == 0, run.output
    tokens = ids_for(hf)
    np.save(tmp_path / "tokens.npy", tokens)
    os.makedirs(tmp_path / "out")
    mpirun(4, "ranks/converted_gpt2.py", args=[tmp_path / "ck", tmp_path / "tokens.npy", tmp_path / "out"], timeout=180)
    cfg = cfg_of(hf)
    grads, logits, loss = assembled_gradients(tmp_path / "out", cfg)
    reference = ReferenceMoE(state, hf)
    reference_loss, reference_logits = reference.loss(tokens[:, :-1], tokens[:, 1:])
    assert relative_error(logits, reference_logits) < 1e-10
    assert abs(loss - reference_loss) < 1e-10 * reference_loss
    reference_grads = reference.gradients()
    for name, grad in masters_to_hf(grads, cfg).items():
        assert gradient_error(grad, reference_grads[name]) < 1e-10, name
    run = CliRunner().invoke(main, ["convert", "--load", str(tmp_path / "ck"), "--to-hf", str(tmp_path / "back")])
    assert run.exit_code == 0, run.output
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(state) and all(np.array_equal(back[k], state[k]) for k in state)


# ---- 5. against transformers' MixtralForCausalLM and Qwen2MoeForCausalLM ----------------------------------

def router_in_its_dtype(self, hidden_states):
    """MixtralTopKRouter's and Qwen2MoeTopKRouter's forward (softmax over all experts, its top k,
    divided by their sum for Mixtral and under norm_topk_prob) without their softmax in float32."""
    import torch
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    top, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, chosen


def as_transformers_parameters(state, names):
    """An HF state as save_pretrained writes it (experts one by one) in the layout of the model's
    own parameters `names`: transformers 5 holds each layer's experts as one gate_up_proj
    (E, 2f, h), gate above up, and one down_proj (E, h, f), and Mixtral's block_sparse_moe as mlp."""
    state = {name.replace(".block_sparse_moe.", ".mlp."): array for name, array in state.items()}
    fused = [name for name in names if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    for name in fused:
        module, kind = name.rsplit(".", 1)
        count = len({key.split(".")[len(module.split("."))] for key in state
                     if key.startswith(module + ".") and key[len(module) + 1].isdigit()})

        def part(e, kinds):
            return next(state[f"{module}.{e}.{k}.weight"] for k in kinds if f"{module}.{e}.{k}.weight" in state)

        state[name] = np.stack([np.concatenate([part(e, ("w1", "gate_proj")), part(e, ("w3", "up_proj"))])
                                if kind == "gate_up_proj" else part(e, ("w2", "down_proj")) for e in range(count)])
    experts = {name.rsplit(".", 1)[0] + "." for name in fused}
    return {name: array for name, array in state.items()
            if not any(name.startswith(module) and name[len(module)].isdigit() for module in experts)}


TRANSFORMERS = {"mixtral": ("Mixtral", dict(intermediate_size=24, num_local_experts=8, num_hidden_layers=2)),
                "qwen2_moe": ("Qwen2Moe", dict(intermediate_size=40, moe_intermediate_size=12, num_experts=8,
                                               shared_expert_intermediate_size=20, num_hidden_layers=3,
                                               mlp_only_layers=[0], norm_topk_prob=False)),
                "qwen2_moe-norm-topk": ("Qwen2Moe", dict(intermediate_size=40, moe_intermediate_size=12, num_experts=8,
                                                         shared_expert_intermediate_size=20, num_hidden_layers=2,
                                                         norm_topk_prob=True))}


def random_transformers_moe(transformers, monkeypatch, variant):
    """(the model class, a random model of it in float64: GQA, untied, the top 2 of 8 experts) for a
    TRANSFORMERS variant, its float32 computations replaced by the same formulas in float64."""
    import importlib

    import torch
    from test_convert_llama import rms_norm_in_its_dtype, rotary_in_float64
    family, (prefix, sizes) = variant.split("-")[0], TRANSFORMERS[variant]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    if not hasattr(modeling, prefix + "TopKRouter"):
        pytest.skip("transformers < 5 routes in float32 inside its sparse MoE block; this test replaces "
                    "transformers 5's TopKRouter")
    monkeypatch.setattr(getattr(modeling, prefix + "RotaryEmbedding"), "forward", rotary_in_float64)
    monkeypatch.setattr(getattr(modeling, prefix + "RMSNorm"), "forward", rms_norm_in_its_dtype)
    monkeypatch.setattr(getattr(modeling, prefix + "TopKRouter"), "forward", router_in_its_dtype)
    torch.manual_seed(0)
    config = getattr(transformers, prefix + "Config")(
        vocab_size=60, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False, initializer_range=0.1,
        num_experts_per_tok=2, router_aux_loss_coef=0.0, attn_implementation="sdpa", experts_implementation="eager",
        **sizes)
    model_class = getattr(transformers, prefix + "ForCausalLM")
    hf_model = model_class(config).to(torch.float64)
    with torch.no_grad():                   # RMSNorm gains away from their 1, biases away from 0
        for name, tensor in hf_model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                tensor.add_(0.3 * torch.randn_like(tensor))
    return model_class, hf_model


@pytest.mark.parametrize("variant", TRANSFORMERS)
def test_transformers_moe_converts_in_and_out_exactly(tmp_path, monkeypatch, variant):
    """MixtralForCausalLM or Qwen2MoeForCausalLM in float64 against the converted model: loss,
    logits and every gradient to 1e-12. transformers computes the rotary angles, RMSNorm and the
    router's softmax in float32, so in float64 those forwards are replaced by the same formulas in
    float64 (test_convert_llama's two, router_in_its_dtype), attention runs on sdpa and the experts
    on their eager loop (grouped_mm takes no float64); the experts, their dispatch, the shared
    expert and its gate, attention and the head are HF's code."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: the HF "
                                       "equivalence runs against the numpy reference only")
    import torch
    model_class, hf_model = random_transformers_moe(transformers, monkeypatch, variant)
    hf_model.save_pretrained(tmp_path / "in")
    hf_config, tensors = read_hf_folder(str(tmp_path / "in"))
    cfg = cfg_of(hf_config)
    assert cfg.num_experts == 8 and cfg.num_query_groups == 2 and cfg.add_qkv_bias == variant.startswith("qwen")
    masters = masters_from_hf(tensors, cfg)

    ids = ids_for(hf_config)
    hf_model.train()
    hf_logits = hf_model(torch.from_numpy(ids[:, :-1])).logits
    hf_loss = torch.nn.functional.cross_entropy(hf_logits.reshape(-1, hf_logits.shape[-1]),
                                                torch.from_numpy(ids[:, 1:]).reshape(-1))
    hf_loss.backward()
    loss, logits, grads = ours_in_hf_layout(hf_config, masters, ids)
    worst = {"logits": relative_error(logits, hf_logits.detach().numpy()),
             "loss": abs(loss - hf_loss.item()) / hf_loss.item()}
    hf_grads = {name: tensor.grad.numpy() for name, tensor in hf_model.named_parameters()}
    grads = as_transformers_parameters(grads, hf_grads)
    assert sorted(grads) == sorted(hf_grads)
    for name, grad in grads.items():
        worst[name] = gradient_error(grad, hf_grads[name])
    print(f"{variant}: logits {worst['logits']:.1e}, loss {worst['loss']:.1e}, every gradient at most "
          f"{max(v for k, v in worst.items() if k not in ('logits', 'loss')):.1e} (relative to its largest entry)")
    assert all(value < 1e-12 for value in worst.values()), worst

    write_hf_folder(str(tmp_path / "out"), config_to_hf(cfg), masters_to_hf(masters, cfg))
    loaded = model_class.from_pretrained(tmp_path / "out", dtype=torch.float64, experts_implementation="eager")
    original, again = hf_model.state_dict(), loaded.state_dict()
    assert sorted(original) == sorted(again)
    assert all(original[k].dtype == again[k].dtype and torch.equal(original[k], again[k]) for k in original)
    with torch.no_grad():                   # config.json read back the same: routing, layers, sizes
        inputs = torch.from_numpy(ids)
        assert relative_error(loaded.eval()(inputs).logits.numpy(), hf_model.eval()(inputs).logits.numpy()) < 1e-12


def test_transformers_balancing_loss_is_k_times_megatrons_for_one_layer():
    """HF's load_balancing_loss_func divides the tokens an expert got by T (ours, Megatron's, by
    k T), so for one MoE layer it is k times ours; over several layers it pools every layer's
    tokens and scores before multiplying, where ours sums each layer's loss (docs/design.md)."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    from npmegatron import autograd as ag
    from npmegatron.moe.router import balancing_loss
    cfg = GPTConfig(model_family="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_experts=8,
                    moe_router_topk=2, dtype="float64")
    logits = [np.random.default_rng(seed).standard_normal((30, 8)) for seed in (0, 1)]
    ours = [float(balancing_loss(ag.Tensor(z), cfg, "aux_loss").data) for z in logits]
    theirs = [float(load_balancing_loss_func((torch.from_numpy(z),), 8, 2)) for z in logits]
    assert np.allclose(theirs, [2 * value for value in ours], rtol=1e-6)     # HF accumulates in float32
    pooled = float(load_balancing_loss_func(tuple(torch.from_numpy(z) for z in logits), 8, 2))
    assert not np.isclose(pooled, 2 * np.mean(ours), rtol=1e-3)
