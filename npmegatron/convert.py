"""Hugging Face GPT-2 <-> npmegatron: configurations and weights both ways (issue 16), so GPT-2
weights can be brought in and a trained model taken out. Only local files, JSON and safetensors
are used; `transformers` is not needed.

Weights. A master is a whole, unsharded, unpadded parameter (module.load_masters sets any TP
rank from it). HF's Conv1D stores (in, out) like our layers, so nothing is transposed:

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
from .config import GPTConfig
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


def config_from_hf(hf_config):
    """GPTConfig keyword arguments for an HF GPT-2 config.json (a dict). Absent fields take
    GPT2Config's defaults, as transformers would. hidden_dropout is resid_pdrop (the residual
    branches: two sites a layer against embd_pdrop's one) when the two differ. reorder_and_upcast_attn
    is accepted: it only upcasts the attention scores. dtype is left to the caller: it is a
    choice of the run, and load_masters casts the weights to it."""
    get = lambda key: hf_config.get(key, HF_DEFAULTS.get(key))   # noqa: E731
    if hf_config.get("model_type") != "gpt2":
        raise InputError(f"config.json has model_type {_shown(hf_config.get('model_type'))}; only 'gpt2' "
                         "(GPT2Model, GPT2LMHeadModel) can be converted")
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
    for key, value in sizes.items():
        if not (type(value) is int and 1 <= value <= LARGEST_SIZE) and not (key == "n_inner" and value is None):
            raise InputError(f"config.json has {key} {_shown(value)}; it must be a positive integer "
                             "(at most 2^48)")
    if sizes["n_embd"] % sizes["n_head"]:
        raise InputError(f"config.json has n_head {sizes['n_head']}, which does not divide n_embd "
                         f"{sizes['n_embd']}; give the config.json saved with these weights")
    numbers = _config_numbers(get)
    return {"num_layers": sizes["n_layer"], "hidden_size": sizes["n_embd"],
            "num_attention_heads": sizes["n_head"], "vocab_size": sizes["vocab_size"],
            "max_position_embeddings": positions, "ffn_hidden_size": sizes["n_inner"] or 4 * sizes["n_embd"],
            "hidden_dropout": numbers["resid_pdrop"], "attention_dropout": numbers["attn_pdrop"],
            "layernorm_epsilon": numbers["layer_norm_epsilon"], "init_method_std": numbers["initializer_range"],
            "gelu": ACTIVATIONS[activation]}


def _config_numbers(get):
    """config.json's real-valued fields as floats, each in the range GPT2Config's modules accept
    (a dropout rate in [0, 1)): a string, a boolean, NaN or infinity is refused here rather than
    met inside the model."""
    rate = (lambda x: 0.0 <= x < 1.0, "a number in [0, 1)")
    rules = {"resid_pdrop": rate, "embd_pdrop": rate, "attn_pdrop": rate,
             "layer_norm_epsilon": (lambda x: x > 0.0, "a positive finite number"),
             "initializer_range": (lambda x: x >= 0.0, "a finite number, not negative")}
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


def config_to_hf(cfg: GPTConfig, bos_token_id=None, eos_token_id=None):
    """A complete config.json (a dict) for transformers' GPT2LMHeadModel. Token ids are written
    when known; otherwise a vocabulary too small for GPT2Config's default (50256) gets null, so
    HF does not assume an end-of-text token the vocabulary lacks."""
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
    """[(HF name without prefix, npmegatron master name, master shape)] for a configuration,
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


def qkv_from_hf(array, heads):
    """HF's QKV columns (3, heads, d) -> ours (heads, 3, d); weight or bias (last axis)."""
    lead = array.shape[:-1]
    return numpy.ascontiguousarray(array.reshape(*lead, 3, heads, -1).swapaxes(-3, -2).reshape(array.shape))


def qkv_to_hf(array, heads):
    """Ours (heads, 3, d) -> HF's (3, heads, d): the inverse of qkv_from_hf."""
    lead = array.shape[:-1]
    return numpy.ascontiguousarray(array.reshape(*lead, heads, 3, -1).swapaxes(-3, -2).reshape(array.shape))


