"""A Hugging Face model folder, as save_pretrained writes it, read and written (issue 16) with
every file treated as input (issue 26): config.json and the shard index are checked JSON objects,
weight files are plain .safetensors names inside the folder (nothing outside it is opened), each
safetensors header is checked before its file is loaded, and a folder that already holds weights
is not written over unless asked. What the tensors mean is convert.py's (and hf_convert/'s).
"""
import json
import os
import re
import shutil

import numpy
from safetensors.numpy import save_file

from . import safetensors_header
from .autograd import InputError
from .safetensors_header import one_line, shown

PREFIX = "transformer."
MASK_BUFFERS = ("attn.bias", "attn.masked_bias")   # old transformers saved these with the weights
INDEX = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"[^/\\\x00]+\.safetensors")   # a plain file name: no folder, no '..', no NUL
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")     # BF16 is widened to float32 on reading
FIX = "save the model again in float32 with model.float().save_pretrained(DIR)"
MAX_JSON_BYTES = 10 * 2 ** 20   # config.json and the shard index are kilobytes


def is_mask_buffer(name):
    """HF's causal-mask buffers (h.N.attn.bias, h.N.attn.masked_bias), with or without the prefix."""
    name = name[len(PREFIX):] if name.startswith(PREFIX) else name
    return name.startswith("h.") and name.split(".", 2)[-1] in MASK_BUFFERS


def read_hf_folder(path):
    """(config.json as a dict, {name: array}) of a local HF folder: model.safetensors, or the
    shards a model.safetensors.index.json lists (save_pretrained splits large models). Nothing
    outside the folder is opened, and each safetensors header is checked before its file is
    loaded. Pickled weights (pytorch_model.bin) are not read: unpickling runs arbitrary code."""
    if not os.path.isdir(path):
        raise InputError(f"{path} is not a folder; give the folder that save_pretrained wrote")
    config_path = inside_folder(path, "config.json")
    if not os.path.isfile(config_path):
        raise InputError(f"{config_path} does not exist; a Hugging Face model folder holds config.json "
                         "and model.safetensors, as save_pretrained writes them")
    hf_config, tensors = read_json_object(config_path), {}
    for name, listed in _weight_files(path).items():
        tensors.update(_read_weights(path, name, listed))
    return hf_config, tensors


def inside_folder(folder, name):
    """folder/name, refused when a symbolic link leads it outside `folder`: a folder from elsewhere
    must not make the converter read (or copy into a checkpoint) a file it does not hold."""
    path = os.path.join(folder, name)
    real = os.path.realpath(folder)
    if os.path.commonpath([real, os.path.realpath(path)]) != real:
        raise InputError(f"{path} leads outside {folder} through a symbolic link; copy the real file into "
                         "the folder")
    return path


def _weight_files(path):
    """{safetensors file name: the tensor names the index puts in it, or None for a single
    model.safetensors}. An index name must be a plain .safetensors file name: '../x', '/x' and
    'sub/x' are refused before anything is opened."""
    index_path = os.path.join(path, INDEX)
    if os.path.isfile(os.path.join(path, "model.safetensors")) or not os.path.isfile(index_path):
        return {"model.safetensors": None}
    weight_map = read_json_object(inside_folder(path, INDEX)).get("weight_map")
    if not (isinstance(weight_map, dict) and weight_map):
        raise InputError(f"{index_path} has no weight_map object naming the weights' files; write the folder "
                         "again with save_pretrained")
    files = {}
    for tensor, name in weight_map.items():
        if not (isinstance(name, str) and SHARD_NAME.fullmatch(name)):
            raise InputError(f"{index_path} puts tensor {shown(tensor)} in {shown(name)}, which is not the "
                             "name of a .safetensors file in the folder itself; write the folder again with "
                             "save_pretrained")
        files.setdefault(name, set()).add(tensor)
    return files


