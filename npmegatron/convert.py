"""Hugging Face GPT-2 and Llama <-> npmegatron: configurations and weights both ways (issue 16), so
GPT2LMHeadModel and LlamaForCausalLM weights can be brought in and a trained model taken out. Only
local files, JSON and safetensors are used; `transformers` is not needed. config.json's model_type
says which of the two a folder holds; a configuration's model_family which one it is written as.

Weights. A master is a whole, unsharded, unpadded parameter (module.load_masters sets any TP
rank from it).

GPT-2. HF's Conv1D stores (in, out) like our layers, so nothing is transposed:

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

Llama. HF's nn.Linear stores (out, in) and ours (in, out), so every *_proj weight is TRANSPOSED;
the embedding and lm_head are (V, h) on both sides. No biases.

    HF (with or without "model.")               npmegatron master              shape
    embed_tokens.weight                         wte.weight                     (V, h)
    layers.N.input_layernorm.weight             blocks.N.ln_1.weight           (h,)
    layers.N.self_attn.q_proj, k_proj, v_proj   blocks.N.attn.qkv.weight       (h, (nq + 2G) d)  JOINED
    layers.N.self_attn.o_proj.weight            blocks.N.attn.proj.weight      (h, h)
    layers.N.post_attention_layernorm.weight    blocks.N.ln_2.weight           (h,)
    layers.N.mlp.gate_proj / up_proj.weight     blocks.N.mlp.gate / up.weight  (h, f)
    layers.N.mlp.down_proj.weight               blocks.N.mlp.proj.weight       (f, h)
    norm.weight                                 ln_f.weight                    (h,)
    lm_head.weight (never prefixed)             output_layer.weight            (V, h)  when untied

Llama's QKV order. q_proj holds nq query heads and k_proj, v_proj G key/value heads (G = nq
without grouped-query attention), d rows each; HF's query head i attends with key/value head
i // r, r = nq / G (its repeat_kv). Our QKV columns go group by group: for g = 0 .. G-1, query
heads g r .. g r + r - 1, then key head g, then value head g, d columns each, so a contiguous
column shard is whole groups (model.ParallelAttention). Rotary angles need no permutation: HF's
Llama turns channel i with channel i + d/2 (rotate_half), as ours does (autograd/ops/rotary.py).
Meta's original checkpoints pair neighbouring channels instead; HF's own conversion script
permutes their q and k rows before it writes the format read here.

HF's rotary_emb.inv_freq buffers (older transformers saved them) are skipped. A tied Llama
(tie_word_embeddings) has no output layer: its lm_head, if present, must equal embed_tokens.
Written files have "model."-prefixed keys and lm_head.weight when untied, as save_pretrained's.

A folder from elsewhere is input (issue 26): hf_folder.py checks its files; here config.json's
values are checked and held against the weights' shapes before any model is built from them.
"""
import json
import math
import os
import re

import numpy

from .autograd import InputError
from .autograd.backend import to_numpy
from .checkpointing import checkpoint
from .comm import ProcessGrid
from .config import MODEL_FAMILIES, GPTConfig
from .hf_folder import PREFIX, check_hf_target, inside_folder, is_mask_buffer, read_hf_folder, write_hf_folder
from .model import GPT
from .module import load_masters
from .optim.adamw import AdamW
from .safetensors_header import one_line, shown as _shown

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
LARGEST_SIZE = 2 ** 48   # no real size comes near it; larger ints overflow float checks downstream
LAYER_MATRIX = re.compile(r"h\.([0-9]+)\.(attn\.c_attn|mlp\.c_fc)\.weight")   # marks a layer as held
RATE = (lambda x: 0.0 <= x < 1.0, "a number in [0, 1)")
POSITIVE = (lambda x: x > 0.0, "a positive finite number")
NOT_NEGATIVE = (lambda x: x >= 0.0, "a finite number, not negative")
GPT2_NUMBERS = {"resid_pdrop": RATE, "embd_pdrop": RATE, "attn_pdrop": RATE, "layer_norm_epsilon": POSITIVE,
                "initializer_range": NOT_NEGATIVE}

