"""Hugging Face GPT-2, Llama, Mixtral and Qwen2-MoE <-> npmegatron: configurations and weights both
ways (issues 16 and 55), so GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM and
Qwen2MoeForCausalLM weights can be brought in and a trained model taken out. Here the commands and
the checks the families share; hf_convert/gpt2.py, llama.py and moe.py (the two MoE families, on
Llama's decoder) hold the rest.

Only local files, JSON and safetensors are used; `transformers` is not needed. config.json's
model_type says which family a folder holds; a configuration's model_family and MoE layers which
one it is written as. A master is a whole, unsharded, unpadded parameter (module.load_masters sets
any TP rank from it); each family's module lists its names, shapes and QKV order.

A folder from elsewhere is input (issue 26): hf_folder.py checks its files; here config.json's
values are checked and held against the weights' shapes before any model is built from them.
"""
import os

import numpy

from .autograd import InputError
from .autograd.backend import to_numpy
from .checkpointing import checkpoint
from .comm import ProcessGrid
from .config import MODEL_FAMILIES, GPTConfig
from .hf_convert.gpt2 import (LAYER_MATRIX, gpt2_config_from_hf, gpt2_config_to_hf, gpt2_masters, gpt2_sizes_held,
                              gpt2_state, name_map)
from .hf_convert.llama import (LLAMA_HEAD, LLAMA_LAYER_MATRIX, LLAMA_PREFIX, is_rotary_buffer, llama_config_from_hf,
                               llama_config_to_hf, llama_hf_shapes, llama_masters, llama_name_map, llama_sizes_held,
                               llama_state)
from .hf_convert.moe import (mixtral_config_from_hf, moe_config_to_hf, moe_family, moe_name_map, moe_sizes_held,
                             qwen2_moe_config_from_hf, stack_experts, unstack_experts)
from .hf_folder import PREFIX, check_hf_target, inside_folder, is_mask_buffer, read_hf_folder, write_hf_folder
from .model import GPT
from .module import load_masters
from .optim.adamw import AdamW
from .safetensors_header import one_line, shown as _shown

# Each family's config.json field for the layers, the matrices that mark a layer as held, their prefix.
LAYER_COUNTS = {"gpt2": ("n_layer", LAYER_MATRIX, "h"),
                **dict.fromkeys(("llama", "mixtral", "qwen2_moe"), ("num_hidden_layers", LLAMA_LAYER_MATRIX, "layers"))}
# Each family's HF model, and what check_tensors says the folder must hold.
HF_MODELS = {"gpt2": ("GPT2LMHeadModel", "GPT-2", "GPT-2's own tensors (GPT2Model, or GPT2LMHeadModel "
                                                  "with its tied head)"),
             "llama": ("LlamaForCausalLM", "Llama", "Llama's own tensors (LlamaModel, or LlamaForCausalLM)"),
             "mixtral": ("MixtralForCausalLM", "Mixtral", "Mixtral's own tensors (MixtralForCausalLM, its experts "
                                                          "one by one, as save_pretrained writes them)"),
             "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2-MoE", "Qwen2-MoE's own tensors (Qwen2MoeForCausalLM, its "
                                                              "experts one by one, as save_pretrained writes them)")}
# Each config.json model_type's reader, and how the refusal of another names them.
READERS = {"gpt2": gpt2_config_from_hf, "llama": llama_config_from_hf, "mixtral": mixtral_config_from_hf,
           "qwen2_moe": qwen2_moe_config_from_hf}
# The Llama-like families: their names ([(HF names, master, shape)]) and the sizes their tensors hold.
LLAMA_LIKE = {"llama": (llama_name_map, llama_sizes_held), "mixtral": (moe_name_map, moe_sizes_held),
              "qwen2_moe": (moe_name_map, moe_sizes_held)}
# The parts (config.py's flags) a configuration must have to be what the family's HF model computes.
HF_PARTS = {"gpt2": {**MODEL_FAMILIES["gpt2"], "group_query_attention": False},
            "llama": {**{k: v for k, v in MODEL_FAMILIES["llama"].items()
                         if k != "untie_embeddings_and_output_weights"}, "rotary_percent": 1.0}}
# Special tokens a tokenizer.json names: (bos candidates, eos candidates); Llama 2's then Llama 3's.
SPECIAL_TOKENS = {"gpt2": (("<|endoftext|>",), ("<|endoftext|>",)),
                  "llama": (("<s>", "<|begin_of_text|>"), ("</s>", "<|end_of_text|>")),
                  "mixtral": (("<s>",), ("</s>",)), "qwen2_moe": (("<|endoftext|>",), ("<|endoftext|>",))}


def config_from_hf(hf_config):
    """GPTConfig keyword arguments for an HF config.json (a dict) of one of the four families, as
    its model_type says. dtype is left to the caller: it is a choice of the run, and load_masters
    casts the weights to it."""
    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in READERS:
        raise InputError(f"config.json has model_type {_shown(model_type)}; only 'gpt2' (GPT2Model, "
                         "GPT2LMHeadModel), 'llama' (LlamaModel, LlamaForCausalLM), 'mixtral' "
                         "(MixtralForCausalLM) and 'qwen2_moe' (Qwen2MoeForCausalLM) can be converted")
    return READERS[model_type](hf_config)


