"""Hugging Face GPT-2 (GPT2LMHeadModel) <-> npmegatron, the family's half of convert.py (issue 16):
config.json's fields, the tensor names and HF's QKV column order, both ways.

HF's Conv1D stores (in, out) like our layers, so nothing is transposed:

    HF (with or without "transformer.")    npmegatron master          shape
    wte.weight                             wte.weight                (V, h)  tied output layer
    wpe.weight                             wpe                       (P, h)
    h.N.ln_1.weight / .bias                blocks.N.ln_1.weight/.bias (h,)
    h.N.attn.c_attn.weight / .bias         blocks.N.attn.qkv.*       (h, 3h) / (3h,)  REORDERED
    h.N.attn.c_proj.weight / .bias         blocks.N.attn.proj.*      (h, h) / (h,)
    h.N.ln_2.weight / .bias                blocks.N.ln_2.*           (h,)
    h.N.mlp.c_fc.weight / .bias            blocks.N.mlp.fc.*         (h, f) / (f,)
    h.N.mlp.c_proj.weight / .bias          blocks.N.mlp.proj.*       (f, h) / (h,)
    ln_f.weight / .bias                    ln_f.*                    (h,)

QKV order. HF's c_attn columns are (3, heads, d): all q, then all k, then all v. Ours are
(heads, 3, d): each head's q, k, v side by side, so that a contiguous column shard of the
column-parallel QKV is whole heads (model.ParallelAttention). The shapes agree, so a plain copy
loads without complaint and gives a wrong model; the columns of weight and bias are permuted.

HF's causal-mask buffers (h.N.attn.bias, h.N.attn.masked_bias) are skipped; `lm_head.weight`,
which GPT2LMHeadModel.save_pretrained leaves out because it is tied, is accepted only when it
equals wte. Written files have "transformer."-prefixed keys and no lm_head, as save_pretrained's.
"""
import json
import re

import numpy

from ..autograd import InputError
from ..config import GPTConfig
from ..hf_folder import PREFIX
from ..safetensors_header import shown as _shown
from .checks import NOT_NEGATIVE, POSITIVE, RATE, check_divides, check_sizes, config_numbers

ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}   # HF -> GPTConfig.gelu
# What GPT2Config assumes for a field config.json leaves out, so a sparse file means what HF reads.
HF_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
               "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1,
               "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
               "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
               "reorder_and_upcast_attn": False, "add_cross_attention": False, "tie_word_embeddings": True}
# Variants of GPT-2 this model does not compute: field -> the only value it supports.
REQUIRED = {"tie_word_embeddings": True, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}
GPT2_EOS = 50256   # <|endoftext|>, GPT2Config's default bos/eos id
LAYER_MATRIX = re.compile(r"h\.([0-9]+)\.(attn\.c_attn|mlp\.c_fc)\.weight")   # marks a layer as held
GPT2_NUMBERS = {"resid_pdrop": RATE, "embd_pdrop": RATE, "attn_pdrop": RATE, "layer_norm_epsilon": POSITIVE,
                "initializer_range": NOT_NEGATIVE}


def gpt2_config_from_hf(hf_config):
    """GPTConfig keyword arguments for an HF GPT-2 config.json. Absent fields take GPT2Config's
    defaults, as transformers would. hidden_dropout is resid_pdrop (the residual branches: two
    sites a layer against embd_pdrop's one) when the two differ. reorder_and_upcast_attn is
    accepted: it only upcasts the attention scores."""
    get = lambda key: hf_config.get(key, HF_DEFAULTS.get(key))   # noqa: E731
    for key, wanted in REQUIRED.items():
        if get(key) != wanted:
            raise InputError(f"config.json has {key} {_shown(get(key))}; npmegatron supports only "
                             f"{json.dumps(wanted)} (GPT-2's own layout)")
    activation = get("activation_function")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise InputError(f"config.json has activation_function {_shown(activation)}; npmegatron supports "
                         f"{', '.join(map(repr, ACTIVATIONS))}")
    positions = hf_config.get("n_positions", hf_config.get("n_ctx", HF_DEFAULTS["n_positions"]))
    sizes = {"n_layer": get("n_layer"), "n_embd": get("n_embd"), "n_head": get("n_head"),
             "vocab_size": get("vocab_size"), "n_positions": positions, "n_inner": get("n_inner")}
    check_sizes(sizes, may_be_null="n_inner")
    check_divides(sizes, "n_head", "n_embd")
    numbers = config_numbers(get, GPT2_NUMBERS)
    return {"num_layers": sizes["n_layer"], "hidden_size": sizes["n_embd"],
            "num_attention_heads": sizes["n_head"], "vocab_size": sizes["vocab_size"],
            "max_position_embeddings": positions, "ffn_hidden_size": sizes["n_inner"] or 4 * sizes["n_embd"],
            "hidden_dropout": numbers["resid_pdrop"], "attention_dropout": numbers["attn_pdrop"],
            "layernorm_epsilon": numbers["layer_norm_epsilon"], "init_method_std": numbers["initializer_range"],
            "gelu": ACTIVATIONS[activation]}