LLAMA_PREFIX = "model."
# What LlamaConfig assumes for a field config.json leaves out (num_key_value_heads: as many as heads).
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
                  "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None,
                  "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "head_dim": None,
                  "pretraining_tp": 1}
# Variants of Llama this model does not compute: field -> (the only value it supports, why or the fix).
LLAMA_REQUIRED = {"hidden_act": ("silu", "SwiGLU's gate is silu"),
                  "attention_bias": (False, "Llama's attention projections have no biases"),
                  "mlp_bias": (False, "Llama's MLP has no biases"),
                  "rope_scaling": (None, "scaled rotary angles, such as Llama 3.1's 'llama3' or YaRN, are not "
                                         "implemented"),
                  "pretraining_tp": (1, "set it to 1: it only splits HF's own matmuls, the weights are whole")}
LLAMA_NUMBERS = {"attention_dropout": RATE, "rms_norm_eps": POSITIVE, "initializer_range": NOT_NEGATIVE,
                 "rope_theta": POSITIVE}
LLAMA_LAYER_MATRIX = re.compile(r"layers\.([0-9]+)\.(self_attn\.q_proj|mlp\.gate_proj)\.weight")
# Each family's config.json field for the layers, the matrices that mark a layer as held, their prefix.
LAYER_COUNTS = {"gpt2": ("n_layer", LAYER_MATRIX, "h"), "llama": ("num_hidden_layers", LLAMA_LAYER_MATRIX, "layers")}
# Every position's rotary angles are tabled (model.RotaryTable), and no weight's shape holds the
# length, so it is bounded here: 2^24 positions is past any Llama's context.
MAX_ROTARY_POSITIONS = 2 ** 24
LLAMA_HEAD = "lm_head.weight"    # LlamaForCausalLM's output layer: outside "model.", as HF names it
# Each family's HF model, and what check_tensors says the folder must hold.
HF_MODELS = {"gpt2": ("GPT2LMHeadModel", "GPT-2", "GPT-2's own tensors (GPT2Model, or GPT2LMHeadModel "
                                                  "with its tied head)"),
             "llama": ("LlamaForCausalLM", "Llama", "Llama's own tensors (LlamaModel, or LlamaForCausalLM)")}
# The parts (config.py's flags) a configuration must have to be what the family's HF model computes.
HF_PARTS = {"gpt2": {**MODEL_FAMILIES["gpt2"], "group_query_attention": False},
            "llama": {**{k: v for k, v in MODEL_FAMILIES["llama"].items()
                         if k != "untie_embeddings_and_output_weights"}, "rotary_percent": 1.0}}
# Special tokens a tokenizer.json names: (bos candidates, eos candidates), Llama 2's then Llama 3's.
SPECIAL_TOKENS = {"gpt2": (("<|endoftext|>",), ("<|endoftext|>",)),
                  "llama": (("<s>", "<|begin_of_text|>"), ("</s>", "<|end_of_text|>"))}


def config_from_hf(hf_config):
    """GPTConfig keyword arguments for an HF config.json (a dict): GPT-2's or Llama's, as its
    model_type says. dtype is left to the caller: it is a choice of the run, and load_masters
    casts the weights to it."""
    model_type = hf_config.get("model_type")
    if model_type == "llama":
        return llama_config_from_hf(hf_config)
    if model_type != "gpt2":
        raise InputError(f"config.json has model_type {_shown(model_type)}; only 'gpt2' (GPT2Model, "
                         "GPT2LMHeadModel) and 'llama' (LlamaModel, LlamaForCausalLM) can be converted")
    return gpt2_config_from_hf(hf_config)


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
    _check_sizes(sizes, may_be_null="n_inner")
    _check_divides(sizes, "n_head", "n_embd")
    numbers = _config_numbers(get, GPT2_NUMBERS)
    return {"num_layers": sizes["n_layer"], "hidden_size": sizes["n_embd"],
            "num_attention_heads": sizes["n_head"], "vocab_size": sizes["vocab_size"],
            "max_position_embeddings": positions, "ffn_hidden_size": sizes["n_inner"] or 4 * sizes["n_embd"],
            "hidden_dropout": numbers["resid_pdrop"], "attention_dropout": numbers["attn_pdrop"],
            "layernorm_epsilon": numbers["layer_norm_epsilon"], "init_method_std": numbers["initializer_range"],
            "gelu": ACTIVATIONS[activation]}


