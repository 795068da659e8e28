"""Hugging Face Llama (LlamaForCausalLM) <-> npmegatron, the family's half of convert.py (issue 16):
config.json's fields (transformers 4's and 5's), the tensor names and the q, k, v projections
regrouped into our group-by-group QKV, both ways.

HF's nn.Linear stores (out, in) and ours (in, out), so every *_proj weight is TRANSPOSED; the
embedding and lm_head are (V, h) on both sides. No biases.

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

QKV order. q_proj holds nq query heads and k_proj, v_proj G key/value heads (G = nq without
grouped-query attention), d rows each; HF's query head i attends with key/value head i // r,
r = nq / G (its repeat_kv). Our QKV columns go group by group: for g = 0 .. G-1, query heads
g r .. g r + r - 1, then key head g, then value head g, d columns each, so a contiguous column
shard is whole groups (model.ParallelAttention). Rotary angles need no permutation: HF's Llama
turns channel i with channel i + d/2 (rotate_half), as ours does (autograd/ops/rotary.py).
Meta's original checkpoints pair neighbouring channels instead; HF's own conversion script
permutes their q and k rows before it writes the format read here.

HF's rotary_emb.inv_freq buffers (older transformers saved them) are skipped. A tied Llama
(tie_word_embeddings) has no output layer: its lm_head, if present, must equal embed_tokens.
Written files have "model."-prefixed keys and lm_head.weight when untied, as save_pretrained's.

The decoder is shared with moe.py's Mixtral and Qwen2-MoE: decoder_config_from_hf and
decoder_config_to_hf (the config.json fields), llama_name_map with another family's MLP, and the
QKV joining, which takes Qwen2-MoE's q, k, v biases group by group like the weights' rows.
"""
import json
import re

import numpy

from ..autograd import InputError
from ..config import GPTConfig
from ..safetensors_header import shown as _shown
from .checks import NOT_NEGATIVE, POSITIVE, RATE, check_divides, check_sizes, config_numbers

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
# Every position's rotary angles are tabled (model.RotaryTable), and no weight's shape holds the
# length, so it is bounded here: 2^24 positions is past any Llama's context.
MAX_ROTARY_POSITIONS = 2 ** 24
LLAMA_HEAD = "lm_head.weight"    # LlamaForCausalLM's output layer: outside "model.", as HF names it


def llama_config_from_hf(hf_config):
    """GPTConfig keyword arguments for an HF Llama config.json. Absent fields take LlamaConfig's
    defaults, as transformers would; fewer key/value heads than query heads is grouped-query
    attention. Llama has no hidden dropout; its attention_dropout carries over."""
    return decoder_config_from_hf(hf_config, LLAMA_DEFAULTS, LLAMA_REQUIRED)


def decoder_config_from_hf(hf_config, defaults, required):
    """The GPTConfig keyword arguments of the decoder Llama, Mixtral and Qwen2-MoE share
    (attention, rotary angles, RMSNorm, embeddings; intermediate_size as ffn_hidden_size), absent
    fields taking the family's `defaults` and each field of `required` ({field: (the only value
    supported, why)}) checked strictly."""
    values = {**hf_config, "rope_theta": hf_rope_theta(hf_config, defaults["rope_theta"])}
    get = lambda key: values.get(key, defaults.get(key))   # noqa: E731
    for key, (wanted, why) in required.items():
        if json.dumps(get(key)) != json.dumps(wanted):     # strictly: true is not 1, nor 1.0 an int
            raise InputError(f"config.json has {key} {_shown(get(key))}; npmegatron supports only "
                             f"{json.dumps(wanted)} ({why})")
    tied = get("tie_word_embeddings")
    if type(tied) is not bool:
        raise InputError(f"config.json has tie_word_embeddings {_shown(tied)}; it must be true or false")
    sizes = _llama_sizes(get)
    numbers = config_numbers(get, LLAMA_NUMBERS)
    heads, groups = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    return {"model_family": "llama", "num_layers": sizes["num_hidden_layers"],
            "hidden_size": sizes["hidden_size"], "num_attention_heads": heads,
            "group_query_attention": groups < heads, "num_query_groups": groups,
            "vocab_size": sizes["vocab_size"], "max_position_embeddings": sizes["max_position_embeddings"],
            "ffn_hidden_size": sizes["intermediate_size"], "rotary_base": numbers["rope_theta"],
            "rotary_percent": 1.0, "untie_embeddings_and_output_weights": not tied, "hidden_dropout": 0.0,
            "attention_dropout": numbers["attention_dropout"], "layernorm_epsilon": numbers["rms_norm_eps"],
            "init_method_std": numbers["initializer_range"]}