def hf_family(cfg: GPTConfig):
    """'gpt2', 'llama', 'mixtral' or 'qwen2_moe': which HF model a configuration is (a Llama-family
    one with MoE layers is Mixtral or Qwen2-MoE, as moe_family says). One whose parts were mixed
    (a GPT-2 with rotary positions, a Llama rotating part of each head) is neither, and is refused."""
    family = cfg.model_family
    moe = family == "llama" and cfg.num_experts is not None
    models = "MixtralForCausalLM and Qwen2MoeForCausalLM have" if moe else HF_MODELS[family][0] + " has"
    for key, wanted in HF_PARTS[family].items():
        if getattr(cfg, key) != wanted:
            raise InputError(f"the model has {key} {getattr(cfg, key)!r}, but Hugging Face's {models} "
                             f"{wanted!r}; only a {family} model with its family's own parts can be converted")
    if cfg.num_experts is not None and family == "gpt2":
        raise InputError("the model has MoE layers (--num-experts), but Hugging Face's GPT2LMHeadModel has "
                         "none; only a llama-family MoE model converts (to Mixtral or Qwen2-MoE)")
    if moe:
        return moe_family(cfg)
    if family == "llama" and cfg.add_qkv_bias:
        raise InputError("the model has QKV biases (--add-qkv-bias), but Hugging Face's LlamaForCausalLM has "
                         "biases on all four attention projections or on none; convert a Llama without them")
    return family


def config_to_hf(cfg: GPTConfig, bos_token_id=None, eos_token_id=None):
    """A complete config.json (a dict) for transformers' GPT2LMHeadModel, LlamaForCausalLM,
    MixtralForCausalLM or Qwen2MoeForCausalLM, as hf_family says; token ids are written when
    known (each family's function says what an unknown one becomes)."""
    family = hf_family(cfg)
    writer = {"gpt2": gpt2_config_to_hf, "llama": llama_config_to_hf}.get(family, moe_config_to_hf)
    return writer(cfg, bos_token_id, eos_token_id)


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
    for key, value, name, axis in (LLAMA_LIKE[family][1](cfg) if family in LLAMA_LIKE else gpt2_sizes_held(cfg)):
        shape = tuple(getattr(tensors.get(name), "shape", ()))
        if len(shape) == 2 and shape[axis] != value:
            raise InputError(f"config.json has {key} {value}, but tensor {shown.get(name, name)!r} has shape "
                             f"{shape}; give the config.json saved with these weights")


def masters_from_hf(tensors, cfg):
    """{npmegatron master name: array} from an HF state of the configuration's family ({name: array},
    prefixed or not): GPT-2's QKV columns reordered; the Llama-like families' linears transposed
    and their q, k, v (and biases) joined group by group. Every tensor is checked first, so nothing
    half-converted comes back. Arrays keep their dtype."""
    family = hf_family(cfg)
    llama = family in LLAMA_LIKE
    if llama:
        tensors, shown, lm_head = strip_hf_names(tensors, LLAMA_PREFIX, is_rotary_buffer)
    else:
        tensors, shown, lm_head = strip_hf_names(tensors)
    if llama and cfg.untie_embeddings_and_output_weights and lm_head is not None:
        tensors[LLAMA_HEAD], shown[LLAMA_HEAD], lm_head = lm_head, LLAMA_HEAD, None   # a weight of its own
    check_config_fits(tensors, cfg, shown)
    names = LLAMA_LIKE[family][0](cfg) if llama else None
    shapes = llama_hf_shapes(cfg, names) if llama else {hf: shape for hf, _, shape in name_map(cfg)}
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
    return stack_experts(llama_masters(tensors, cfg, names)) if llama else gpt2_masters(tensors, cfg)


def masters_to_hf(masters, cfg):
    """An HF state from npmegatron masters, as save_pretrained writes it: GPT2LMHeadModel's
    ("transformer."-prefixed, no lm_head: tied) with QKV columns back in HF's order, or a
    Llama-like family's ("model."-prefixed, lm_head when untied) with linears transposed back and
    the QKV split into q_proj, k_proj and v_proj."""
    family = hf_family(cfg)
    if family in LLAMA_LIKE:
        names, masters = LLAMA_LIKE[family][0](cfg), unstack_experts(masters)
        check_tensors(masters, {ours: shape for _, ours, shape in names}, "the npmegatron masters", family=family)
        return llama_state(masters, cfg, names)
    names = name_map(cfg)
    check_tensors(masters, {ours: shape for _, ours, shape in names}, "the npmegatron masters")
    return gpt2_state(masters, cfg, names)


# ---- the two directions of `npmegatron convert` ------------------------------------------------

def read_hf_model(hf_dir):
    """(GPTConfig, masters) of a local HF folder of one of the four families, all of it checked: the
    files, config.json's values and their agreement with the weights' shapes. The dtype is float64 when
    the weights are, else float32 (load_masters casts float16 up)."""
    hf_config, tensors = read_hf_folder(hf_dir)
    dtype = "float64" if any(a.dtype == numpy.float64 for a in tensors.values()) else "float32"
    cfg = GPTConfig(**{**config_from_hf(hf_config), "dtype": dtype})
    return cfg, masters_from_hf(tensors, cfg)


def import_hf(hf_dir, save):
    """A Hugging Face GPT-2, Llama, Mixtral or Qwen2-MoE folder -> a checkpoint in `save` (iteration
    0, AdamW's moments zero, one TP = 1 shard), which training and generation load at any layout
    (resharded on load). The dtype is float64 when the weights are, else float32; a tokenizer.json
    beside them goes along."""
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
    the run's tokenizer.json if it had one) that the family's HF model (hf_family) loads with
    from_pretrained. Under --fp16/--bf16 the float32 master weights are written.
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