def llama_config_from_hf(hf_config):
    """GPTConfig keyword arguments for an HF Llama config.json. Absent fields take LlamaConfig's
    defaults, as transformers would; fewer key/value heads than query heads is grouped-query
    attention. Llama has no hidden dropout; its attention_dropout carries over."""
    values = {**hf_config, "rope_theta": _llama_rope_theta(hf_config)}
    get = lambda key: values.get(key, LLAMA_DEFAULTS.get(key))   # noqa: E731
    for key, (wanted, why) in LLAMA_REQUIRED.items():
        if json.dumps(get(key)) != json.dumps(wanted):     # strictly: true is not 1, nor 1.0 an int
            raise InputError(f"config.json has {key} {_shown(get(key))}; npmegatron supports only "
                             f"{json.dumps(wanted)} ({why})")
    tied = get("tie_word_embeddings")
    if type(tied) is not bool:
        raise InputError(f"config.json has tie_word_embeddings {_shown(tied)}; it must be true or false")
    sizes = _llama_sizes(get)
    numbers = _config_numbers(get, LLAMA_NUMBERS)
    heads, groups = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    return {"model_family": "llama", "num_layers": sizes["num_hidden_layers"],
            "hidden_size": sizes["hidden_size"], "num_attention_heads": heads,
            "group_query_attention": groups < heads, "num_query_groups": groups,
            "vocab_size": sizes["vocab_size"], "max_position_embeddings": sizes["max_position_embeddings"],
            "ffn_hidden_size": sizes["intermediate_size"], "rotary_base": numbers["rope_theta"],
            "rotary_percent": 1.0, "untie_embeddings_and_output_weights": not tied, "hidden_dropout": 0.0,
            "attention_dropout": numbers["attention_dropout"], "layernorm_epsilon": numbers["rms_norm_eps"],
            "init_method_std": numbers["initializer_range"]}


def _llama_rope_theta(hf_config):
    """The rotary base of a Llama config.json: transformers 4 writes rope_theta (and rope_scaling),
    transformers 5 rope_parameters {"rope_type": "default", "rope_theta": ...} (reading either).
    Only the plain kind is computed here; given both ways, the two must agree, since each version
    of transformers reads its own."""
    theta = hf_config.get("rope_theta", LLAMA_DEFAULTS["rope_theta"])
    parameters = hf_config.get("rope_parameters")
    if parameters is None:
        return theta
    if not isinstance(parameters, dict):
        raise InputError(f"config.json has rope_parameters {_shown(parameters)}; it must be an object such as "
                         '{"rope_type": "default", "rope_theta": 10000.0}')
    kind = parameters.get("rope_type", parameters.get("type", "default"))   # "type": its older name
    if kind != "default":
        raise InputError(f"config.json has rope_parameters' rope_type {_shown(kind)}; npmegatron supports only "
                         "'default' (scaled rotary angles, such as Llama 3.1's 'llama3' or YaRN, are not implemented)")
    stray = sorted(set(parameters) - {"rope_type", "type", "rope_theta"})
    if stray:
        raise InputError(f"config.json's rope_parameters has {_shown(stray[0])}, which plain rotary angles do not "
                         "take; npmegatron reads only rope_type and rope_theta there")
    given = parameters.get("rope_theta", theta)
    if "rope_theta" in hf_config and given != theta:
        raise InputError(f"config.json has rope_theta {_shown(theta)} but rope_parameters' rope_theta "
                         f"{_shown(given)}; transformers 4 reads the first and 5 the second, so make them equal")
    return given