def check_tensors(tensors, shapes, source, shown=None):
    """Every expected name present with its shape and floating point, nothing else: one sentence
    for the first fault. `shown` maps a name to how the file spelled it (with its prefix)."""
    shown = shown or {}
    for name, shape in shapes.items():
        if name not in tensors:
            raise InputError(f"{source} has no tensor {name!r} (shape {shape}); it does not hold a "
                             "GPT-2 of this configuration")
        array = tensors[name]
        if tuple(array.shape) != shape:
            raise InputError(f"{source} tensor {shown.get(name, name)!r} has shape {tuple(array.shape)}, "
                             f"but the configuration needs {shape}; check that the config matches the weights")
        if array.dtype.kind != "f":
            raise InputError(f"{source} tensor {shown.get(name, name)!r} has dtype {array.dtype}; "
                             "weights must be floating point")
    for name in tensors:
        if name not in shapes:
            raise InputError(f"{source} has an unexpected tensor {shown.get(name, name)!r}; only GPT-2's "
                             "own tensors (GPT2Model, or GPT2LMHeadModel with its tied head) can be converted")


def strip_hf_names(tensors):
    """HF keys without the "transformer." prefix, mask buffers dropped, lm_head taken out:
    (tensors, how each name was spelled, lm_head or None)."""
    stripped, shown, lm_head = {}, {}, None
    for key, array in tensors.items():
        if key == "lm_head.weight":
            lm_head = array
            continue
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        if is_mask_buffer(name):
            continue
        if name in stripped:
            raise InputError(f"the Hugging Face checkpoint holds {name!r} twice (as {shown[name]!r} and "
                             f"{key!r}); keep one of them")
        stripped[name], shown[name] = array, key
    return stripped, shown, lm_head


def check_config_fits(tensors, cfg, shown):
    """config.json's sizes against the shapes of the weights ({name: array}, unprefixed), before
    anything is built from them: a config that disagrees, or asks for absurd sizes, is named here
    rather than met as a wrong model or a huge allocation. A layer is held when one of its two
    matrices is; missing pieces are check_tensors' to name."""
    held = sorted({int(m.group(1)) for name in tensors if (m := LAYER_MATRIX.fullmatch(name))})
    if cfg.num_layers != len(held):
        listed = ", ".join(f"h.{n}" for n in held[:4]) + (", ..." if len(held) > 4 else "")
        raise InputError(f"config.json has n_layer {cfg.num_layers}, but the weights' layers are "
                         f"{listed or 'none'} ({len(held)} in all); give the config.json saved with these weights")
    sizes = [("vocab_size", cfg.vocab_size, "wte.weight", 0), ("n_embd", cfg.hidden_size, "wte.weight", 1),
             ("n_positions", cfg.max_position_embeddings, "wpe.weight", 0),
             ("n_inner (or 4 x n_embd)", cfg.ffn_hidden_size, "h.0.mlp.c_fc.weight", 1)]
    for key, value, name, axis in sizes:
        shape = tuple(getattr(tensors.get(name), "shape", ()))
        if len(shape) == 2 and shape[axis] != value:
            raise InputError(f"config.json has {key} {value}, but tensor {shown.get(name, name)!r} has shape "
                             f"{shape}; give the config.json saved with these weights")


