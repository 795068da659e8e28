"""A checkpoint's manifest.json is input: checkpoints are downloaded and shared, so every field is
checked here before any of it is used and before any shard is opened. A lie is one sentence naming
the manifest and the field, never a traceback, a file opened outside the checkpoint folder, or a
silently different model.

`check(manifest, folder, path)` checks everything that needs no model; `check_places_fit(...)`
checks the shards' places against the model a run built. `shard_path` is the one way a shard
name from a manifest becomes a path.
"""
import dataclasses
import math
import os
import re
import typing

from ..autograd import InputError
from ..config import GPTConfig

FORMAT = "npmegatron-checkpoint-1"
ITERATION_FOLDER = re.compile(r"iter_[0-9]{7}")
SHARD_FILE = re.compile(r"mp_rank_([0-9]{2})_([0-9]{3})(_[0-9]{3})?\.safetensors")
SHA256 = re.compile(r"[0-9a-f]{64}")
STRUCTURE = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
             "max_position_embeddings", "ffn_hidden_size")
TOKENIZERS = ("bytes", "huggingface")
LARGEST_SIZE = 2 ** 48      # no axis, count or byte size of a real checkpoint comes near this
FIX = "the checkpoint is corrupt or was altered, so load one you trust"


def shard_name(tp_rank, pp_rank, ep_rank=None):
    """The file a (TP rank, PP rank) position's shard is saved as, and under expert parallelism
    (ep_rank given) each expert-parallel rank's: the only names loading accepts."""
    ep = "" if ep_rank is None else f"_{ep_rank:03d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}{ep}.safetensors"


def inside(folder, name, what):
    """folder/name, after making sure it stays inside `folder` once links are resolved; `what`
    names the file for the sentence."""
    path = os.path.join(folder, name)
    real_folder = os.path.realpath(folder)
    if os.path.commonpath([real_folder, os.path.realpath(path)]) != real_folder:
        raise InputError(f"{what} {path} leads outside the checkpoint folder {folder} (through a "
                         f"symbolic link); {FIX}")
    return path


def shard_path(folder, name, manifest_path):
    """The path of a shard the manifest names: a plain file name the saver writes, inside `folder`.
    Checked before anything is opened: a name like '../x.safetensors' never reaches open()."""
    if not (isinstance(name, str) and SHARD_FILE.fullmatch(name)):
        raise InputError(f"checkpoint manifest {manifest_path}: 'shards' names {_shown(name)}, which is "
                         "not a shard file name the saver writes (mp_rank_TT_PPP.safetensors, inside "
                         f"the checkpoint folder); {FIX}")
    return inside(folder, name, "checkpoint shard")