def _llama_sizes(get):
    """A Llama config.json's sizes, each a positive integer, the heads dividing the hidden size
    and the key/value heads the heads; head_dim, when given, the one this model computes."""
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "max_position_embeddings")
    sizes = {key: get(key) for key in keys}
    if sizes["num_key_value_heads"] is None:
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    _check_sizes(sizes)
    _check_divides(sizes, "num_attention_heads", "hidden_size")
    _check_divides(sizes, "num_key_value_heads", "num_attention_heads")
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
    given = get("head_dim")
    if given is not None and not (type(given) is int and given == head_dim):
        raise InputError(f"config.json has head_dim {_shown(given)}, but npmegatron's heads are hidden_size / "
                         f"num_attention_heads = {head_dim} channels; only a Llama with head_dim {head_dim} "
                         "(or none given) can be converted")
    if sizes["max_position_embeddings"] > MAX_ROTARY_POSITIONS:
        raise InputError(f"config.json has max_position_embeddings {sizes['max_position_embeddings']}; "
                         "npmegatron tables every position's rotary angles, so it must be at most 2^24")
    return sizes


def _check_sizes(sizes, may_be_null=None):
    """Each size a positive integer (a JSON true, 2.0 or a string is not), or null where allowed."""
    for key, value in sizes.items():
        if not (type(value) is int and 1 <= value <= LARGEST_SIZE) and not (key == may_be_null and value is None):
            raise InputError(f"config.json has {key} {_shown(value)}; it must be a positive integer "
                             "(at most 2^48)")


def _check_divides(sizes, part, whole):
    if sizes[whole] % sizes[part]:
        raise InputError(f"config.json has {part} {sizes[part]}, which does not divide {whole} "
                         f"{sizes[whole]}; give the config.json saved with these weights")


def _config_numbers(get, rules):
    """config.json's real-valued fields ({field: (test, rule)}) as floats, each in the range HF's
    modules accept (a dropout rate in [0, 1)): a string, a boolean, NaN or infinity is refused
    here rather than met inside the model."""
    numbers = {}
    for key, (holds, rule) in rules.items():
        number = _finite(get(key))
        if number is None or not holds(number):
            raise InputError(f"config.json has {key} {_shown(get(key))}; it must be {rule}")
        numbers[key] = number
    return numbers