def _read_weights(folder, name, listed):
    """{name: array} of one safetensors file of the folder, its header checked first: every
    weight in F16, BF16, F32 or F64 and, for a shard, the tensors the index puts in it (so a tensor
    saved twice cannot silently replace another)."""
    path = inside_folder(folder, name)
    if not os.path.isfile(path):
        if listed is not None:
            raise InputError(f"{path} does not exist, but {INDEX} puts tensors in it; copy the whole folder "
                             "that save_pretrained wrote")
        raise InputError(f"{path} does not exist; save the model with save_pretrained(..., "
                         "safe_serialization=True) to get safetensors weights (pickled .bin files are not read)")
    entries = safetensors_header.read_header(path, FIX)
    for tensor, (dtype, _, _) in entries.items():
        if dtype not in WEIGHT_DTYPES and not is_mask_buffer(tensor):
            raise InputError(f"{path}: tensor {shown(tensor)} has dtype {dtype}, but npmegatron reads "
                             f"{', '.join(WEIGHT_DTYPES)} weights; {FIX}")
    if listed is not None and set(entries) != listed:
        missing, stray = sorted(listed - set(entries)), sorted(set(entries) - listed)
        lie = f"lacks {shown(missing[0])}" if missing else f"holds {shown(stray[0])}, which the index puts elsewhere"
        raise InputError(f"{path} {lie} ({INDEX} lists what each file holds); copy the whole folder that "
                         "save_pretrained wrote")
    return safetensors_header.load(path, FIX, entries)


def read_json_object(path):
    """A JSON file that must hold one object (config.json, the shard index)."""
    size = os.path.getsize(path)
    if size > MAX_JSON_BYTES:
        raise InputError(f"{path} holds {size} bytes, far more than a configuration; give the folder's own file")
    try:
        with open(path, encoding="utf-8") as file:
            value = json.load(file)
    except (ValueError, RecursionError) as error:      # UnicodeDecodeError is a ValueError
        raise InputError(f"{path} is not valid JSON ({one_line(error)}); give the folder's own file") from None
    except OSError as error:
        raise InputError(f"{path} cannot be read ({error.strerror}); give the folder's own file") from None
    if not isinstance(value, dict):
        raise InputError(f"{path} holds a JSON {type(value).__name__}, not an object; give the folder's own file")
    return value


def write_hf_folder(path, hf_config, tensors, tokenizer_file=None):
    """Write config.json, model.safetensors and (given one) tokenizer.json into `path`, so that
    transformers' from_pretrained(path) loads it. The {"format": "pt"} metadata is what
    transformers checks before it accepts a safetensors file as PyTorch weights. Every file is
    written under a .partial name first and renamed once all are whole, so a failure (a full
    disk) leaves no half-written file and replaces nothing."""
    if tokenizer_file is not None and not os.path.isfile(tokenizer_file):
        raise InputError(f"tokenizer file {tokenizer_file} does not exist; give the tokenizer.json the run used")
    writers = {"config.json": lambda target: _write_json(target, hf_config),
               "model.safetensors": lambda target: save_file(
                   {name: numpy.ascontiguousarray(array) for name, array in tensors.items()}, target,
                   metadata={"format": "pt"})}
    if tokenizer_file is not None:
        writers["tokenizer.json"] = lambda target: shutil.copyfile(tokenizer_file, target)
    created, partials = not os.path.exists(path), {name: os.path.join(path, name + ".partial") for name in writers}
    try:
        os.makedirs(path, exist_ok=True)
        for name, write in writers.items():
            write(partials[name])
    except BaseException as error:
        for partial in partials.values():
            if os.path.lexists(partial):
                os.remove(partial)
        if created and os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)
        if isinstance(error, OSError):
            raise InputError(f"cannot write the Hugging Face folder {path} ({error.strerror}); choose a "
                             "writable folder with room for the weights") from None
        raise
    for name, partial in partials.items():
        os.replace(partial, os.path.join(path, name))


def _write_json(path, value):
    with open(path, "w", encoding="utf-8") as file:
        json.dump(value, file, indent=2)
        file.write("\n")


def check_hf_target(hf_dir, overwrite):
    """--to-hf may not replace the config or weights a folder already holds unless --overwrite
    asks it to: they may be the only copy of another model."""
    if os.path.lexists(hf_dir) and not os.path.isdir(hf_dir):
        raise InputError(f"--to-hf {hf_dir} is a file, not a folder; give a folder to write the model into")
    try:
        held = sorted(name for name in (os.listdir(hf_dir) if os.path.isdir(hf_dir) else ())
                      if name in ("config.json", INDEX) or name.endswith(".safetensors"))
    except OSError as error:
        raise InputError(f"--to-hf {hf_dir} cannot be read ({error.strerror}); give a folder you can write") from None
    if held and not overwrite:
        raise InputError(f"--to-hf {hf_dir} already holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}; "
                         "give a new folder, or add --overwrite to replace them")
