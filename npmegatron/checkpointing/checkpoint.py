"""Checkpoints: per-rank safetensors shards plus a JSON manifest, written so that a run killed
while saving leaves the previous checkpoint whole.

    DIR/latest                      "iter_0000020", replaced (atomically) last of all
    DIR/iter_0000020/manifest.json  config, the saving grid, iteration, optimizer, the dropout
                                    position, data position, and the size, SHA-256 and places of
                                    every shard (checked field by field on loading: manifest.py)
    DIR/iter_0000020/mp_rank_00_000.safetensors   one per (TP rank, PP rank): parameters and
                                    AdamW moments; data-parallel replicas hold the same, so only
                                    DP rank 0 writes. Under expert parallelism one per (TP, PP,
                                    EP rank), mp_rank_00_000_001: each EP rank of the first
                                    expert-data-parallel replica writes its experts, EP rank 0
                                    the dense weights too

A save fills DIR/iter_N.partial, flushing and fsyncing every file, and renames it to iter_N only
when the manifest is complete; then `latest` moves. Loading checks the manifest against the run
and each shard's size, checksum, names and shapes, and says in one sentence what is wrong.
"""
import dataclasses
import errno
import hashlib
import json
import os
import shutil

import numpy
from safetensors.numpy import save as to_safetensors

from .. import comm
from ..autograd import InputError, precision
from ..autograd.backend import get_array_module, to_numpy
from ..config import GPTConfig
from . import manifest as manifests, reshard
from .manifest import FORMAT, ITERATION_FOLDER, STRUCTURE, inside, shard_name

MOMENTS = ("exp_avg", "exp_avg_sq")      # AdamW's, saved per parameter beside its weights
MANIFEST_LIMIT = 2 ** 26                  # bytes; a manifest lists places, tens of bytes a tensor


