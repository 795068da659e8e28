"""Hugging Face GPT-2 <-> npmegatron (npmegatron/hf.py): a random HF-layout GPT-2 loaded into the
serial GPT gives the logits of an independent NumPy forward written with HF's semantics (its
(3, heads, d) QKV order included); weights and configs round-trip exactly; every refusal is
one sentence. With transformers installed, the same against GPT2LMHeadModel itself."""
import json
import math
import os

import numpy as np
import pytest
from safetensors import safe_open
from scipy.special import erf

from npmegatron.autograd import InputError
from npmegatron.config import GPTConfig
from npmegatron.convert import (config_from_hf, config_to_hf, masters_from_hf, masters_to_hf, name_map,
                           read_hf_folder, write_hf_folder)
from npmegatron.model import GPT
from npmegatron.module import load_masters

HF_CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 2,
             "n_head": 4, "n_positions": 16, "vocab_size": 100, "n_inner": None,
             "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.1,
             "embd_pdrop": 0.1, "attn_pdrop": 0.1, "initializer_range": 0.02}


def random_hf_state(hf=HF_CONFIG, seed=0, prefix="transformer.", dtype=np.float64):
    """An HF GPT-2 state with every value random (LayerNorm gains near 1, biases non-zero), so
    a misplaced column changes the logits."""
    rng = np.random.default_rng(seed)
    h, f, n = hf["n_embd"], hf["n_inner"] or 4 * hf["n_embd"], rng.standard_normal
    shapes = {"wte.weight": (hf["vocab_size"], h), "wpe.weight": (hf["n_positions"], h),
              "ln_f.weight": (h,), "ln_f.bias": (h,)}
    for i in range(hf["n_layer"]):
        shapes.update({f"h.{i}.ln_1.weight": (h,), f"h.{i}.ln_1.bias": (h,),
                       f"h.{i}.attn.c_attn.weight": (h, 3 * h), f"h.{i}.attn.c_attn.bias": (3 * h,),
                       f"h.{i}.attn.c_proj.weight": (h, h), f"h.{i}.attn.c_proj.bias": (h,),
                       f"h.{i}.ln_2.weight": (h,), f"h.{i}.ln_2.bias": (h,),
                       f"h.{i}.mlp.c_fc.weight": (h, f), f"h.{i}.mlp.c_fc.bias": (f,),
                       f"h.{i}.mlp.c_proj.weight": (f, h), f"h.{i}.mlp.c_proj.bias": (h,)})
    state = {}
    for name, shape in shapes.items():
        gain = name.endswith(".weight") and len(shape) == 1
        state[prefix + name] = ((1.0 if gain else 0.0) + 0.3 * n(shape)).astype(dtype)
    return state


def hf_reference_logits(state, hf, ids):
    """GPT-2 forward with HF's semantics in NumPy: Conv1D x @ W + b, c_attn split as (3, heads, d),
    causal softmax(q k^T / sqrt(d)), gelu_new (or exact gelu), pre-LN blocks, ln_f, logits h @ wte^T."""
    p = {k.removeprefix("transformer."): v for k, v in state.items()}
    heads, eps = hf["n_head"], hf["layer_norm_epsilon"]

    def ln(x, name):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * p[name + ".weight"] + p[name + ".bias"]

    def conv1d(x, name):
        return x @ p[name + ".weight"] + p[name + ".bias"]

    def gelu(x):
        if hf["activation_function"] == "gelu":          # HF's exact GeLU
            return 0.5 * x * (1 + erf(x / math.sqrt(2)))
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))   # gelu_new

    b, t = ids.shape
    x = p["wte.weight"][ids] + p["wpe.weight"][:t]
    causal = np.tril(np.ones((t, t), dtype=bool))
    for i in range(hf["n_layer"]):
        q, k, v = np.split(conv1d(ln(x, f"h.{i}.ln_1"), f"h.{i}.attn.c_attn"), 3, axis=-1)
        q, k, v = (z.reshape(b, t, heads, -1).transpose(0, 2, 1, 3) for z in (q, k, v))
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        y = (probs / probs.sum(-1, keepdims=True)) @ v
        x = x + conv1d(y.transpose(0, 2, 1, 3).reshape(b, t, -1), f"h.{i}.attn.c_proj")
        x = x + conv1d(gelu(conv1d(ln(x, f"h.{i}.ln_2"), f"h.{i}.mlp.c_fc")), f"h.{i}.mlp.c_proj")
    return ln(x, "ln_f") @ p["wte.weight"].T


