"""Hugging Face Llama <-> npmegatron (npmegatron/convert.py): a random HF-layout Llama with
grouped-query attention, loaded into the serial GPT, gives the loss, logits and every gradient of
an independent NumPy Llama written with HF's semantics (q_proj, k_proj, v_proj, repeat_kv,
rotate_half) and a backward written by hand, itself held against central differences; weights,
folders and configs round-trip exactly; every refusal is one sentence. With transformers
installed, the same against LlamaForCausalLM itself."""
import json
import math
import os

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from npmegatron.autograd import InputError
from npmegatron.config import GPTConfig
from npmegatron.convert import (config_from_hf, config_to_hf, export_hf, import_hf, llama_name_map,
                                masters_from_hf, masters_to_hf, read_hf_folder, write_hf_folder)
from npmegatron.model import GPT
from npmegatron.module import load_masters
from test_convert import assembled_gradients, relative_error

HF_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
             "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
             "max_position_embeddings": 16, "vocab_size": 100, "rms_norm_eps": 1e-5, "rope_theta": 500.0,
             "hidden_act": "silu", "tie_word_embeddings": False, "attention_dropout": 0.0, "initializer_range": 0.02}
HEAD = "lm_head.weight"


def canonical(name):
    """An HF Llama name as LlamaForCausalLM.save_pretrained spells it."""
    return name if name == HEAD else "model." + name