def hf_rope_theta(hf_config, default):
    """The rotary base of a Llama-like config.json: transformers 4 writes rope_theta (and
    rope_scaling), transformers 5 rope_parameters {"rope_type": "default", "rope_theta": ...}
    (reading either). Only the plain kind is computed here; given both ways, the two must agree,
    since each version of transformers reads its own."""
    theta = hf_config.get("rope_theta", default)
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
    check_sizes(sizes)
    check_divides(sizes, "num_attention_heads", "hidden_size")
    check_divides(sizes, "num_key_value_heads", "num_attention_heads")
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


def llama_config_to_hf(cfg: GPTConfig, bos_token_id=None, eos_token_id=None):
    """A complete config.json for LlamaForCausalLM. Unknown token ids are written null:
    LlamaConfig's defaults (1 and 2) are Llama's own tokenizer's and would name other tokens of
    another vocabulary. Llama has no hidden dropout, so a model trained with one is written without it."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            **decoder_config_to_hf(cfg, bos_token_id, eos_token_id), "intermediate_size": cfg.ffn_hidden_size,
            "head_dim": cfg.head_dim, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
            "pretraining_tp": 1}


def decoder_config_to_hf(cfg: GPTConfig, bos_token_id=None, eos_token_id=None):
    """The config.json fields Llama, Mixtral and Qwen2-MoE share. The rotary base is written both
    ways that transformers 4 (rope_theta) and 5 (rope_parameters) read."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
            "initializer_range": cfg.init_method_std, "rms_norm_eps": cfg.layernorm_epsilon,
            "rope_theta": cfg.rotary_base, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base},
            "attention_dropout": cfg.attention_dropout,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights, "use_cache": True,
            "torch_dtype": cfg.dtype, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}


def llama_name_map(cfg, mlp_names=None):
    """[(HF names without "model.", npmegatron master name, master shape)] of a Llama-like
    configuration in the model's parameter order: one HF tensor a master, but q_proj, k_proj and
    v_proj for the joined QKV (and their biases for its bias); lm_head (its name never prefixed)
    only when the output layer is untied. `mlp_names(cfg, n)` lists layer n's MLP as
    [(HF names under "layers.n.", name under "blocks.n.", shape)]: Llama's dense SwiGLU by default."""
    h, vocab, mlp_names = cfg.hidden_size, cfg.vocab_size, mlp_names or dense_mlp_names
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    attention = [(("input_layernorm.weight",), "ln_1.weight", (h,)),
                 (tuple(f"{name}.weight" for name in projections), "attn.qkv.weight", (h, qkv))]
    if cfg.qkv_bias:
        attention.append((tuple(f"{name}.bias" for name in projections), "attn.qkv.bias", (qkv,)))
    attention += [(("self_attn.o_proj.weight",), "attn.proj.weight", (h, h)),
                  (("post_attention_layernorm.weight",), "ln_2.weight", (h,))]
    names = [(("embed_tokens.weight",), "wte.weight", (vocab, h))]
    if cfg.untie_embeddings_and_output_weights:
        names.append(((LLAMA_HEAD,), "output_layer.weight", (vocab, h)))
    for n in range(cfg.num_layers):
        names += [(tuple(f"layers.{n}.{hf}" for hf in hfs), f"blocks.{n}.{ours}", shape)
                  for hfs, ours, shape in attention + mlp_names(cfg, n)]
    return names + [(("norm.weight",), "ln_f.weight", (h,))]


def dense_mlp_names(cfg, n, hf="mlp", ours="mlp", size=None):
    """A SwiGLU MLP of inner size `size` (default: ffn_hidden_size): HF's gate_proj, up_proj and
    down_proj under `hf`, ours gate, up and proj under `ours`."""
    h, f = cfg.hidden_size, size or cfg.ffn_hidden_size
    return [((f"{hf}.gate_proj.weight",), f"{ours}.gate.weight", (h, f)),
            ((f"{hf}.up_proj.weight",), f"{ours}.up.weight", (h, f)),
            ((f"{hf}.down_proj.weight",), f"{ours}.proj.weight", (f, h))]