def model_for(hf, masters):
    cfg = GPTConfig(**{**config_from_hf(hf), "dtype": "float64", "hidden_dropout": 0.0,
                       "attention_dropout": 0.0})
    model = GPT(cfg)
    model.eval()
    load_masters(model, masters)
    return model


def our_logits(model, ids):
    logits, _ = model(ids)
    return model.full_logits(logits)


def relative_error(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


def ids_for(hf, b=2, t=16, seed=1):
    return np.random.default_rng(seed).integers(0, hf["vocab_size"], (b, t))


def test_name_map_is_the_models_parameters():
    cfg = GPTConfig(**config_from_hf(HF_CONFIG))
    assert [(ours, shape) for _, ours, shape in name_map(cfg)] == \
        [(name, spec.shape) for name, _, spec in GPT(cfg).named_specs()]


@pytest.mark.parametrize("prefix, activation", [("transformer.", "gelu_new"), ("", "gelu_new"),
                                                ("transformer.", "gelu")])
def test_logits_equal_the_hf_reference(prefix, activation):
    hf = {**HF_CONFIG, "activation_function": activation}
    state = random_hf_state(prefix=prefix)
    ids = ids_for(hf)
    cfg = GPTConfig(**config_from_hf(hf))
    model = model_for(hf, masters_from_hf(state, cfg))
    reference = hf_reference_logits(state, hf, ids)
    assert reference.shape == (2, 16, 100)
    assert relative_error(our_logits(model, ids), reference) < 1e-10


def test_buffers_and_a_tied_lm_head_are_accepted():
    """GPT2LMHeadModel's full state dict (and old transformers' files) hold these."""
    state = random_hf_state()
    cfg = GPTConfig(**config_from_hf(HF_CONFIG))
    extra = {"lm_head.weight": state["transformer.wte.weight"].copy(),
             "transformer.h.0.attn.bias": np.tril(np.ones((1, 1, 16, 16))),
             "transformer.h.1.attn.masked_bias": np.array(-1e4)}
    masters = masters_from_hf({**state, **extra}, cfg)
    assert all(np.array_equal(masters[k], v) for k, v in masters_from_hf(state, cfg).items())


def test_a_plain_copy_without_the_qkv_permutation_gives_other_logits():
    """The shapes agree either way: only the logits show that the QKV columns were reordered."""
    state = random_hf_state()
    ids = ids_for(HF_CONFIG)
    cfg = GPTConfig(**config_from_hf(HF_CONFIG))
    plain = {ours: state["transformer." + hf] for hf, ours, _ in name_map(cfg)}
    masters = masters_from_hf(state, cfg)
    assert any(not np.array_equal(plain[k], masters[k]) for k in plain if ".qkv." in k)
    reference = hf_reference_logits(state, HF_CONFIG, ids)
    assert relative_error(our_logits(model_for(HF_CONFIG, plain), ids), reference) > 1e-2


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_weights_round_trip_exactly(dtype):
    state = random_hf_state(dtype=dtype)
    cfg = GPTConfig(**config_from_hf(HF_CONFIG))
    masters = masters_from_hf(state, cfg)
    assert all(a.dtype == dtype for a in masters.values())
    back = masters_to_hf(masters, cfg)
    assert sorted(back) == sorted(state)
    assert all(back[k].dtype == dtype and np.array_equal(back[k], state[k]) for k in state)


def test_config_round_trips():
    cfg = GPTConfig(num_layers=3, hidden_size=48, num_attention_heads=6, vocab_size=300,
                    max_position_embeddings=64, ffn_hidden_size=100, hidden_dropout=0.05,
                    attention_dropout=0.2, layernorm_epsilon=1e-6, init_method_std=0.01, gelu="none")
    hf = config_to_hf(cfg)
    again = GPTConfig(**{**config_from_hf(hf), "dtype": cfg.dtype})
    assert again == cfg
    assert config_to_hf(again) == hf
    assert json.loads(json.dumps(hf)) == hf
    assert hf["architectures"] == ["GPT2LMHeadModel"] and hf["activation_function"] == "gelu"
    assert hf["bos_token_id"] is None and hf["eos_token_id"] is None     # 50256 is not in 300 tokens
    assert "eos_token_id" not in config_to_hf(GPTConfig(vocab_size=50257))
    assert config_to_hf(cfg, bos_token_id=0, eos_token_id=1)["eos_token_id"] == 1


def test_config_defaults_aliases_and_the_dropout_rule():
    sparse = {"model_type": "gpt2", "n_ctx": 32, "activation_function": "gelu_pytorch_tanh",
              "resid_pdrop": 0.2, "embd_pdrop": 0.0, "reorder_and_upcast_attn": True}
    kwargs = config_from_hf(sparse)
    assert kwargs == {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                      "vocab_size": 50257, "max_position_embeddings": 32, "ffn_hidden_size": 3072,
                      "hidden_dropout": 0.2, "attention_dropout": 0.1, "layernorm_epsilon": 1e-5,
                      "init_method_std": 0.02, "gelu": "tanh"}
    assert config_from_hf({**HF_CONFIG, "activation_function": "gelu"})["gelu"] == "none"
    assert config_from_hf({**HF_CONFIG, "n_ctx": 8})["max_position_embeddings"] == 16


@pytest.mark.parametrize("change, words", [
    ({"activation_function": "relu"}, "activation_function 'relu'; npmegatron supports 'gelu_new'"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings False; npmegatron supports only true"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx True; npmegatron supports only false"),
    ({"scale_attn_weights": False}, "scale_attn_weights False"),
    ({"add_cross_attention": True}, "add_cross_attention True"),
    ({"model_type": "gpt_neo"}, "model_type 'gpt_neo'; only 'gpt2'"),
    ({"n_embd": 32.0}, "n_embd 32.0; it must be a positive integer"),
])
def test_unsupported_configs_are_refused_in_one_sentence(change, words):
    with pytest.raises(InputError, match=words) as error:
        config_from_hf({**HF_CONFIG, **change})
    assert "\n" not in str(error.value)


def without(state, key):
    return {k: v for k, v in state.items() if k != key}


def reshaped(state, key):
    return {**state, key: state[key][:, :-1]}


@pytest.mark.parametrize("edit, words", [
    (lambda s: without(s, "transformer.h.1.mlp.c_fc.bias"), "has no tensor 'h.1.mlp.c_fc.bias' \\(shape \\(128,\\)\\)"),
    (lambda s: reshaped(s, "transformer.h.0.attn.c_attn.weight"),
     "tensor 'transformer.h.0.attn.c_attn.weight' has shape \\(32, 95\\), but the configuration needs \\(32, 96\\)"),
    (lambda s: {**s, "transformer.h.2.ln_1.weight": np.ones(32)}, "unexpected tensor 'transformer.h.2.ln_1.weight'"),
    (lambda s: {**s, "lm_head.weight": s["transformer.wte.weight"] + 1}, "lm_head.weight differs from wte.weight"),
    (lambda s: {**s, "wpe.weight": s["transformer.wpe.weight"]}, "holds 'wpe.weight' twice"),
    (lambda s: {**s, "transformer.ln_f.bias": np.zeros(32, dtype=np.int64)}, "'transformer.ln_f.bias' has dtype int64"),
])
def test_bad_weights_are_refused_in_one_sentence(edit, words):
    cfg = GPTConfig(**config_from_hf(HF_CONFIG))
    with pytest.raises(InputError, match=words) as error:
        masters_from_hf(edit(random_hf_state()), cfg)
    assert "\n" not in str(error.value)


def test_bad_masters_are_refused():
    cfg = GPTConfig(**config_from_hf(HF_CONFIG))
    masters = masters_from_hf(random_hf_state(), cfg)
    with pytest.raises(InputError, match="the npmegatron masters has no tensor 'blocks.0.attn.qkv.bias'"):
        masters_to_hf(without(masters, "blocks.0.attn.qkv.bias"), cfg)


def test_folder_round_trip(tmp_path):
    state = random_hf_state()
    tokenizer = tmp_path / "my-tokenizer.json"
    tokenizer.write_text('{"model": {}}')
    folder = str(tmp_path / "out")
    write_hf_folder(folder, HF_CONFIG, state, tokenizer_file=str(tokenizer))
    hf, tensors = read_hf_folder(folder)
    assert hf == HF_CONFIG and sorted(tensors) == sorted(state)
    assert all(np.array_equal(tensors[k], state[k]) and tensors[k].dtype == np.float64 for k in state)
    with safe_open(os.path.join(folder, "model.safetensors"), framework="numpy") as file:
        assert file.metadata() == {"format": "pt"}        # transformers refuses a file without it
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": {}}'


def test_folder_problems_are_one_sentence(tmp_path):
    with pytest.raises(InputError, match="config.json does not exist"):
        read_hf_folder(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="config.json is not valid JSON"):
        read_hf_folder(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="config.json holds a JSON list, not an object"):
        read_hf_folder(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(InputError, match="model.safetensors does not exist; save the model with save_pretrained"):
        read_hf_folder(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(InputError, match="model.safetensors cannot be read"):
        read_hf_folder(str(tmp_path))
    with pytest.raises(InputError, match="tokenizer file .*absent.json does not exist"):
        write_hf_folder(str(tmp_path / "out"), HF_CONFIG, {}, tokenizer_file=str(tmp_path / "absent.json"))


def test_sharded_safetensors_folders_are_read(tmp_path):
    """save_pretrained splits a large model over files listed in model.safetensors.index.json."""
    from safetensors.numpy import save_file
    state = random_hf_state()
    keys = list(state)
    parts = {"model-00001-of-00002.safetensors": keys[:10], "model-00002-of-00002.safetensors": keys[10:]}
    for name, part in parts.items():
        save_file({k: state[k] for k in part}, str(tmp_path / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in parts.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    _, tensors = read_hf_folder(str(tmp_path))
    assert sorted(tensors) == sorted(state) and all(np.array_equal(tensors[k], state[k]) for k in state)


def test_transformers_gpt2_converts_in_and_out_exactly(tmp_path):
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed: the HF equivalence runs against the numpy reference only")
    import torch
    torch.manual_seed(0)
    hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3)).to(torch.float64).eval()
    with torch.no_grad():                   # LayerNorms and biases away from their 1 and 0
        for name, tensor in hf_model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                tensor.add_(0.3 * torch.randn_like(tensor))
    hf_model.save_pretrained(tmp_path / "in")
    hf_config, tensors = read_hf_folder(str(tmp_path / "in"))
    cfg = GPTConfig(**{**config_from_hf(hf_config), "dtype": "float64"})
    masters = masters_from_hf(tensors, cfg)
    ids = ids_for(hf_config)
    with torch.no_grad():
        expected = hf_model(torch.from_numpy(ids)).logits.numpy()
    assert relative_error(our_logits(model_for(hf_config, masters), ids), expected) < 1e-9

    # The loss and every gradient. HF's own labels= loss runs in float32 (transformers casts the
    # logits with .float()), so the float64 cross-entropy of its float64 logits is taken here.
    hf_model.train()
    hf_logits = hf_model(torch.from_numpy(ids)).logits[:, :-1]
    hf_loss = torch.nn.functional.cross_entropy(hf_logits.reshape(-1, hf_logits.shape[-1]),
                                                torch.from_numpy(ids[:, 1:]).reshape(-1))
    hf_loss.backward()
    ours = model_for(hf_config, masters)
    ours.train()
    loss = ours(ids[:, :-1], ids[:, 1:])[1]
    loss.backward()
    assert abs(float(loss.data) - hf_loss.item()) < 1e-9 * hf_loss.item()
    hf_grads = masters_from_hf({k: t.grad.numpy() for k, t in hf_model.named_parameters() if k != "lm_head.weight"}, cfg)
    for name, param, spec in ours.named_specs():
        assert relative_error(param.grad[tuple(slice(0, k) for k in spec.shape)], hf_grads[name]) < 1e-9, name

    write_hf_folder(str(tmp_path / "out"), config_to_hf(cfg), masters_to_hf(masters, cfg))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out", torch_dtype=torch.float64)
    original, again = hf_model.state_dict(), loaded.state_dict()
    assert sorted(original) == sorted(again)
    assert all(original[k].dtype == again[k].dtype and torch.equal(original[k], again[k]) for k in original)


def assembled_gradients(folder, cfg):
    """Whole gradients from every rank's RANK.npz (tests/ranks/converted_gpt2.py): each piece put
    at its place in the padded master, then the padding cut off."""
    specs = {name: spec for name, _, spec in GPT(cfg).named_specs()}
    pieces, logits, loss = {}, None, None
    for file in sorted(os.listdir(folder)):
        data = np.load(os.path.join(folder, file))
        for name, place in json.loads(bytes(data["places"])).items():
            pieces.setdefault(name, []).append((place, data[f"grad.{name}"]))
        if "logits" in data.files:
            logits, loss = data["logits"], float(data["loss"])
    whole = {}
    for name, parts in pieces.items():       # padded to this layout's padding, then cut to the real size
        target = np.zeros([max(place[d][1] for place, _ in parts) for d in range(len(parts[0][0]))])
        for place, grad in parts:
            target[tuple(slice(lo, hi) for lo, hi in place)] = grad
        whole[name] = target[tuple(slice(0, k) for k in specs[name].shape)]
    return whole, logits, loss


def test_converted_in_it_runs_at_tp2_pp2_and_converts_back_out_exactly(tmp_path, mpirun):
    """The issue's acceptance without transformers: HF's loss and logits from the NumPy reference,
    every gradient from the serial model that test_logits_equal_the_hf_reference ties to it."""
    from click.testing import CliRunner
    from npmegatron.cli import main
    from safetensors.numpy import load_file, save_file
    state = random_hf_state()
    os.makedirs(tmp_path / "in")
    save_file(state, str(tmp_path / "in" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "in" / "config.json").write_text(json.dumps(HF_CONFIG))
    run = CliRunner().invoke(main, ["convert", "--from-hf", str(tmp_path / "in"), "--save", str(tmp_path / "ck")])
    assert run.exit_code == 0, run.output
    tokens = ids_for(HF_CONFIG, b=2, t=16)
    np.save(tmp_path / "tokens.npy", tokens)
    os.makedirs(tmp_path / "out")
    mpirun(4, "ranks/converted_gpt2.py", args=[tmp_path / "ck", tmp_path / "tokens.npy", tmp_path / "out"], timeout=120)
    cfg = GPTConfig(**{**config_from_hf(HF_CONFIG), "dtype": "float64", "hidden_dropout": 0.0, "attention_dropout": 0.0})
    grads, logits, loss = assembled_gradients(tmp_path / "out", cfg)

    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    reference = hf_reference_logits(state, HF_CONFIG, inputs)
    shifted = reference - reference.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    reference_loss = -np.take_along_axis(log_probs, targets[..., None], -1).mean()
    assert relative_error(logits, reference) < 1e-9
    assert abs(loss - reference_loss) < 1e-9 * abs(reference_loss)
    serial = model_for(HF_CONFIG, masters_from_hf(state, cfg))
    serial.train()
    serial(inputs, targets)[1].backward()
    for name, param, spec in serial.named_specs():
        expected = param.grad[tuple(slice(0, k) for k in spec.shape)]
        assert relative_error(grads[name], expected) < 1e-9, name

    run = CliRunner().invoke(main, ["convert", "--load", str(tmp_path / "ck"), "--to-hf", str(tmp_path / "back")])
    assert run.exit_code == 0, run.output
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(state)
    assert all(back[k].dtype == state[k].dtype and np.array_equal(back[k], state[k]) for k in state)
    assert config_from_hf(json.loads((tmp_path / "back" / "config.json").read_text())) == config_from_hf(HF_CONFIG)


def test_convert_needs_one_direction():
    from click.testing import CliRunner
    from npmegatron.cli import main
    run = CliRunner().invoke(main, ["convert", "--from-hf", "x"])
    assert run.exit_code != 0 and "convert needs either --from-hf DIR --save CHECKPOINT" in run.output