def random_llama_state(hf=HF_CONFIG, seed=0, prefix="model.", dtype=np.float64):
    """An HF Llama state with every value random (RMSNorm gains near 1, linears scaled by their
    fan-in), lm_head only when untied, so a misplaced row or column changes the logits."""
    rng = np.random.default_rng(seed)
    h, f, vocab, heads = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["num_attention_heads"]
    d, groups = h // heads, hf.get("num_key_value_heads", heads)
    layer = {"input_layernorm": (h,), "self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (groups * d, h),
             "self_attn.v_proj": (groups * d, h), "self_attn.o_proj": (h, heads * d),
             "post_attention_layernorm": (h,), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
    shapes = {"embed_tokens.weight": (vocab, h), "norm.weight": (h,)}
    for i in range(hf["num_hidden_layers"]):
        shapes.update({f"layers.{i}.{name}.weight": shape for name, shape in layer.items()})
    state = {}
    for name, shape in shapes.items():
        values = rng.standard_normal(shape)
        if len(shape) == 1:
            values = 1.0 + 0.3 * values
        else:           # HF's (out, in) linears over their fan-in; the embedding at 0.3
            values = values / math.sqrt(shape[1]) if "_proj" in name else 0.3 * values
        state[prefix + name] = values.astype(dtype)
    if not hf.get("tie_word_embeddings", False):
        state[HEAD] = (0.3 * rng.standard_normal((vocab, h))).astype(dtype)
    return state


# ---- the reference: HF's LlamaForCausalLM in NumPy, forward and a hand-written backward ---------

def rms_norm(x, gain, eps):
    """LlamaRMSNorm: x / sqrt(mean(x^2) + eps) * gain; also 1 / sqrt(...) for the backward."""
    inverse = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return x * inverse * gain, inverse


def rms_norm_backward(dy, x, inverse, gain):
    normed = x * inverse
    dnormed = dy * gain
    dx = inverse * (dnormed - normed * (dnormed * normed).mean(-1, keepdims=True))
    return dx, (dy * normed).reshape(-1, x.shape[-1]).sum(0)


def rotate_half(x):
    """HF's rotate_half: (x1, x2) -> (-x2, x1), channel i paired with channel i + d/2."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


def rotary_tables(hf, t):
    """cos and sin (t, d) as LlamaRotaryEmbedding makes them, in float64: inv_freq =
    1 / base^(arange(0, d, 2) / d), angles repeated over both halves (cat(freqs, freqs))."""
    d = hf["hidden_size"] // hf["num_attention_heads"]
    inv_freq = 1.0 / hf["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.outer(np.arange(t, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], -1)
    return np.cos(angles), np.sin(angles)


def silu(x):
    return x / (1.0 + np.exp(-x))


class ReferenceLlama:
    """LlamaForCausalLM's loss (mean cross-entropy of next tokens) and its gradient with respect
    to every HF tensor, from an HF state; the lm_head is embed_tokens when the state has none."""

    def __init__(self, state, hf):
        self.p = {k.removeprefix("model."): v for k, v in state.items()}
        self.hf, self.eps = hf, hf["rms_norm_eps"]
        self.heads = hf["num_attention_heads"]
        self.groups = hf.get("num_key_value_heads", self.heads)
        self.d = hf["hidden_size"] // self.heads
        self.head = HEAD if HEAD in self.p else "embed_tokens.weight"

    def loss(self, ids, targets):
        """(loss, logits); what the backward needs is kept on self."""
        self.ids, (b, t) = ids, ids.shape
        self.cos, self.sin = rotary_tables(self.hf, t)
        x, self.tape = self.p["embed_tokens.weight"][ids], []
        for i in range(self.hf["num_hidden_layers"]):
            x = x + self._attention(x, f"layers.{i}.")
            x = x + self._mlp(x, f"layers.{i}.")
        self.x, (z, self.inverse) = x, rms_norm(x, self.p["norm.weight"], self.eps)
        self.z, logits = z, z @ self.p[self.head].T
        shifted = logits - logits.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        picked = np.take_along_axis(log_probs, targets[..., None], -1)
        self.dlogits = np.exp(log_probs)               # d mean cross-entropy / d logits: (p - onehot) / n
        np.put_along_axis(self.dlogits, targets[..., None], np.exp(picked) - 1.0, -1)
        self.dlogits /= b * t
        return -picked.mean(), logits

    def _heads(self, y, n):
        b, t, _ = y.shape
        return y.reshape(b, t, n, self.d).transpose(0, 2, 1, 3)

    def _attention(self, x, layer):
        p, r = self.p, self.heads // self.groups
        a, inverse = rms_norm(x, p[layer + "input_layernorm.weight"], self.eps)
        q0 = self._heads(self._projection(a, layer + "self_attn.q_proj"), self.heads)
        k0 = self._heads(self._projection(a, layer + "self_attn.k_proj"), self.groups)
        v = self._heads(self._projection(a, layer + "self_attn.v_proj"), self.groups)
        q, k = (z * self.cos + rotate_half(z) * self.sin for z in (q0, k0))
        k_all, v_all = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)        # repeat_kv: head i uses i // r
        t = x.shape[1]
        scores = np.where(np.tril(np.ones((t, t), bool)), q @ k_all.swapaxes(-1, -2) / math.sqrt(self.d), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        y = (probs @ v_all).transpose(0, 2, 1, 3).reshape(x.shape)
        self.tape.append(dict(x=x, a=a, inverse=inverse, q=q, k_all=k_all, v_all=v_all, probs=probs, y=y))
        return y @ p[layer + "self_attn.o_proj.weight"].T

    def _projection(self, a, name):
        """a W^T, plus the bias where the state has one (Qwen2's q, k and v)."""
        return a @ self.p[name + ".weight"].T + self.p.get(name + ".bias", 0.0)

    def _mlp(self, x, layer):
        p = self.p
        c, inverse = rms_norm(x, p[layer + "post_attention_layernorm.weight"], self.eps)
        gate, up = c @ p[layer + "mlp.gate_proj.weight"].T, c @ p[layer + "mlp.up_proj.weight"].T
        self.tape.append(dict(x=x, c=c, inverse=inverse, gate=gate, up=up))
        return (silu(gate) * up) @ p[layer + "mlp.down_proj.weight"].T

    def gradients(self):
        """{canonical HF name: d loss / d tensor} after loss()."""
        p, grads, flat = self.p, {}, lambda z: z.reshape(-1, z.shape[-1])
        grads[self.head] = flat(self.dlogits).T @ flat(self.z)
        dx, grads["norm.weight"] = rms_norm_backward(self.dlogits @ p[self.head], self.x, self.inverse,
                                                     p["norm.weight"])
        for i in reversed(range(self.hf["num_hidden_layers"])):
            dx = dx + self._mlp_backward(dx, self.tape[2 * i + 1], f"layers.{i}.", grads)
            dx = dx + self._attention_backward(dx, self.tape[2 * i], f"layers.{i}.", grads)
        embedding = np.zeros_like(p["embed_tokens.weight"])
        np.add.at(embedding, self.ids, dx)
        grads["embed_tokens.weight"] = grads.get("embed_tokens.weight", 0) + embedding   # tied: both uses
        return {canonical(name): grad for name, grad in grads.items()}

    def _mlp_backward(self, dout, s, layer, grads):
        """d loss / d x through the MLP branch (the residual's own dout is added by the caller)."""
        p, flat = self.p, lambda z: z.reshape(-1, z.shape[-1])
        sigmoid = 1.0 / (1.0 + np.exp(-s["gate"]))
        swiglu = silu(s["gate"]) * s["up"]
        grads[layer + "mlp.down_proj.weight"] = flat(dout).T @ flat(swiglu)
        dswiglu = dout @ p[layer + "mlp.down_proj.weight"]
        dgate = dswiglu * s["up"] * sigmoid * (1.0 + s["gate"] * (1.0 - sigmoid))
        dup = dswiglu * silu(s["gate"])
        grads[layer + "mlp.gate_proj.weight"] = flat(dgate).T @ flat(s["c"])
        grads[layer + "mlp.up_proj.weight"] = flat(dup).T @ flat(s["c"])
        dc = dgate @ p[layer + "mlp.gate_proj.weight"] + dup @ p[layer + "mlp.up_proj.weight"]
        dx, grads[layer + "post_attention_layernorm.weight"] = rms_norm_backward(
            dc, s["x"], s["inverse"], p[layer + "post_attention_layernorm.weight"])
        return dx

    def _attention_backward(self, dout, s, layer, grads):
        """d loss / d x through the attention branch."""
        p, flat, r = self.p, lambda z: z.reshape(-1, z.shape[-1]), self.heads // self.groups
        b, t, _ = dout.shape
        grads[layer + "self_attn.o_proj.weight"] = flat(dout).T @ flat(s["y"])
        dy = self._heads(dout @ p[layer + "self_attn.o_proj.weight"], self.heads)
        dprobs = dy @ s["v_all"].swapaxes(-1, -2)
        dv_all = s["probs"].swapaxes(-1, -2) @ dy
        dscores = s["probs"] * (dprobs - (dprobs * s["probs"]).sum(-1, keepdims=True)) / math.sqrt(self.d)
        dq, dk_all = dscores @ s["k_all"], dscores.swapaxes(-1, -2) @ s["q"]
        summed = lambda z: z.reshape(b, self.groups, r, t, self.d).sum(2)   # noqa: E731  repeat_kv's adjoint
        dk, dv = summed(dk_all), summed(dv_all)
        dq0, dk0 = (z * self.cos - rotate_half(z * self.sin) for z in (dq, dk))   # rotate_half^T = -rotate_half
        da = 0
        for name, dz in (("q_proj", dq0), ("k_proj", dk0), ("v_proj", dv)):
            dz = dz.transpose(0, 2, 1, 3).reshape(b, t, -1)
            grads[layer + f"self_attn.{name}.weight"] = flat(dz).T @ flat(s["a"])
            if layer + f"self_attn.{name}.bias" in p:
                grads[layer + f"self_attn.{name}.bias"] = flat(dz).sum(0)
            da = da + dz @ p[layer + f"self_attn.{name}.weight"]
        dx, grads[layer + "input_layernorm.weight"] = rms_norm_backward(
            da, s["x"], s["inverse"], p[layer + "input_layernorm.weight"])
        return dx


# ---- our model from the same state ---------------------------------------------------------------

def model_for(hf, masters):
    cfg = GPTConfig(**{**config_from_hf(hf), "dtype": "float64", "hidden_dropout": 0.0, "attention_dropout": 0.0})
    model = GPT(cfg)
    load_masters(model, masters)
    return model


def ours_in_hf_layout(hf, masters, ids):
    """(loss, logits, {canonical HF name: gradient}) of our serial GPT on next-token targets, the
    gradients taken back to HF's layout by masters_to_hf."""
    model = model_for(hf, masters)
    model.train()
    logits, loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    grads = {name: param.grad[tuple(slice(0, n) for n in spec.shape)] for name, param, spec in model.named_specs()}
    return float(loss.data), model.full_logits(logits), masters_to_hf(grads, model.cfg)


def ids_for(hf, b=2, t=16, seed=1):
    return np.random.default_rng(seed).integers(0, hf["vocab_size"], (b, t))


def cfg_of(hf):
    return GPTConfig(**config_from_hf(hf))


# ---- 1. loss, logits and every gradient equal the reference ---------------------------------------

VARIANTS = {"gqa-untied": {}, "plain-tied": {"num_key_value_heads": 8, "tie_word_embeddings": True},
            "one-kv-head-no-prefix": {"num_key_value_heads": 1}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_logits_and_every_gradient_equal_the_hf_reference(variant):
    hf = {**HF_CONFIG, **VARIANTS[variant]}
    state = random_llama_state(hf, prefix="" if "no-prefix" in variant else "model.")
    ids = ids_for(hf)
    reference = ReferenceLlama(state, hf)
    reference_loss, reference_logits = reference.loss(ids[:, :-1], ids[:, 1:])
    reference_grads = reference.gradients()
    loss, logits, grads = ours_in_hf_layout(hf, masters_from_hf(state, cfg_of(hf)), ids)
    assert relative_error(logits, reference_logits) < 1e-9
    assert abs(loss - reference_loss) < 1e-9 * reference_loss
    assert sorted(grads) == sorted(canonical(k.removeprefix("model.")) for k in state)
    for name, grad in grads.items():
        assert relative_error(grad, reference_grads[name]) < 1e-9, name


@pytest.mark.parametrize("variant", ["gqa-untied", "plain-tied"])
def test_the_references_backward_is_its_forwards_derivative(variant):
    """Central differences of the reference's loss on random entries of every HF tensor, so the
    hand-written backward the model is held against is itself right."""
    hf = {**HF_CONFIG, **VARIANTS[variant]}
    assert_backward_is_the_derivative(ReferenceLlama, random_llama_state(hf), hf, ids_for(hf, t=8), entries=3)


def assert_backward_is_the_derivative(reference_class, state, hf, ids, entries):
    """A reference's hand-written gradients against central differences of its loss, on `entries`
    random entries of every tensor of `state`."""
    reference = reference_class(state, hf)
    reference.loss(ids[:, :-1], ids[:, 1:])
    grads, rng, step = reference.gradients(), np.random.default_rng(2), 1e-6
    for name, array in state.items():
        for index in zip(*(rng.integers(0, n, entries) for n in array.shape)):
            values = []
            for sign in (1, -1):
                moved = {**state, name: array.copy()}
                moved[name][index] += sign * step
                values.append(reference_class(moved, hf).loss(ids[:, :-1], ids[:, 1:])[0])
            difference = (values[0] - values[1]) / (2 * step)
            assert abs(difference - grads[name][index]) < 1e-8 + 1e-6 * abs(grads[name][index]), (name, index)


# ---- 2. the QKV regrouping matters -----------------------------------------------------------------

def test_a_plain_copy_without_the_qkv_regrouping_gives_other_logits():
    """q_proj, k_proj, v_proj stacked in HF's order (all q, all k, all v) has the right shape, so
    only the logits show that the columns were regrouped by key/value group."""
    state, cfg = random_llama_state(), cfg_of(HF_CONFIG)
    masters = masters_from_hf(state, cfg)
    plain = dict(masters)
    for hf_names, ours, _ in llama_name_map(cfg):
        if len(hf_names) == 3:
            plain[ours] = np.concatenate([state["model." + name] for name in hf_names]).T
            assert plain[ours].shape == masters[ours].shape and not np.array_equal(plain[ours], masters[ours])
    ids = ids_for(HF_CONFIG)
    reference = ReferenceLlama(state, HF_CONFIG).loss(ids[:, :-1], ids[:, 1:])[1]
    assert relative_error(ours_in_hf_layout(HF_CONFIG, plain, ids)[1], reference) > 1e-2


# ---- 3. weights and folders round-trip exactly --------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("tied", [False, True])
def test_weights_round_trip_exactly(dtype, tied):
    hf = {**HF_CONFIG, "tie_word_embeddings": tied}
    state, cfg = random_llama_state(hf, dtype=dtype), cfg_of(hf)
    masters = masters_from_hf(state, cfg)
    assert sorted(masters) == sorted(name for name, _, _ in GPT(cfg).named_specs())
    assert all(a.dtype == dtype and a.flags.c_contiguous for a in masters.values())
    back = masters_to_hf(masters, cfg)
    assert sorted(back) == sorted(state) and (HEAD in back) != tied
    assert all(back[k].dtype == dtype and np.array_equal(back[k], state[k]) for k in state)


def test_rotary_buffers_and_a_tied_head_equal_to_the_embedding_are_accepted():
    """Older transformers saved rotary_emb.inv_freq; a tied model's full state dict has lm_head."""
    hf = {**HF_CONFIG, "tie_word_embeddings": True}
    state, cfg = random_llama_state(hf), cfg_of(hf)
    extra = {HEAD: state["model.embed_tokens.weight"].copy(),
             "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32),
             "model.rotary_emb.inv_freq": np.ones(4, np.float32)}
    masters = masters_from_hf({**state, **extra}, cfg)
    assert all(np.array_equal(masters[k], v) for k, v in masters_from_hf(state, cfg).items())


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_folder_round_trip_through_a_checkpoint(tmp_path, dtype):
    """write_hf_folder -> import_hf (a checkpoint) -> export_hf: the same tensors, bit for bit,
    with "model." names and lm_head, in the dtype they came in."""
    state = random_llama_state(dtype=dtype)
    write_hf_folder(str(tmp_path / "in"), HF_CONFIG, state)
    hf, tensors = read_hf_folder(str(tmp_path / "in"))
    assert hf == HF_CONFIG and all(np.array_equal(tensors[k], state[k]) for k in state)
    import_hf(str(tmp_path / "in"), str(tmp_path / "ck"))
    export_hf(str(tmp_path / "ck"), str(tmp_path / "out"))
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(back) == sorted(state)
    assert all(back[k].dtype == dtype and np.array_equal(back[k], state[k]) for k in state)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as file:
        assert file.metadata() == {"format": "pt"}
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["torch_dtype"] == np.dtype(dtype).name
    assert config_from_hf(written) == config_from_hf(HF_CONFIG)
    assert written["bos_token_id"] is None and written["eos_token_id"] is None    # no tokenizer: unknown


@pytest.mark.parametrize("bos, eos", [("<s>", "</s>"), ("<|begin_of_text|>", "<|end_of_text|>")])
def test_exported_token_ids_are_the_tokenizers(tmp_path, bos, eos):
    """Llama 2's or Llama 3's special tokens, found in the tokenizer.json that travelled with the
    checkpoint, become config.json's bos and eos ids."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1, bos: 5, eos: 7},
                                                                 unk_token="<unk>"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    write_hf_folder(str(tmp_path / "in"), HF_CONFIG, random_llama_state(), str(tmp_path / "tokenizer.json"))
    import_hf(str(tmp_path / "in"), str(tmp_path / "ck"))
    export_hf(str(tmp_path / "ck"), str(tmp_path / "out"))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (5, 7)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (tmp_path / "tokenizer.json").read_text()


# ---- 4. configurations: round trip, defaults, refusals --------------------------------------------------

@pytest.mark.parametrize("groups, untied", [(2, True), (6, False)])
def test_config_round_trips(groups, untied):
    cfg = GPTConfig(model_family="llama", num_layers=3, hidden_size=48, num_attention_heads=6,
                    group_query_attention=groups < 6, num_query_groups=groups, vocab_size=300,
                    max_position_embeddings=64, ffn_hidden_size=100, hidden_dropout=0.0, attention_dropout=0.1,
                    layernorm_epsilon=1e-6, init_method_std=0.01, rotary_base=500000.0,
                    untie_embeddings_and_output_weights=untied)
    hf = config_to_hf(cfg)
    again = GPTConfig(**{**config_from_hf(hf), "dtype": cfg.dtype})
    assert again == cfg
    assert config_to_hf(again) == hf and json.loads(json.dumps(hf)) == hf
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert (hf["num_key_value_heads"], hf["head_dim"], hf["tie_word_embeddings"]) == (groups, 8, not untied)
    assert hf["rope_theta"] == hf["rope_parameters"]["rope_theta"] == 500000.0    # transformers 4 and 5
    assert config_to_hf(cfg, bos_token_id=1, eos_token_id=2)["eos_token_id"] == 2


def test_config_defaults_are_llamaconfigs():
    kwargs = config_from_hf({"model_type": "llama"})
    assert kwargs == {"model_family": "llama", "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                      "group_query_attention": False, "num_query_groups": 32, "vocab_size": 32000,
                      "max_position_embeddings": 2048, "ffn_hidden_size": 11008, "rotary_base": 10000.0,
                      "rotary_percent": 1.0, "untie_embeddings_and_output_weights": True, "hidden_dropout": 0.0,
                      "attention_dropout": 0.0, "layernorm_epsilon": 1e-6, "init_method_std": 0.02}
    assert GPTConfig(**kwargs).head_dim == 128


def test_transformers_5_rope_parameters_are_read():
    """transformers 5 writes rope_parameters instead of rope_theta (and reads either)."""
    rope = {"rope_type": "default", "rope_theta": 123.0}
    without = {k: v for k, v in HF_CONFIG.items() if k != "rope_theta"}
    assert config_from_hf({**without, "rope_parameters": rope})["rotary_base"] == 123.0
    assert config_from_hf({**without, "rope_parameters": {"rope_type": "default"}})["rotary_base"] == 10000.0
    assert config_from_hf({**HF_CONFIG, "rope_parameters": {"rope_theta": 500}})["rotary_base"] == 500.0


@pytest.mark.parametrize("change, words", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'; npmegatron supports only \"silu\""),
    ({"attention_bias": True}, "attention_bias True; npmegatron supports only false"),
    ({"mlp_bias": True}, "mlp_bias True; npmegatron supports only false"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling \\{.*; npmegatron supports only null"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
     "rope_type 'yarn'; npmegatron supports only 'default'"),
    ({"rope_parameters": {"rope_type": "default", "factor": 2.0}}, "rope_parameters has 'factor'"),
    ({"rope_parameters": "default"}, "rope_parameters 'default'; it must be an object"),
    ({"rope_parameters": {"rope_theta": 1e4}}, "rope_theta 500.0 but rope_parameters' rope_theta 10000.0"),
    ({"pretraining_tp": 2}, "pretraining_tp 2; npmegatron supports only 1 \\(set it to 1"),
    ({"head_dim": 16}, "head_dim 16, but npmegatron's heads are hidden_size / num_attention_heads = 8 channels"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3, which does not divide num_attention_heads 8"),
    ({"num_attention_heads": 7}, "num_attention_heads 7, which does not divide hidden_size 64"),
    ({"num_hidden_layers": 0}, "num_hidden_layers 0; it must be a positive integer"),
    ({"intermediate_size": 40.0}, "intermediate_size 40.0; it must be a positive integer"),
    ({"max_position_embeddings": 2 ** 30}, "max_position_embeddings 1073741824; .* at most 2\\^24"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings 'false'; it must be true or false"),
    ({"rms_norm_eps": 0}, "rms_norm_eps 0; it must be a positive finite number"),
    ({"rope_theta": "1e4"}, "rope_theta '1e4'; it must be a positive finite number"),
    ({"attention_dropout": 1.0}, "attention_dropout 1.0; it must be a number in \\[0, 1\\)"),
    ({"model_type": "mistral"}, "model_type 'mistral'; only 'gpt2' .*, 'llama' \\(LlamaModel, LlamaForCausalLM\\)"),
])
def test_unsupported_configs_are_refused_in_one_sentence(change, words):
    with pytest.raises(InputError, match=words) as error:
        config_from_hf({**HF_CONFIG, **change})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("parts, words", [
    ({"model_family": "llama", "rotary_percent": 0.5},
     "rotary_percent 0.5, but Hugging Face's LlamaForCausalLM has 1.0"),
    ({"swiglu": True}, "swiglu True, but Hugging Face's GPT2LMHeadModel has False"),
    ({"model_family": "llama", "normalization": "LayerNorm"}, "normalization 'LayerNorm'"),
])
def test_models_of_mixed_parts_are_not_written_as_either(parts, words):
    with pytest.raises(InputError, match=words) as error:
        config_to_hf(GPTConfig(num_attention_heads=4, hidden_size=32, **parts))
    assert "\n" not in str(error.value)


def without(state, key):
    return {k: v for k, v in state.items() if k != key}


@pytest.mark.parametrize("edit, hf_change, words", [
    (lambda s: without(s, "model.layers.1.self_attn.k_proj.weight"), {},
     "has no tensor 'layers.1.self_attn.k_proj.weight' \\(shape \\(32, 64\\)\\); it does not hold a Llama"),
    (lambda s: without(s, HEAD), {}, "has no tensor 'lm_head.weight' \\(shape \\(100, 64\\)\\)"),
    (lambda s: {**s, "model.norm.weight": s["model.norm.weight"][:-1]}, {},
     "tensor 'model.norm.weight' has shape \\(63,\\), but the configuration needs \\(64,\\)"),
    (lambda s: {**s, "model.layers.0.self_attn.o_proj.weight": s["model.layers.0.self_attn.o_proj.weight"][:, :-1]},
     {}, "'model.layers.0.self_attn.o_proj.weight' has shape \\(64, 63\\), but the configuration needs \\(64, 64\\)"),
    (lambda s: {**s, "model.layers.0.mlp.fc.weight": np.ones((4, 4))}, {},
     "unexpected tensor 'model.layers.0.mlp.fc.weight'; only Llama's own tensors"),
    (lambda s: {**s, "norm.weight": s["model.norm.weight"]}, {}, "holds 'norm.weight' twice"),
    (lambda s: {**s, HEAD: s["model.embed_tokens.weight"] + 1}, {"tie_word_embeddings": True},
     "lm_head.weight differs from embed_tokens.weight; config.json's tie_word_embeddings is true"),
    (lambda s: s, {"num_hidden_layers": 3}, "num_hidden_layers 3, but the weights' layers are layers.0, layers.1"),
    (lambda s: s, {"num_key_value_heads": 2}, "num_key_value_heads x head_dim \\(2 x 8\\) 16, but tensor "
     "'model.layers.0.self_attn.k_proj.weight' has shape \\(32, 64\\)"),
    (lambda s: s, {"intermediate_size": 48}, "intermediate_size 48, but tensor 'model.layers.0.mlp.gate_proj.weight'"),
    (lambda s: {**s, "model.norm.weight": np.full(64, np.nan)}, {}, "'model.norm.weight' holds NaN"),
])
def test_bad_weights_are_refused_in_one_sentence(edit, hf_change, words):
    hf = {**HF_CONFIG, **hf_change}
    state = random_llama_state()
    if hf.get("tie_word_embeddings"):
        state = without(state, HEAD)
    with pytest.raises(InputError, match=words) as error:
        masters_from_hf(edit(state), cfg_of(hf))
    assert "\n" not in str(error.value)


# ---- multi-rank: converted in, run at TP 2 x PP 2, converted back out -------------------------------------

def test_converted_in_it_runs_at_tp2_pp2_and_converts_back_out_exactly(tmp_path, mpirun):
    """A Llama folder through `convert --from-hf`, loaded at TP = 2 x PP = 2 (two key/value groups
    a TP rank), gives the reference's loss, logits and (gathered) every gradient; `convert
    --to-hf` gives the folder's tensors back bit for bit."""
    from click.testing import CliRunner
    from npmegatron.cli import main
    state = random_llama_state()
    os.makedirs(tmp_path / "in")
    save_file(state, str(tmp_path / "in" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "in" / "config.json").write_text(json.dumps(HF_CONFIG))
    run = CliRunner().invoke(main, ["convert", "--from-hf", str(tmp_path / "in"), "--save", str(tmp_path / "ck")])
    assert run.exit_code == 0, run.output
    tokens = ids_for(HF_CONFIG)
    np.save(tmp_path / "tokens.npy", tokens)
    os.makedirs(tmp_path / "out")
    mpirun(4, "ranks/converted_gpt2.py", args=[tmp_path / "ck", tmp_path / "tokens.npy", tmp_path / "out"], timeout=120)
    cfg = GPTConfig(**{**config_from_hf(HF_CONFIG), "dtype": "float64"})
    grads, logits, loss = assembled_gradients(tmp_path / "out", cfg)

    reference = ReferenceLlama(state, HF_CONFIG)
    reference_loss, reference_logits = reference.loss(tokens[:, :-1], tokens[:, 1:])
    assert relative_error(logits, reference_logits) < 1e-9
    assert abs(loss - reference_loss) < 1e-9 * reference_loss
    reference_grads = reference.gradients()
    for name, grad in masters_to_hf(grads, cfg).items():
        assert relative_error(grad, reference_grads[name]) < 1e-9, name

    run = CliRunner().invoke(main, ["convert", "--load", str(tmp_path / "ck"), "--to-hf", str(tmp_path / "back")])
    assert run.exit_code == 0, run.output
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(state)
    assert all(back[k].dtype == state[k].dtype and np.array_equal(back[k], state[k]) for k in state)


# ---- 5. against transformers' LlamaForCausalLM itself ------------------------------------------------

def rotary_in_float64(self, x, position_ids):
    """LlamaRotaryEmbedding.forward's formula (inv_freq = 1 / base^(arange(0, d, 2) / d), angles
    cat(freqs, freqs)) in float64: transformers computes it in float32 whatever the model's dtype."""
    config = self.config
    base = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    import torch
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    angles = position_ids[..., None].to(torch.float64) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def rms_norm_in_its_dtype(self, hidden_states):
    """LlamaRMSNorm.forward without its cast to float32 (which, for float64 input, rounds)."""
    import torch
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def test_transformers_llama_converts_in_and_out_exactly(tmp_path, monkeypatch):
    """LlamaForCausalLM in float64 against the converted model: loss, logits and every gradient
    to 1e-9. transformers computes the rotary angles in float32 (LlamaRotaryEmbedding.forward) and
    LlamaRMSNorm in float32, and eager attention takes its softmax in float32, so in float64 those
    two forwards are replaced by the same formulas in float64 and attention runs on sdpa;
    everything else (q/k/v/o, repeat_kv, rotate_half, SwiGLU, the head) is HF's own code."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: the HF "
                                       "equivalence runs against the numpy reference only")
    import torch
    from transformers.models.llama import modeling_llama
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", rotary_in_float64)
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_its_dtype)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=40, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=500.0,
        tie_word_embeddings=False, initializer_range=0.1, attn_implementation="sdpa")
    hf_model = transformers.LlamaForCausalLM(config).to(torch.float64)
    with torch.no_grad():                   # RMSNorm gains away from their 1
        for name, tensor in hf_model.named_parameters():
            if "norm" in name:
                tensor.add_(0.3 * torch.randn_like(tensor))
    hf_model.save_pretrained(tmp_path / "in")
    hf_config, tensors = read_hf_folder(str(tmp_path / "in"))
    cfg = GPTConfig(**{**config_from_hf(hf_config), "dtype": "float64"})
    assert cfg.group_query_attention and cfg.num_query_groups == 4 and cfg.rotary_base == 500.0
    masters = masters_from_hf(tensors, cfg)

    # HF's own labels= loss runs in float32 (it casts the logits), so the float64 cross-entropy of
    # its float64 logits is taken here.
    ids = ids_for(hf_config)
    hf_model.train()
    hf_logits = hf_model(torch.from_numpy(ids[:, :-1])).logits
    hf_loss = torch.nn.functional.cross_entropy(hf_logits.reshape(-1, hf_logits.shape[-1]),
                                                torch.from_numpy(ids[:, 1:]).reshape(-1))
    hf_loss.backward()
    loss, logits, grads = ours_in_hf_layout(hf_config, masters, ids)
    assert relative_error(logits, hf_logits.detach().numpy()) < 1e-9
    assert abs(loss - hf_loss.item()) < 1e-9 * hf_loss.item()
    hf_grads = {name: tensor.grad.numpy() for name, tensor in hf_model.named_parameters()}
    assert sorted(grads) == sorted(hf_grads)
    for name, grad in grads.items():
        assert relative_error(grad, hf_grads[name]) < 1e-9, name

    write_hf_folder(str(tmp_path / "out"), config_to_hf(cfg), masters_to_hf(masters, cfg))
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    original, again = hf_model.state_dict(), loaded.state_dict()
    assert sorted(original) == sorted(again)
    assert all(original[k].dtype == again[k].dtype and torch.equal(original[k], again[k]) for k in original)
    with torch.no_grad():                   # config.json read back the same: rope_theta, eps, heads
        inputs = torch.from_numpy(ids)
        assert relative_error(loaded.eval()(inputs).logits.numpy(), hf_model.eval()(inputs).logits.numpy()) < 1e-12