def _finite(value):
    """A JSON number as a finite float, else None (strings, booleans, NaN, infinity, huge ints)."""
    if type(value) not in (int, float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def hf_family(cfg: GPTConfig):
    """'gpt2' or 'llama': which HF model a configuration is. One whose parts were mixed (a GPT-2
    with rotary positions, a Llama rotating part of each head) is neither, and is refused."""
    family = cfg.model_family
    for key, wanted in HF_PARTS[family].items():
        if getattr(cfg, key) != wanted:
            raise InputError(f"the model has {key} {getattr(cfg, key)!r}, but Hugging Face's "
                             f"{HF_MODELS[family][0]} has {wanted!r}; only a {family} model with its "
                             "family's own parts can be converted")
    return family


def config_to_hf(cfg: GPTConfig, bos_token_id=None, eos_token_id=None):
    """A complete config.json (a dict) for transformers' GPT2LMHeadModel or LlamaForCausalLM, as
    the configuration's family says. Token ids are written when known; otherwise a vocabulary too
    small for GPT2Config's default (50256) gets null, so HF does not assume an end-of-text token
    the vocabulary lacks."""
    if hf_family(cfg) == "llama":
        return llama_config_to_hf(cfg, bos_token_id, eos_token_id)
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


def llama_config_to_hf(cfg: GPTConfig, bos_token_id=None, eos_token_id=None):
    """A complete config.json for LlamaForCausalLM. The rotary base is written both ways that
    transformers 4 (rope_theta) and 5 (rope_parameters) read. Unknown token ids are written null:
    LlamaConfig's defaults (1 and 2) are Llama's own tokenizer's and would name other tokens of
    another vocabulary. Llama has no hidden dropout, so a model trained with one is written without it."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings, "initializer_range": cfg.init_method_std,
            "rms_norm_eps": cfg.layernorm_epsilon, "rope_theta": cfg.rotary_base, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base},
            "attention_bias": False, "attention_dropout": cfg.attention_dropout, "mlp_bias": False,
            "pretraining_tp": 1, "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "use_cache": True, "torch_dtype": cfg.dtype, "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id}


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


def llama_name_map(cfg):
    """[(HF names without "model.", npmegatron master name, master shape)] of a Llama configuration
    in the model's parameter order: one HF tensor a master, but q_proj, k_proj and v_proj for the
    joined QKV; lm_head (its name never prefixed) only when the output layer is untied."""
    h, f, vocab = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim
    layer = [(("input_layernorm",), "ln_1", (h,)),
             (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn.qkv", (h, qkv)),
             (("self_attn.o_proj",), "attn.proj", (h, h)), (("post_attention_layernorm",), "ln_2", (h,)),
             (("mlp.gate_proj",), "mlp.gate", (h, f)), (("mlp.up_proj",), "mlp.up", (h, f)),
             (("mlp.down_proj",), "mlp.proj", (f, h))]
    names = [(("embed_tokens.weight",), "wte.weight", (vocab, h))]
    if cfg.untie_embeddings_and_output_weights:
        names.append(((LLAMA_HEAD,), "output_layer.weight", (vocab, h)))
    for n in range(cfg.num_layers):
        names += [(tuple(f"layers.{n}.{hf}.weight" for hf in hfs), f"blocks.{n}.{ours}.weight", shape)
                  for hfs, ours, shape in layer]
    return names + [(("norm.weight",), "ln_f.weight", (h,))]


def llama_hf_shapes(cfg):
    """{HF name without "model.": shape} of a Llama configuration, as its folder holds them."""
    h, d = cfg.hidden_size, cfg.head_dim
    rows = {"q_proj": cfg.num_attention_heads * d, "k_proj": cfg.num_query_groups * d,
            "v_proj": cfg.num_query_groups * d}
    shapes = {}
    for hf_names, _, shape in llama_name_map(cfg):
        for name in hf_names:
            module = name.split(".")[-2]
            shapes[name] = (rows[module], h) if module in rows else shape[::-1] if is_linear(name) else shape
    return shapes


def is_linear(hf_name):
    """A Llama nn.Linear weight other than lm_head: stored (out, in) by HF, so transposed."""
    return hf_name.endswith("_proj.weight")


def qkv_from_hf(array, heads):
    """HF's QKV columns (3, heads, d) -> ours (heads, 3, d); weight or bias (last axis)."""
    lead = array.shape[:-1]
    return numpy.ascontiguousarray(array.reshape(*lead, 3, heads, -1).swapaxes(-3, -2).reshape(array.shape))


def qkv_to_hf(array, heads):
    """Ours (heads, 3, d) -> HF's (3, heads, d): the inverse of qkv_from_hf."""
    lead = array.shape[:-1]
    return numpy.ascontiguousarray(array.reshape(*lead, heads, 3, -1).swapaxes(-3, -2).reshape(array.shape))


def qkv_from_llama(q, k, v, groups):
    """HF Llama's q_proj (nq d, h), k_proj and v_proj (G d, h), with G = groups -> our QKV weight
    (h, (nq + 2G) d), group by group: the group's nq / G query heads, its key head, its value head."""
    h = q.shape[1]
    rows = numpy.concatenate([q.reshape(groups, -1, h), k.reshape(groups, -1, h), v.reshape(groups, -1, h)], axis=1)
    return numpy.ascontiguousarray(rows.reshape(-1, h).T)


def qkv_to_llama(array, heads, groups):
    """Our QKV weight -> HF Llama's [q_proj, k_proj, v_proj]: the inverse of qkv_from_llama."""
    h, per_group = array.shape[0], heads // groups
    d = array.shape[1] // (heads + 2 * groups)
    rows = array.T.reshape(groups, (per_group + 2) * d, h)
    return [numpy.ascontiguousarray(part.reshape(-1, h))
            for part in numpy.split(rows, [per_group * d, (per_group + 1) * d], axis=1)]


def check_tensors(tensors, shapes, source, shown=None, family="gpt2"):
    """Every expected name present with its shape and floating point, nothing else: one sentence
    for the first fault. `shown` maps a name to how the file spelled it (with its prefix)."""
    shown = shown or {}
    _, model, own_tensors = HF_MODELS[family]
    for name, shape in shapes.items():
        if name not in tensors:
            raise InputError(f"{source} has no tensor {name!r} (shape {shape}); it does not hold a "
                             f"{model} of this configuration")
        array = tensors[name]
        if tuple(array.shape) != shape:
            raise InputError(f"{source} tensor {shown.get(name, name)!r} has shape {tuple(array.shape)}, "
                             f"but the configuration needs {shape}; check that the config matches the weights")
        if array.dtype.kind != "f":
            raise InputError(f"{source} tensor {shown.get(name, name)!r} has dtype {array.dtype}; "
                             "weights must be floating point")
    for name in tensors:
        if name not in shapes:
            raise InputError(f"{source} has an unexpected tensor {shown.get(name, name)!r}; only "
                             f"{own_tensors} can be converted")


def strip_hf_names(tensors, prefix=PREFIX, is_buffer=is_mask_buffer):
    """HF keys without the family's prefix, buffers dropped, lm_head taken out:
    (tensors, how each name was spelled, lm_head or None)."""
    stripped, shown, lm_head = {}, {}, None
    for key, array in tensors.items():
        if key == "lm_head.weight":
            lm_head = array
            continue
        name = key[len(prefix):] if key.startswith(prefix) else key
        if is_buffer(name):
            continue
        if name in stripped:
            raise InputError(f"the Hugging Face checkpoint holds {name!r} twice (as {shown[name]!r} and "
                             f"{key!r}); keep one of them")
        stripped[name], shown[name] = array, key
    return stripped, shown, lm_head


def is_rotary_buffer(name):
    """HF Llama's rotary frequencies (layers.N.self_attn.rotary_emb.inv_freq, or one for the model),
    which older transformers saved with the weights; they follow from rope_theta."""
    return name.endswith("rotary_emb.inv_freq")


def check_config_fits(tensors, cfg, shown):
    """config.json's sizes against the shapes of the weights ({name: array}, unprefixed), before
    anything is built from them: a config that disagrees, or asks for absurd sizes, is named here
    rather than met as a wrong model or a huge allocation. A layer is held when one of its two
    matrices is; missing pieces are check_tensors' to name."""
    family = hf_family(cfg)
    key, matrix, layer = LAYER_COUNTS[family]
    held = sorted({int(m.group(1)) for name in tensors if (m := matrix.fullmatch(name))})
    if cfg.num_layers != len(held):
        listed = ", ".join(f"{layer}.{n}" for n in held[:4]) + (", ..." if len(held) > 4 else "")
        raise InputError(f"config.json has {key} {cfg.num_layers}, but the weights' layers are "
                         f"{listed or 'none'} ({len(held)} in all); give the config.json saved with these weights")
    for key, value, name, axis in (_llama_sizes_held(cfg) if family == "llama" else _gpt2_sizes_held(cfg)):
        shape = tuple(getattr(tensors.get(name), "shape", ()))
        if len(shape) == 2 and shape[axis] != value:
            raise InputError(f"config.json has {key} {value}, but tensor {shown.get(name, name)!r} has shape "
                             f"{shape}; give the config.json saved with these weights")


def _gpt2_sizes_held(cfg):
    """[(config.json's field, its value, the tensor that holds it, along which axis)] of GPT-2."""
    return [("vocab_size", cfg.vocab_size, "wte.weight", 0), ("n_embd", cfg.hidden_size, "wte.weight", 1),
            ("n_positions", cfg.max_position_embeddings, "wpe.weight", 0),
            ("n_inner (or 4 x n_embd)", cfg.ffn_hidden_size, "h.0.mlp.c_fc.weight", 1)]


def _llama_sizes_held(cfg):
    """The same for Llama (HF's (out, in) linears). No weight holds max_position_embeddings
    (config_from_hf bounds it)."""
    groups = f"num_key_value_heads x head_dim ({cfg.num_query_groups} x {cfg.head_dim})"
    return [("vocab_size", cfg.vocab_size, "embed_tokens.weight", 0),
            ("hidden_size", cfg.hidden_size, "embed_tokens.weight", 1),
            ("intermediate_size", cfg.ffn_hidden_size, "layers.0.mlp.gate_proj.weight", 0),
            (groups, cfg.num_query_groups * cfg.head_dim, "layers.0.self_attn.k_proj.weight", 0)]


def masters_from_hf(tensors, cfg):
    """{npmegatron master name: array} from an HF state of the configuration's family ({name: array},
    prefixed or not): GPT-2's QKV columns reordered, Llama's linears transposed and its q, k, v
    joined group by group. Every tensor is checked first, so nothing half-converted comes back.
    Arrays keep their dtype."""
    family = hf_family(cfg)
    llama = family == "llama"
    if llama:
        tensors, shown, lm_head = strip_hf_names(tensors, LLAMA_PREFIX, is_rotary_buffer)
    else:
        tensors, shown, lm_head = strip_hf_names(tensors)
    if llama and cfg.untie_embeddings_and_output_weights and lm_head is not None:
        tensors[LLAMA_HEAD], shown[LLAMA_HEAD], lm_head = lm_head, LLAMA_HEAD, None   # a weight of its own
    check_config_fits(tensors, cfg, shown)
    shapes = llama_hf_shapes(cfg) if llama else {hf: shape for hf, _, shape in name_map(cfg)}
    check_tensors(tensors, shapes, "the Hugging Face checkpoint", shown, family)
    for name, array in tensors.items():     # a damaged file or an overflowed float16 cast
        if not numpy.isfinite(array).all():
            raise InputError(f"the Hugging Face checkpoint's tensor {shown.get(name, name)!r} holds NaN or "
                             "infinite values; convert an undamaged copy of the model")
    embedding = "embed_tokens.weight" if llama else "wte.weight"
    if lm_head is not None and not (lm_head.shape == tensors[embedding].shape
                                    and numpy.array_equal(lm_head, tensors[embedding])):
        raise InputError(f"the Hugging Face checkpoint's lm_head.weight differs from {embedding}; " +
                         ("config.json's tie_word_embeddings is true, so give the config.json saved with "
                          "these weights" if llama else "npmegatron's output layer is tied to the token "
                          "embedding, so an untied head cannot be converted"))
    if llama:
        return _llama_masters(tensors, cfg)
    heads = cfg.num_attention_heads
    return {ours: qkv_from_hf(tensors[hf], heads) if ".attn.c_attn." in hf else tensors[hf]
            for hf, ours, _ in name_map(cfg)}


def _llama_masters(tensors, cfg):
    """Masters from a checked Llama state: QKV joined, linears transposed, the rest as they are."""
    masters = {}
    for hf_names, ours, _ in llama_name_map(cfg):
        arrays = [tensors[name] for name in hf_names]
        if len(arrays) == 3:
            masters[ours] = qkv_from_llama(*arrays, cfg.num_query_groups)
        else:
            masters[ours] = numpy.ascontiguousarray(arrays[0].T) if is_linear(hf_names[0]) else arrays[0]
    return masters


def masters_to_hf(masters, cfg):
    """An HF state from npmegatron masters, as save_pretrained writes it: GPT2LMHeadModel's
    ("transformer."-prefixed, no lm_head: tied) with QKV columns back in HF's order, or
    LlamaForCausalLM's ("model."-prefixed, lm_head when untied) with linears transposed back and
    the QKV split into q_proj, k_proj and v_proj."""
    family = hf_family(cfg)
    if family == "llama":
        names = llama_name_map(cfg)
        check_tensors(masters, {ours: shape for _, ours, shape in names}, "the npmegatron masters", family=family)
        return _llama_state(masters, cfg, names)
    names = name_map(cfg)
    check_tensors(masters, {ours: shape for _, ours, shape in names}, "the npmegatron masters")
    heads = cfg.num_attention_heads
    return {PREFIX + hf: qkv_to_hf(masters[ours], heads) if ".attn.qkv." in ours else masters[ours]
            for hf, ours, _ in names}


def _llama_state(masters, cfg, names):
    """LlamaForCausalLM's state from checked masters: QKV split, linears transposed back."""
    state = {}
    for hf_names, ours, _ in names:
        if len(hf_names) == 3:
            arrays = qkv_to_llama(masters[ours], cfg.num_attention_heads, cfg.num_query_groups)
        else:
            arrays = [numpy.ascontiguousarray(masters[ours].T) if is_linear(hf_names[0]) else masters[ours]]
        state.update({(name if name == LLAMA_HEAD else LLAMA_PREFIX + name): array
                      for name, array in zip(hf_names, arrays)})
    return state


# ---- the two directions of `npmegatron convert` ------------------------------------------------

def read_hf_model(hf_dir):
    """(GPTConfig, masters) of a local HF GPT-2 or Llama folder, all of it checked: the files,
    config.json's values and their agreement with the weights' shapes. The dtype is float64 when
    the weights are, else float32 (load_masters casts float16 up)."""
    hf_config, tensors = read_hf_folder(hf_dir)
    dtype = "float64" if any(a.dtype == numpy.float64 for a in tensors.values()) else "float32"
    cfg = GPTConfig(**{**config_from_hf(hf_config), "dtype": dtype})
    return cfg, masters_from_hf(tensors, cfg)


def import_hf(hf_dir, save):
    """A Hugging Face GPT-2 or Llama folder -> a checkpoint in `save` (iteration 0, AdamW's moments
    zero, one TP = 1 shard), which training and generation load at any layout (resharded on load).
    The dtype is float64 when the weights are, else float32; a tokenizer.json beside them goes along."""
    import uuid

    if os.path.isdir(save) and os.listdir(save):
        raise InputError(f"--save {save} is not empty; give a new folder for the converted checkpoint")
    cfg, masters = read_hf_model(hf_dir)
    model = GPT(cfg)             # only now: every size is backed by a weight the folder holds
    load_masters(model, masters)
    tokenizer = inside_folder(hf_dir, "tokenizer.json")
    has_tokenizer = os.path.isfile(tokenizer)
    os.makedirs(save, exist_ok=True)
    extra = {"run_id": uuid.uuid4().hex, "pipeline_layout": None, "converted_from": os.path.abspath(hf_dir),
             "data": {"consumed_samples": 0, "global_batch_size": None, "seed": cfg.seed, "data_path": None},
             "tokenizer": {"type": "huggingface"} if has_tokenizer else {"type": "bytes"}, "args": {}}
    return checkpoint.save(save, 0, model, AdamW(model.parameters()), ProcessGrid.single(), extra,
                           {"tokenizer.json": tokenizer} if has_tokenizer else {})


def export_hf(load, hf_dir, overwrite=False):
    """A checkpoint saved at any layout -> a Hugging Face folder (config.json, model.safetensors,
    the run's tokenizer.json if it had one) that GPT2LMHeadModel or LlamaForCausalLM.from_pretrained
    loads, as the model's family says. Under --fp16/--bf16 the float32 master weights are written.
    A folder that already holds weights is written into only with `overwrite`."""
    check_hf_target(hf_dir, overwrite)
    folder, manifest = checkpoint.read_manifest(load)
    cfg = checkpoint.saved_config(manifest, fp16=False, bf16=False, sequence_parallel=False,
                                  device="cpu", tf32=False)
    family = hf_family(cfg)         # before the model is built: a mixed one is refused at once
    model = GPT(cfg)
    checkpoint.load(folder, model, None, ProcessGrid.single())
    masters = {name: to_numpy(param.data)[tuple(slice(0, n) for n in spec.shape)]
               for name, param, spec in model.named_specs()}
    tokenizer = checkpoint.tokenizer_file(folder)      # never a link out of the checkpoint
    bos, eos = _special_token_ids(tokenizer, family)
    write_hf_folder(hf_dir, config_to_hf(cfg, bos, eos), masters_to_hf(masters, cfg), tokenizer)
    return hf_dir


def _special_token_ids(tokenizer_file, family):
    """(bos, eos) ids in a tokenizer.json, each the first of the family's names it holds (GPT-2's
    <|endoftext|> is both), or None."""
    if tokenizer_file is None:
        return None, None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None, None
    try:
        tokenizer = Tokenizer.from_file(tokenizer_file)
    except Exception as error:      # the tokenizers package raises its own exception types
        raise InputError(f"tokenizer file {tokenizer_file} could not be read ({one_line(error)}); the "
                         "checkpoint's tokenizer.json is damaged, so restore it") from None
    first_held = lambda names: next((i for i in map(tokenizer.token_to_id, names) if i is not None), None)  # noqa: E731
    bos_names, eos_names = SPECIAL_TOKENS[family]
    return first_held(bos_names), first_held(eos_names)
