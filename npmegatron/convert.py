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
"""
import json
import os
import shutil

import numpy
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from .autograd import InputError
from .config import GPTConfig

PREFIX = "transformer."
MASK_BUFFERS = ("attn.bias", "attn.masked_bias")   # old transformers saved these with the weights
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


def config_from_hf(hf_config):
    """GPTConfig keyword arguments for an HF GPT-2 config.json (a dict). Absent fields take
    GPT2Config's defaults, as transformers would. hidden_dropout is resid_pdrop (the residual
    branches: two sites a layer against embd_pdrop's one) when the two differ. reorder_and_upcast_attn
    is accepted: it only upcasts the attention scores. dtype is left to the caller: it is a
    choice of the run, and load_masters casts the weights to it."""
    get = lambda key: hf_config.get(key, HF_DEFAULTS.get(key))   # noqa: E731
    if hf_config.get("model_type") != "gpt2":
        raise InputError(f"config.json has model_type {hf_config.get('model_type')!r}; only 'gpt2' "
                         "(GPT2Model, GPT2LMHeadModel) can be converted")
    for key, wanted in REQUIRED.items():
        if get(key) != wanted:
            raise InputError(f"config.json has {key} {get(key)!r}; npmegatron supports only "
                             f"{json.dumps(wanted)} (GPT-2's own layout)")
    activation = get("activation_function")
    if activation not in ACTIVATIONS:
        raise InputError(f"config.json has activation_function {activation!r}; npmegatron supports "
                         f"{', '.join(map(repr, ACTIVATIONS))}")
    positions = hf_config.get("n_positions", hf_config.get("n_ctx", HF_DEFAULTS["n_positions"]))
    sizes = {"n_layer": get("n_layer"), "n_embd": get("n_embd"), "n_head": get("n_head"),
             "vocab_size": get("vocab_size"), "n_positions": positions, "n_inner": get("n_inner")}
    for key, value in sizes.items():
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1) \
                and not (key == "n_inner" and value is None):
            raise InputError(f"config.json has {key} {value!r}; it must be a positive integer")
    return {"num_layers": sizes["n_layer"], "hidden_size": sizes["n_embd"],
            "num_attention_heads": sizes["n_head"], "vocab_size": sizes["vocab_size"],
            "max_position_embeddings": positions, "ffn_hidden_size": sizes["n_inner"] or 4 * sizes["n_embd"],
            "hidden_dropout": get("resid_pdrop"), "attention_dropout": get("attn_pdrop"),
            "layernorm_epsilon": get("layer_norm_epsilon"), "init_method_std": get("initializer_range"),
            "gelu": ACTIVATIONS[activation]}


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
        if name.startswith("h.") and name.split(".", 2)[-1] in MASK_BUFFERS:
            continue
        if name in stripped:
            raise InputError(f"the Hugging Face checkpoint holds {name!r} twice (as {shown[name]!r} and "
                             f"{key!r}); keep one of them")
        stripped[name], shown[name] = array, key
    return stripped, shown, lm_head


def masters_from_hf(tensors, cfg):
    """{npmegatron master name: array} from an HF GPT-2 state ({name: array}, prefixed or not),
    QKV columns reordered; every tensor checked first, so nothing half-converted comes back.
    Arrays keep their dtype."""
    tensors, shown, lm_head = strip_hf_names(tensors)
    names = name_map(cfg)
    check_tensors(tensors, {hf: shape for hf, _, shape in names}, "the Hugging Face checkpoint", shown)
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


def read_hf_folder(path):
    """(config.json as a dict, {name: array}) of a local HF folder: model.safetensors, or the
    shards a model.safetensors.index.json lists (save_pretrained splits large models). Pickled
    weights (pytorch_model.bin) are not read: unpickling runs arbitrary code."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise InputError(f"{config_path} does not exist; a Hugging Face GPT-2 folder holds config.json "
                         "and model.safetensors, as save_pretrained writes them")
    hf_config, files = read_json_object(config_path), ["model.safetensors"]
    index_path = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(os.path.join(path, files[0])) and os.path.isfile(index_path):
        weight_map = read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise InputError(f"{index_path} has no weight_map object; write the folder again with save_pretrained")
        files = sorted(set(map(str, weight_map.values())))
    tensors = {}
    for name in files:
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise InputError(f"{file_path} does not exist; save the model with save_pretrained(..., "
                             "safe_serialization=True) to get safetensors weights (pickled .bin files are not read)")
        try:
            tensors.update(load_file(file_path))
        except (SafetensorError, OSError, ValueError, TypeError) as error:
            raise InputError(f"{file_path} cannot be read as float16/32/64 safetensors ({error}); save "
                             "the model again in float32 with model.float().save_pretrained(DIR)") from None
    return hf_config, tensors