def llama_hf_shapes(cfg, names=None):
    """{HF name without "model.": shape} of a Llama-like configuration, as its folder holds them
    (`names` from llama_name_map, Llama's by default)."""
    h, d = cfg.hidden_size, cfg.head_dim
    rows = {"q_proj": cfg.num_attention_heads * d, "k_proj": cfg.num_query_groups * d,
            "v_proj": cfg.num_query_groups * d}
    shapes = {}
    for hf_names, _, shape in names or llama_name_map(cfg):
        for name in hf_names:
            module, kind = name.split(".")[-2:]
            if len(hf_names) == 3:              # q, k or v, of the joined QKV
                shapes[name] = (rows[module], h) if kind == "weight" else (rows[module],)
            else:
                shapes[name] = shape[::-1] if is_linear(name) else shape
    return shapes


def llama_sizes_held(cfg):
    """[(config.json's field, its value, the tensor that holds it, along which axis)] of Llama
    (HF's (out, in) linears). No weight holds max_position_embeddings (llama_config_from_hf bounds it)."""
    groups = f"num_key_value_heads x head_dim ({cfg.num_query_groups} x {cfg.head_dim})"
    return [("vocab_size", cfg.vocab_size, "embed_tokens.weight", 0),
            ("hidden_size", cfg.hidden_size, "embed_tokens.weight", 1),
            ("intermediate_size", cfg.ffn_hidden_size, "layers.0.mlp.gate_proj.weight", 0),
            (groups, cfg.num_query_groups * cfg.head_dim, "layers.0.self_attn.k_proj.weight", 0)]


def is_linear(hf_name):
    """An nn.Linear weight other than lm_head and the routers: stored (out, in) by HF, so
    transposed (Llama's *_proj, Mixtral's experts' w1, w2, w3)."""
    return hf_name.endswith("_proj.weight") or re.search(r"\.w[123]\.weight$", hf_name) is not None


def is_rotary_buffer(name):
    """HF Llama's rotary frequencies (layers.N.self_attn.rotary_emb.inv_freq, or one for the model),
    which older transformers saved with the weights; they follow from rope_theta."""
    return name.endswith("rotary_emb.inv_freq")


def llama_masters(tensors, cfg, names=None):
    """Masters from a checked Llama-like state (`names` from llama_name_map, Llama's by default):
    QKV joined, linears transposed, the rest as they are."""
    masters = {}
    for hf_names, ours, _ in names or llama_name_map(cfg):
        arrays = [tensors[name] for name in hf_names]
        if len(arrays) == 3:
            masters[ours] = qkv_from_llama(*arrays, cfg.num_query_groups)
        else:
            masters[ours] = numpy.ascontiguousarray(arrays[0].T) if is_linear(hf_names[0]) else arrays[0]
    return masters


def llama_state(masters, cfg, names):
    """A Llama-like model's HF state from checked masters: QKV split, linears transposed back."""
    state = {}
    for hf_names, ours, _ in names:
        if len(hf_names) == 3:
            arrays = qkv_to_llama(masters[ours], cfg.num_attention_heads, cfg.num_query_groups)
        else:
            arrays = [numpy.ascontiguousarray(masters[ours].T) if is_linear(hf_names[0]) else masters[ours]]
        state.update({(name if name == LLAMA_HEAD else LLAMA_PREFIX + name): array
                      for name, array in zip(hf_names, arrays)})
    return state


def qkv_from_llama(q, k, v, groups):
    """HF Llama's q_proj (nq d, h), k_proj and v_proj (G d, h), with G = groups -> our QKV weight
    (h, (nq + 2G) d), group by group: the group's nq / G query heads, its key head, its value head.
    Biases ((nq d,), (G d,), (G d,)) are joined the same way, into ((nq + 2G) d,)."""
    if q.ndim == 1:
        return qkv_from_llama(q[:, None], k[:, None], v[:, None], groups)[0]
    h = q.shape[1]
    rows = numpy.concatenate([q.reshape(groups, -1, h), k.reshape(groups, -1, h), v.reshape(groups, -1, h)], axis=1)
    return numpy.ascontiguousarray(rows.reshape(-1, h).T)


def qkv_to_llama(array, heads, groups):
    """Our QKV weight (or bias) -> HF Llama's [q_proj, k_proj, v_proj]: the inverse of qkv_from_llama."""
    if array.ndim == 1:
        return [numpy.ascontiguousarray(part[:, 0]) for part in qkv_to_llama(array[None, :], heads, groups)]
    h, per_group = array.shape[0], heads // groups
    d = array.shape[1] // (heads + 2 * groups)
    rows = array.T.reshape(groups, (per_group + 2) * d, h)
    return [numpy.ascontiguousarray(part.reshape(-1, h))
            for part in numpy.split(rows, [per_group * d, (per_group + 1) * d], axis=1)]