def masters_from_hf(tensors, cfg):
    """{npmegatron master name: array} from an HF GPT-2 state ({name: array}, prefixed or not),
    QKV columns reordered; every tensor checked first, so nothing half-converted comes back.
    Arrays keep their dtype."""
    tensors, shown, lm_head = strip_hf_names(tensors)
    check_config_fits(tensors, cfg, shown)
    names = name_map(cfg)
    check_tensors(tensors, {hf: shape for hf, _, shape in names}, "the Hugging Face checkpoint", shown)
    for name, array in tensors.items():     # a damaged file or an overflowed float16 cast
        if not numpy.isfinite(array).all():
            raise InputError(f"the Hugging Face checkpoint's tensor {shown.get(name, name)!r} holds NaN or "
                             "infinite values; convert an undamaged copy of the model")
    if lm_head is not None and not (lm_head.shape == tensors["wte.weight"].shape
                                    and numpy.array_equal(lm_head, tensors["wte.weight"])):
        raise InputError("the Hugging Face checkpoint's lm_head.weight differs from wte.weight; npmegatron's "
                         "output layer is tied to the token embedding, so an untied head cannot be converted")
    heads = cfg.num_attention_heads
    return {ours: qkv_from_hf(tensors[hf], heads) if ".attn.c_attn." in hf else tensors[hf] for hf, ours, _ in names}


def masters_to_hf(masters, cfg):
    """An HF GPT2LMHeadModel state ({"transformer."-prefixed name: array}, no lm_head: tied, as
    save_pretrained writes it) from npmegatron masters, QKV columns back in HF's order."""
    names = name_map(cfg)
    check_tensors(masters, {ours: shape for _, ours, shape in names}, "the npmegatron masters")
    heads = cfg.num_attention_heads
    return {PREFIX + hf: qkv_to_hf(masters[ours], heads) if ".attn.qkv." in ours else masters[ours]
            for hf, ours, _ in names}


# ---- the two directions of `npmegatron convert` ------------------------------------------------

def read_hf_model(hf_dir):
    """(GPTConfig, masters) of a local HF GPT-2 folder, all of it checked: the files, config.json's
    values and their agreement with the weights' shapes. The dtype is float64 when the weights
    are, else float32 (load_masters casts float16 up)."""
    hf_config, tensors = read_hf_folder(hf_dir)
    dtype = "float64" if any(a.dtype == numpy.float64 for a in tensors.values()) else "float32"
    cfg = GPTConfig(**{**config_from_hf(hf_config), "dtype": dtype})
    return cfg, masters_from_hf(tensors, cfg)


def import_hf(hf_dir, save):
    """A Hugging Face GPT-2 folder -> a checkpoint in `save` (iteration 0, AdamW's moments zero,
    one TP = 1 shard), which training and generation load at any layout (resharded on load). The
    dtype is float64 when the weights are, else float32; a tokenizer.json beside them goes along."""
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
    """A checkpoint saved at any layout -> a Hugging Face GPT-2 folder (config.json,
    model.safetensors, the run's tokenizer.json if it had one) that GPT2LMHeadModel.from_pretrained
    loads. Under --fp16/--bf16 the float32 master weights are written. A folder that already holds
    weights is written into only with `overwrite`."""
    check_hf_target(hf_dir, overwrite)
    folder, manifest = checkpoint.read_manifest(load)
    cfg = checkpoint.saved_config(manifest, fp16=False, bf16=False, sequence_parallel=False,
                                  device="cpu", tf32=False)
    model = GPT(cfg)
    checkpoint.load(folder, model, None, ProcessGrid.single())
    masters = {name: to_numpy(param.data)[tuple(slice(0, n) for n in spec.shape)]
               for name, param, spec in model.named_specs()}
    tokenizer = checkpoint.tokenizer_file(folder)      # never a link out of the checkpoint
    eos = _end_of_text_id(tokenizer)
    write_hf_folder(hf_dir, config_to_hf(cfg, eos, eos), masters_to_hf(masters, cfg), tokenizer)
    return hf_dir


def _end_of_text_id(tokenizer_file):
    """<|endoftext|>'s id in a tokenizer.json (GPT-2's bos and eos), or None."""
    if tokenizer_file is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        return Tokenizer.from_file(tokenizer_file).token_to_id("<|endoftext|>")
    except Exception as error:      # the tokenizers package raises its own exception types
        raise InputError(f"tokenizer file {tokenizer_file} could not be read ({one_line(error)}); the "
                         "checkpoint's tokenizer.json is damaged, so restore it") from None