def _write_synced(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def gather_json(obj, group):
    """Every rank's JSON-able `obj`, in rank order, on every rank (two all-gathers of bytes)."""
    if group.size == 1:
        return [obj]
    raw = numpy.frombuffer(json.dumps(obj).encode(), numpy.uint8)
    lengths = comm.all_gather(numpy.array([raw.size], numpy.int64), group)
    padded = numpy.zeros(int(lengths.max()), numpy.uint8)
    padded[:raw.size] = raw
    rows = comm.all_gather(padded, group).reshape(group.size, -1)
    return [json.loads(bytes(row[:n])) for row, n in zip(rows, lengths)]


def raise_if_any(error, group):
    """Collective: if any rank found a problem, every rank raises the first one, so it is
    reported once (by rank 0) and no rank is left waiting in a collective."""
    errors = [e for e in gather_json(error, group) if e]
    if errors:
        raise InputError(errors[0])


def _state_tensors(model, state, names):
    """{'model.NAME' | 'exp_avg.NAME' | 'exp_avg_sq.NAME': host array} of the parameters `names`.
    `state` is the state_dict of the optimizer built over model.parameters(), so its moment lists
    follow named_parameters' order."""
    named = list(model.named_parameters())
    # Under mixed precision the weights saved are the float32 masters (the parameters are their
    # 16-bit rounding): a checkpoint loads the same with or without --fp16/--bf16.
    weights = state.get("master") or [param.data for _, param in named]
    tensors = {f"model.{name}": to_numpy(w) for (name, _), w in zip(named, weights) if name in names}
    for kind in MOMENTS:
        tensors.update((f"{kind}.{name}", to_numpy(moment)) for (name, _), moment in zip(named, state[kind])
                       if name in names)
    return tensors


def save(root, iteration, model, optimizer, grid, extra, files=None):
    """Collective over the world. `extra` (JSON-able) goes into the manifest as is: run id,
    training arguments, data position, tokenizer. `files` ({name: path, or bytes}) are written in
    beside it.
    On any failure (a full disk among them) the partial folder is removed, `latest` still names
    the previous checkpoint, and every rank raises the same InputError."""
    world = grid.world
    final = os.path.join(root, f"iter_{iteration:07d}")
    partial = final + ".partial"
    error = None
    if world.rank == 0:
        try:
            shutil.rmtree(partial, ignore_errors=True)     # left by a run killed while saving
            os.makedirs(partial)
        except OSError as e:
            error = f"cannot write checkpoint folder {root} ({e.strerror}); choose a writable --save"
    raise_if_any(error, world)
    state = optimizer.state_dict()     # collective under the distributed optimizer (gathered whole)
    blob, record = _serialize_shard(model, state, grid)
    records = gather_json(record, world)
    needed = sum(r["shard"]["bytes"] for r in records if "shard" in r)
    if world.rank == 0:
        error = _space_error(root, iteration, needed, shutil.disk_usage(root).free)
    _agree_or_clean(error, partial, world)
    if blob is not None:
        error = _write_or_error(os.path.join(partial, record["shard"]["file"]), blob, root,
                                iteration, needed)
    _agree_or_clean(error, partial, world)
    if world.rank == 0:
        manifest = {"format": FORMAT, "iteration": iteration, "model": dict(vars(model.cfg)),
                    "grid": {"tp": grid.tp_size, "pp": grid.pp_size, "dp": grid.dp_size,
                             **({"cp": grid.cp_size} if grid.cp_size > 1 else {}),
                             **({"ep": _ep_size(grid)} if _ep_size(grid) > 1 else {})},
                    "optimizer": state["hyperparameters"],
                    "ranks": [{k: r[k] for k in ("rank", "tp", "pp", "dp", "rng")} for r in records],
                    "shards": {r["shard"]["file"]: {k: r["shard"][k] for k in ("bytes", "sha256", "places")}
                               for r in records if "shard" in r},
                    **_expert_biases(records), **extra}
        error = _publish(root, partial, final, manifest, files or {}, iteration, needed)
    _agree_or_clean(error, partial, world)
    return final


def _serialize_shard(model, state, grid):
    """(safetensors bytes or None, this rank's manifest record): DP and CP rank 0 of each (TP, PP)
    position writes the shard; data- and context-parallel replicas hold the same state. Under
    expert parallelism the rest of its EP group (the next EP - 1 of the DP x CP ranks) write their
    experts. TP rank 0 of each writing position records its routers' expert biases."""
    record = {"rank": grid.rank, "tp": grid.tp_rank, "pp": grid.pp_rank, "dp": grid.dp_rank,
              "rng": model.rng.get_states()}
    ep = _ep_size(grid)
    place = grid.cp_rank + grid.cp_size * grid.dp_rank     # among the DP x CP ranks; the first EP write
    if place >= ep:
        return None, record
    experts_only = place != 0
    names = {name for name, _, spec in model.named_specs() if spec.expert or not experts_only}
    if not experts_only and grid.tp_rank == 0:
        record["expert_bias"] = {name: to_numpy(bias).tolist() for name, bias in _expert_biases_of(model)}
    blob = to_safetensors(_state_tensors(model, state, names))
    record["shard"] = {"file": shard_name(grid.tp_rank, grid.pp_rank, place if ep > 1 else None),
                       "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                       "places": {name: place for name, place in reshard.places(model).items() if name in names}}
    return blob, record


def _ep_size(grid):
    return getattr(grid, "ep_size", 1)


def _expert_biases(records):
    """{"expert_bias": {router: biases}} of every pipeline stage's routers, or nothing."""
    biases = {name: bias for r in records for name, bias in r.get("expert_bias", {}).items()}
    return {"expert_bias": biases} if biases else {}


def _space_error(root, iteration, needed, free):
    """The one sentence for a checkpoint that does not fit, or None."""
    if needed <= free:
        return None
    return (f"checkpoint folder {root} has no room for iteration {iteration}: it needs "
            f"{needed:,} bytes and {free:,} are free; free some disk space or choose another --save")


def _write_or_error(path, data, root, iteration, needed):
    """Write a checkpoint file; None, or one sentence for what went wrong."""
    try:
        _write_synced(path, data)
        return None
    except OSError as e:
        return _os_error(e, root, iteration, needed)


def _os_error(e, root, iteration, needed):
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"checkpoint folder {root} ran out of disk space saving iteration {iteration}, "
                f"which needs {needed:,} bytes; free some disk space or choose another --save")
    return f"cannot write checkpoint {e.filename or root} ({e.strerror}); choose a writable --save"


def _publish(root, partial, final, manifest, files, iteration, needed):
    """Rank 0: the manifest, then the rename into place, then `latest`. None, or one sentence."""
    try:
        for name, source in files.items():       # a path to copy, or the bytes themselves
            if isinstance(source, bytes):
                with open(os.path.join(partial, name), "wb") as f:
                    f.write(source)
            else:
                shutil.copyfile(source, os.path.join(partial, name))
        _write_synced(os.path.join(partial, "manifest.json"), json.dumps(manifest, indent=1).encode())
        _sync_dir(partial)
        if os.path.exists(final):     # saving the same iteration again: keep the old one until
            shutil.rmtree(final + ".old", ignore_errors=True)     # the new one is in place
            os.rename(final, final + ".old")
        os.rename(partial, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
        _write_synced(os.path.join(root, "latest.partial"), os.path.basename(final).encode())
        os.replace(os.path.join(root, "latest.partial"), os.path.join(root, "latest"))
        _sync_dir(root)
    except OSError as e:
        return _os_error(e, root, iteration, needed)
    return None


def _agree_or_clean(error, partial, world):
    """Collective: when any rank failed, rank 0 removes the partial folder and all raise."""
    try:
        raise_if_any(error, world)
    except InputError:
        if world.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise


def holds_checkpoint(root):
    """Whether folder `root` holds anything of a checkpoint: a `latest` pointer, a manifest or an
    iteration folder. An empty or missing folder does not (a first run's --load: start from scratch);
    a damaged checkpoint does, so that loading it says what is wrong."""
    if not os.path.isdir(root):
        return False
    return (os.path.exists(os.path.join(root, "latest")) or os.path.exists(os.path.join(root, "manifest.json"))
            or any(ITERATION_FOLDER.fullmatch(name.removesuffix(".old")) for name in os.listdir(root)))


def find(root):
    """The folder of the checkpoint `root` names: root/latest's target, or root itself."""
    if not os.path.isdir(root):
        raise InputError(f"--load {root}: no such checkpoint folder; pass the --save folder of an "
                         "earlier run")
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer):
        with open(pointer, "rb") as f:
            name = f.read().strip().decode("utf-8", errors="replace")
        if not ITERATION_FOLDER.fullmatch(name):     # never a path out of the folder
            raise InputError(f"{pointer} names {name[:80]!r}, not a checkpoint of this folder "
                             "(iter_NNNNNNN); repair it, or pass an iteration folder to --load")
        folder = os.path.join(root, name)
        if not os.path.isdir(folder) and os.path.isdir(folder + ".old"):
            folder += ".old"          # killed while replacing a re-saved iteration
        inside(root, os.path.basename(folder), "checkpoint folder")
    elif os.path.isfile(os.path.join(root, "manifest.json")):
        folder = root
    else:
        raise InputError(f"--load {root}: no checkpoint there (neither {pointer} nor a "
                         "manifest.json); pass the --save folder of an earlier run")
    return folder


def read_manifest(root):
    """(checkpoint folder, its manifest), every field of the manifest checked (manifest.py)."""
    folder = find(root)
    path = inside(folder, "manifest.json", "checkpoint manifest")
    try:
        if os.path.getsize(path) > MANIFEST_LIMIT:
            raise InputError(f"checkpoint manifest {path} has {os.path.getsize(path):,} bytes, more than "
                             f"any manifest the saver writes ({MANIFEST_LIMIT:,}); load another checkpoint")
        with open(path, "rb") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise InputError(f"checkpoint manifest {path} is missing; the checkpoint is incomplete, "
                         "load an earlier one") from None
    except (ValueError, RecursionError):
        raise InputError(f"checkpoint manifest {path} is not valid JSON; it is corrupt, load an "
                         "earlier checkpoint") from None
    except OSError as e:
        raise InputError(f"checkpoint manifest {path} cannot be read ({e.strerror}); load another "
                         "checkpoint") from None
    manifests.check(manifest, folder, path)
    return folder, manifest


def tokenizer_file(folder):
    """The tokenizer.json a run saved beside its checkpoint (never a link out of the folder), or None."""
    path = inside(folder, "tokenizer.json", "checkpoint tokenizer")
    return path if os.path.isfile(path) else None


def check_compatible(manifest, cfg, folder):
    """One sentence on the first way the saved model differs from this run's, or None. The
    layout may differ: loading reshards (reshard.py)."""
    saved = manifest["model"]
    for key in STRUCTURE:
        if saved.get(key) != getattr(cfg, key):
            return (f"checkpoint {folder} holds a model with {key} {saved.get(key)}, but this run "
                    f"has {key} {getattr(cfg, key)}; pass the saved run's model flags (or "
                    "--use-checkpoint-args)")
    return None


def saved_config(manifest, **overrides):
    """The GPTConfig a checkpoint's model was trained with (fields this version does not know are
    dropped), with `overrides` (e.g. dropout off for generation)."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{**{k: v for k, v in manifest["model"].items() if k in fields}, **overrides})


def verify_shards(folder, manifest):
    """One sentence on the first shard that is missing, truncated or fails its SHA-256, or None."""
    for name, info in manifest["shards"].items():
        path = manifests.shard_path(folder, name, os.path.join(folder, "manifest.json"))
        if not os.path.isfile(path):
            return f"checkpoint shard {path} is missing; the checkpoint is incomplete"
        if os.path.getsize(path) != info["bytes"]:
            return (f"checkpoint shard {path} has {os.path.getsize(path)} bytes but the manifest says "
                    f"{info['bytes']}; it is truncated or corrupt, load an earlier checkpoint")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        if digest.hexdigest() != info["sha256"]:
            return f"checkpoint shard {path} fails its SHA-256 check; it is corrupt, load an earlier checkpoint"
    return None


def same_layout(manifest, grid, pipeline_layout):
    layout = manifest["grid"]
    saved_layout = manifest.get("pipeline_layout")
    return ((layout["tp"], layout["pp"]) == (grid.tp_size, grid.pp_size)
            and (pipeline_layout is None or saved_layout is None or saved_layout == pipeline_layout))


def load(root, model, optimizer, grid, pipeline_layout=None, optimizer_state=True, rng=True):
    """Collective: restore parameters, AdamW state (unless optimizer is None, or optimizer_state
    is False: then the optimizer takes the weights alone, its moments fresh) and the dropout
    position (unless rng is False) from a checkpoint saved at any layout; returns the manifest.
    Rank 0 checks every shard's size and checksum; each rank then reads only the pieces of the
    shards it needs."""
    world = grid.world
    folder = manifest = tensors = error = None
    try:
        folder, manifest = read_manifest(root)
        error = check_compatible(manifest, model.cfg, folder)
        if error is None and world.rank == 0:
            error = verify_shards(folder, manifest)
    except InputError as e:
        error = str(e)
    raise_if_any(error, world)
    try:
        saved = reshard.saved_places(manifest, model, grid, same_layout(manifest, grid, pipeline_layout))
        manifests.check_places_fit(saved, model, manifest, os.path.join(folder, "manifest.json"))
        tensors = reshard.read_parameters(folder, saved, model,
                                          ("model",) + (MOMENTS if optimizer and optimizer_state else ()))
    except InputError as e:
        error = str(e)
    raise_if_any(error, world)
    names = [name for name, _ in model.named_parameters()]
    for name, param in model.named_parameters():
        param.data[...] = param.xp.asarray(tensors[f"model.{name}"])
        if optimizer is None:     # else the optimizer keeps these as float32 masters, then rounds
            precision.round_(param.data, model.cfg.storage_format)
    weights = [tensors[f"model.{name}"] for name in names]
    if optimizer is not None and optimizer_state:   # the weights at full precision: the masters under --fp16/--bf16
        optimizer.load_state_dict({"hyperparameters": manifest["optimizer"], "weights": weights,
                                   **{kind: [tensors[f"{kind}.{name}"] for name in names] for kind in MOMENTS}})
    elif optimizer is not None:
        optimizer.load_weights(weights)
    raise_if_any(_expert_bias_error(model, manifest, folder), world)
    for name, bias in _expert_biases_of(model):
        bias[...] = get_array_module(bias).asarray(numpy.asarray(manifest["expert_bias"][name], numpy.float32))
    if rng:     # the dropout generator is a position (iteration, micro-batch), the same on every rank
        model.rng.set_states(manifest["ranks"][0]["rng"])
    return manifest


def _expert_biases_of(model):
    """(router name, its expert bias) of each MoE router with --moe-router-enable-expert-bias,
    named as its weight is, without ".weight" (the serial model's name under every layout)."""
    names = {id(param): name for name, param in model.named_parameters()}
    return [(names[id(module.weight)].removesuffix(".weight"), module.expert_bias)
            for _, module in model.named_modules() if getattr(module, "expert_bias", None) is not None]


def _expert_bias_error(model, manifest, folder):
    """One sentence when a router's expert bias is not in the checkpoint (saved without the
    flag: its run routed without biases), or None."""
    saved = manifest.get("expert_bias", {})
    for name, bias in _expert_biases_of(model):
        if len(saved.get(name, ())) != bias.shape[0]:
            return (f"checkpoint {folder} holds no expert bias of {bias.shape[0]} experts for {name} (it was "
                    "saved without --moe-router-enable-expert-bias); drop that flag to load it")
    return None