def read_json_object(path):
    """A JSON file that must hold one object (config.json, the shard index)."""
    try:
        with open(path, encoding="utf-8") as file:
            value = json.load(file)
    except (ValueError, UnicodeDecodeError) as error:
        raise InputError(f"{path} is not valid JSON ({error}); give the folder's own file") from None
    if not isinstance(value, dict):
        raise InputError(f"{path} holds a JSON {type(value).__name__}, not an object; give the folder's own file")
    return value


def write_hf_folder(path, hf_config, tensors, tokenizer_file=None):
    """Write config.json, model.safetensors and (given one) tokenizer.json into `path`, so that
    transformers' from_pretrained(path) loads it. The {"format": "pt"} metadata is what
    transformers checks before it accepts a safetensors file as PyTorch weights."""
    if tokenizer_file is not None and not os.path.isfile(tokenizer_file):
        raise InputError(f"tokenizer file {tokenizer_file} does not exist; give the tokenizer.json the run used")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as file:
        json.dump(hf_config, file, indent=2)
        file.write("\n")
    save_file({name: numpy.ascontiguousarray(array) for name, array in tensors.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, os.path.join(path, "tokenizer.json"))


# ---- the two directions of `npmegatron convert` ------------------------------------------------

def import_hf(hf_dir, save):
    """A Hugging Face GPT-2 folder -> a checkpoint in `save` (iteration 0, AdamW's moments zero,
    one TP = 1 shard), which training and generation load at any layout (resharded on load). The
    dtype is float64 when the weights are, else float32; a tokenizer.json beside them goes along."""
    import uuid

    from .comm import ProcessGrid
    from .model import GPT
    from .module import load_masters
    from .training import checkpoint
    from .training.optimizer import AdamW
    if os.path.isdir(save) and os.listdir(save):
        raise InputError(f"--save {save} is not empty; give a new folder for the converted checkpoint")
    hf_config, tensors = read_hf_folder(hf_dir)
    dtype = "float64" if any(a.dtype == numpy.float64 for a in tensors.values()) else "float32"
    cfg = GPTConfig(**{**config_from_hf(hf_config), "dtype": dtype})
    model = GPT(cfg)
    load_masters(model, masters_from_hf(tensors, cfg))
    tokenizer = os.path.join(hf_dir, "tokenizer.json")
    has_tokenizer = os.path.isfile(tokenizer)
    os.makedirs(save, exist_ok=True)
    extra = {"run_id": uuid.uuid4().hex, "pipeline_layout": None, "converted_from": os.path.abspath(hf_dir),
             "data": {"consumed_samples": 0, "global_batch_size": None, "seed": cfg.seed, "data_path": None},
             "tokenizer": {"type": "huggingface"} if has_tokenizer else {"type": "bytes"}, "args": {}}
    return checkpoint.save(save, 0, model, AdamW(model.parameters()), ProcessGrid.single(), extra,
                           {"tokenizer.json": tokenizer} if has_tokenizer else {})


def export_hf(load, hf_dir):
    """A checkpoint saved at any layout -> a Hugging Face GPT-2 folder (config.json,
    model.safetensors, the run's tokenizer.json if it had one) that GPT2LMHeadModel.from_pretrained
    loads. Under --fp16/--bf16 the float32 master weights are written."""
    from .autograd.backend import to_numpy
    from .comm import ProcessGrid
    from .model import GPT
    from .training import checkpoint
    folder, manifest = checkpoint.read_manifest(load)
    cfg = checkpoint.saved_config(manifest, fp16=False, bf16=False, sequence_parallel=False,
                                  device="cpu", tf32=False)
    model = GPT(cfg)
    checkpoint.load(folder, model, None, ProcessGrid.single())
    masters = {name: to_numpy(param.data)[tuple(slice(0, n) for n in spec.shape)]
               for name, param, spec in model.named_specs()}
    tokenizer = os.path.join(folder, "tokenizer.json")
    tokenizer = tokenizer if os.path.isfile(tokenizer) else None
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
    return Tokenizer.from_file(tokenizer_file).token_to_id("<|endoftext|>")