def _shown(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _lie(path, field, value, expected):
    return InputError(f"checkpoint manifest {path}: {field} is {_shown(value)}, but it must be "
                      f"{expected}; {FIX}")


def _integer(value, path, field, minimum=0, maximum=LARGEST_SIZE):
    if type(value) is not int or not minimum <= value <= maximum:
        raise _lie(path, field, value, f"an integer from {minimum} to {maximum}")
    return value


def _number(value, path, field, minimum=0.0, positive=False):
    if (type(value) not in (int, float) or not math.isfinite(value) or value < minimum
            or (positive and value <= 0)):
        raise _lie(path, field, value, f"a finite number {'above' if positive else 'at least'} {minimum}")
    return value


def _mapping(value, path, field, required=()):
    if not isinstance(value, dict):
        raise _lie(path, field, value, "a JSON object")
    for key in required:
        if key not in value:
            raise InputError(f"checkpoint manifest {path}: {field} has no {key!r} entry; {FIX}")
    return value


def _optional_text(value, path, field):
    if value is not None and not isinstance(value, str):
        raise _lie(path, field, value, "a string or null")


def check(manifest, folder, path):
    """Every field a load, a resume, generation or conversion reads, checked against the form the
    saver writes. Raises InputError naming the manifest and the field."""
    if isinstance(manifest, dict) and "grid" not in manifest and "layout" in manifest:
        manifest["grid"] = manifest.pop("layout")      # the grid's name in earlier checkpoints
    _mapping(manifest, path, "the manifest", ("format", "iteration", "model", "grid", "optimizer",
                                              "ranks", "shards"))
    if manifest["format"] != FORMAT:
        raise InputError(f"{path} is not an npmegatron checkpoint manifest (format "
                         f"{_shown(manifest['format'])}, expected {FORMAT!r})")
    _check_iteration(manifest["iteration"], folder, path)
    check_model(manifest["model"], path)
    grid = _mapping(manifest["grid"], path, "'grid'", ("tp", "pp", "dp"))
    for axis in ("tp", "pp", "dp", "cp", "ep"):
        if axis in grid:        # "cp", "ep": recorded by runs with context or expert parallelism
            _integer(grid[axis], path, f"grid {axis}", minimum=1, maximum=2 ** 16)
    _check_optimizer(manifest["optimizer"], path)
    _check_ranks(manifest["ranks"], grid, path)
    _check_shards(manifest["shards"], grid, folder, path)
    _check_run(manifest, path)
    _check_expert_bias(manifest.get("expert_bias", {}), path)


def _check_iteration(iteration, folder, path):
    _integer(iteration, path, "'iteration'")
    name = os.path.basename(os.path.normpath(folder)).removesuffix(".old")
    if ITERATION_FOLDER.fullmatch(name) and int(name[len("iter_"):]) != iteration:
        raise InputError(f"checkpoint manifest {path}: 'iteration' is {iteration}, but its folder is "
                         f"{name}; {FIX}")


def check_model(model, path):
    """The saved model's configuration: each field this version knows has its type, and together
    they pass the same checks as the command line's flags."""
    _mapping(model, path, "'model'", STRUCTURE)
    known = {spec.name: spec for spec in dataclasses.fields(GPTConfig)}
    for name, value in model.items():
        if name in known and not _has_type(value, known[name].type):
            raise _lie(path, f"model {name}", value, f"of type {_type_name(known[name].type)}")
    for name in STRUCTURE:
        _integer(model[name], path, f"model {name}", minimum=1)
    try:
        GPTConfig(**{k: v for k, v in model.items() if k in known})
    except InputError as e:
        raise InputError(f"checkpoint manifest {path}: the saved model is invalid ({e}); {FIX}") from None


def _has_type(value, annotation):
    allowed = typing.get_args(annotation) or (annotation,)
    for kind in allowed:
        if kind is type(None) and value is None:
            return True
        if kind is float and type(value) in (int, float):
            return math.isfinite(value)
        if kind is not float and type(value) is kind:
            return True
    return False


def _type_name(annotation):
    return " or ".join("null" if t is type(None) else t.__name__
                       for t in (typing.get_args(annotation) or (annotation,)))


def _check_optimizer(optimizer, path):
    _mapping(optimizer, path, "'optimizer'", ("step",))
    _integer(optimizer["step"], path, "optimizer step")
    for key in ("eps", "weight_decay"):
        if key in optimizer:
            _number(optimizer[key], path, f"optimizer {key}")
    betas = optimizer.get("betas", [0.9, 0.999])
    if not (isinstance(betas, list) and len(betas) == 2
            and all(type(b) in (int, float) and 0 <= b < 1 for b in betas)):
        raise _lie(path, "optimizer betas", betas, "two numbers in [0, 1)")


def _check_ranks(ranks, grid, path):
    world = grid["tp"] * grid["pp"] * grid["dp"] * grid.get("cp", 1)
    if not (isinstance(ranks, list) and len(ranks) == world):
        raise _lie(path, "'ranks'", ranks, f"a list of {world} records, one per rank of its grid")
    for i, record in enumerate(ranks):
        _mapping(record, path, f"ranks[{i}]", ("rng",))
        rng = _mapping(record["rng"], path, f"ranks[{i}] rng", ("iteration", "micro_batch"))
        if set(rng) == {"iteration", "micro_batch"}:      # else an older format set_states names
            _integer(rng["iteration"], path, f"ranks[{i}] rng iteration")
            _integer(rng["micro_batch"], path, f"ranks[{i}] rng micro_batch")


def _check_shards(shards, grid, folder, path):
    """One shard per (TP rank, PP rank) of the saving grid (and EP rank, under expert
    parallelism), each named as the saver names it, with its size, checksum and the places of its
    tensors."""
    _mapping(shards, path, "'shards'")
    for name in shards:
        shard_path(folder, name, path)
    ep = grid.get("ep", 1)
    expected = {shard_name(t, p, e if ep > 1 else None) for t in range(grid["tp"]) for p in range(grid["pp"])
                for e in range(ep)}
    if set(shards) != expected:
        odd = sorted(set(shards) ^ expected)[0]
        raise InputError(f"checkpoint manifest {path}: 'shards' does not list one shard per TP, PP "
                         f"and EP rank of grid {grid} ({odd} is {'extra' if odd in shards else 'missing'}); "
                         f"{FIX}")
    for name, info in shards.items():
        _mapping(info, path, f"shard {name}", ("bytes", "sha256"))
        _integer(info["bytes"], path, f"shard {name} bytes")
        if not (isinstance(info["sha256"], str) and SHA256.fullmatch(info["sha256"])):
            raise _lie(path, f"shard {name} sha256", info["sha256"], "64 hexadecimal digits")
        if "places" in info:
            _check_places(info["places"], path, name)
    if all("places" in info for info in shards.values()):
        _check_places_agree(shards, path)


def _check_places(places, path, shard):
    """{parameter: [[start, stop] per axis]}: intervals of integers with start < stop."""
    _mapping(places, path, f"shard {shard} places")
    for name, place in places.items():
        if not (isinstance(place, list) and 1 <= len(place) <= 8 and all(
                isinstance(axis, list) and len(axis) == 2 and all(type(v) is int for v in axis)
                and 0 <= axis[0] < axis[1] <= LARGEST_SIZE for axis in place)):
            raise _lie(path, f"the place of {name} in shard {shard}", place,
                       "one [start, stop] interval per axis, 0 <= start < stop")


def _check_places_agree(shards, path):
    """Two shards' pieces of one parameter are the same piece (a replicated parameter) or do not
    meet, so every element is read from one place, never from two that disagree."""
    seen = {}
    for shard, info in sorted(shards.items()):
        for name, place in info["places"].items():
            for other_shard, other in seen.get(name, ()):
                if len(other) != len(place):
                    raise InputError(f"checkpoint manifest {path}: parameter {name} has {len(other)} "
                                     f"axes in shard {other_shard} but {len(place)} in {shard}; {FIX}")
                if other != place and all(lo < their_hi and their_lo < hi
                                          for (lo, hi), (their_lo, their_hi) in zip(place, other)):
                    raise InputError(f"checkpoint manifest {path}: shards {other_shard} and {shard} hold "
                                     f"overlapping but different pieces of parameter {name}; {FIX}")
            seen.setdefault(name, []).append((shard, place))


def _check_run(manifest, path):
    """What a resume and generation read besides the model: run id, data position, loss scaling,
    tokenizer and the saved arguments."""
    _optional_text(manifest.get("run_id"), path, "'run_id'")
    _optional_text(manifest.get("pipeline_layout"), path, "'pipeline_layout'")
    _integer(manifest.get("skipped_iterations", 0), path, "'skipped_iterations'")
    data = _mapping(manifest.get("data", {}), path, "'data'")
    if data.get("global_batch_size") is not None:
        _integer(data["global_batch_size"], path, "data global_batch_size", minimum=1)
    _integer(data.get("consumed_samples", 0), path, "data consumed_samples")
    scale = manifest.get("loss_scale")
    if scale is not None:
        _mapping(scale, path, "'loss_scale'", ("scale",))
        _number(scale["scale"], path, "loss_scale scale", positive=True)
        for key in ("good_steps", "overflows_left"):
            if key in scale:
                _integer(scale[key], path, f"loss_scale {key}")
    tokenizer = _mapping(manifest.get("tokenizer", {"type": "bytes"}), path, "'tokenizer'", ("type",))
    if tokenizer["type"] not in TOKENIZERS:
        raise _lie(path, "tokenizer type", tokenizer["type"], " or ".join(map(repr, TOKENIZERS)))
    args = _mapping(manifest.get("args", {}), path, "'args'")
    if "seq_length" in args:
        _integer(args["seq_length"], path, "args seq_length", minimum=1)


def _check_expert_bias(biases, path):
    """{MoE router: [one finite number per expert]}: DeepSeek-V3's expert bias, saved whole."""
    _mapping(biases, path, "'expert_bias'")
    for name, bias in biases.items():
        if not (isinstance(bias, list) and 1 <= len(bias) <= 2 ** 20 and all(
                type(v) in (int, float) and math.isfinite(v) for v in bias)):
            raise _lie(path, f"the expert bias of {name}", bias, "a list of finite numbers, one per expert")


def check_places_fit(saved, model, manifest, path):
    """Each saved place of this model's parameters has the parameter's number of axes and lies
    inside its shape (a vocabulary axis may run past the real size by the saving run's padding)."""
    divisible = manifest["model"].get("make_vocab_size_divisible_by", 128)
    unit = _integer(divisible, path, "model make_vocab_size_divisible_by", minimum=1) * manifest["grid"]["tp"]
    for name, _, spec in model.named_specs():
        limits = list(spec.shape)
        if spec.padded_rows is not None:        # the vocabulary rows, padded to a multiple of unit
            limits[0] = -(-limits[0] // unit) * unit
        for shard, records in saved.items():
            place = records.get(name)
            if place is None:
                continue
            if len(place) != len(limits):
                raise InputError(f"checkpoint manifest {path}: shard {shard} places parameter {name} "
                                 f"with {len(place)} axes, but it has {len(limits)}; {FIX}")
            if any(hi > limit for (_, hi), limit in zip(place, limits)):
                raise InputError(f"checkpoint manifest {path}: shard {shard} places parameter {name} "
                                 f"at {place}, outside its shape {list(spec.shape)}; {FIX}")