def gpt2_config_to_hf(cfg: GPTConfig, bos_token_id=None, eos_token_id=None):
    """A complete config.json for GPT2LMHeadModel. Token ids are written when known; otherwise a
    vocabulary too small for GPT2Config's default (50256) gets null, so HF does not assume an
    end-of-text token the vocabulary lacks."""
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    if cfg.vocab_size > GPT2_EOS:      # GPT2Config's default is in the vocabulary: leave unknown ids to it
        ids = {key: value for key, value in ids.items() if value is not None}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.max_position_embeddings,
            "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_attention_heads,
            "n_inner": cfg.ffn_hidden_size, "activation_function": "gelu_new" if cfg.gelu == "tanh" else "gelu",
            "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout, "layer_norm_epsilon": cfg.layernorm_epsilon,
            "initializer_range": cfg.init_method_std, "tie_word_embeddings": True,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "add_cross_attention": False, "use_cache": True,
            "torch_dtype": cfg.dtype, **ids}


def name_map(cfg):
    """[(HF name without prefix, npmegatron master name, master shape)] of a GPT-2 configuration,
    in the model's parameter order; built without building a model (GPT-2 XL would take GBs)."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    # (HF module, ours, weight shape): a LayerNorm's weight is (h,), a linear's (in, out); bias (out,)
    layer = [("ln_1", "ln_1", (h,)), ("attn.c_attn", "attn.qkv", (h, 3 * h)), ("attn.c_proj", "attn.proj", (h, h)),
             ("ln_2", "ln_2", (h,)), ("mlp.c_fc", "mlp.fc", (h, f)), ("mlp.c_proj", "mlp.proj", (f, h))]
    names = [("wpe.weight", "wpe", (cfg.max_position_embeddings, h)),
             ("wte.weight", "wte.weight", (cfg.vocab_size, h))]
    for n in range(cfg.num_layers):
        for hf, ours, shape in layer:
            names += [(f"h.{n}.{hf}.weight", f"blocks.{n}.{ours}.weight", shape),
                      (f"h.{n}.{hf}.bias", f"blocks.{n}.{ours}.bias", shape[-1:])]
    return names + [("ln_f.weight", "ln_f.weight", (h,)), ("ln_f.bias", "ln_f.bias", (h,))]


def gpt2_sizes_held(cfg):
    """[(config.json's field, its value, the tensor that holds it, along which axis)] of GPT-2."""
    return [("vocab_size", cfg.vocab_size, "wte.weight", 0), ("n_embd", cfg.hidden_size, "wte.weight", 1),
            ("n_positions", cfg.max_position_embeddings, "wpe.weight", 0),
            ("n_inner (or 4 x n_embd)", cfg.ffn_hidden_size, "h.0.mlp.c_fc.weight", 1)]


def gpt2_masters(tensors, cfg):
    """Masters from a checked GPT-2 state (unprefixed names): QKV columns reordered, the rest as they are."""
    heads = cfg.num_attention_heads
    return {ours: qkv_from_hf(tensors[hf], heads) if ".attn.c_attn." in hf else tensors[hf]
            for hf, ours, _ in name_map(cfg)}


def gpt2_state(masters, cfg, names):
    """GPT2LMHeadModel's state from checked masters: "transformer."-prefixed, QKV columns in HF's order."""
    heads = cfg.num_attention_heads
    return {PREFIX + hf: qkv_to_hf(masters[ours], heads) if ".attn.qkv." in ours else masters[ours]
            for hf, ours, _ in names}


def qkv_from_hf(array, heads):
    """HF's QKV columns (3, heads, d) -> ours (heads, 3, d); weight or bias (last axis)."""
    lead = array.shape[:-1]
    return numpy.ascontiguousarray(array.reshape(*lead, 3, heads, -1).swapaxes(-3, -2).reshape(array.shape))


def qkv_to_hf(array, heads):
    """Ours (heads, 3, d) -> HF's (3, heads, d): the inverse of qkv_from_hf."""
    lead = array.shape[:-1]
    return numpy.ascontiguousarray(array.reshape(*lead, heads, 3, -1).swapaxes(-3, -2).reshape(array.shape))
