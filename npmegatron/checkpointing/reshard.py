"""Loading a checkpoint into any layout (Megatron's dist-checkpointing idea: reshard on load, no
conversion step).

Every shard records where each of its tensors sits in the parameter's whole master tensor
(`places`: a [start, stop) interval per axis, in the saving run's padded coordinates). A rank
that loads asks, for each of its parameters, which saved intervals overlap its own slice, and reads
just those pieces through safetensors' lazy slicing (`safe_open(...).get_slice`), never a whole
file it does not need. Coordinates past the real (unpadded) size are vocabulary padding: never
read, left zero, as the padding rows always are (no token selects them, so their gradient,
moments and weights stay zero). A replicated parameter is in every TP shard; any one copy serves.

So a checkpoint saved at (TP, PP, DP, virtual stages, layout, with or without the distributed
optimizer) loads at any other: parameters, AdamW moments and (under --fp16/--bf16) master weights
are all stored whole-per-parameter in the same places, and the dropout RNG is a position, not a
per-rank stream.
"""
import os
import re

import numpy
from safetensors import SafetensorError, safe_open

from ..autograd import InputError, precision
from .manifest import shard_name, shard_path

SAVED_DTYPES = {"F32": numpy.float32, "F64": numpy.float64}    # what the saver writes


def places(model):
    """{parameter name: [[start, stop] per axis]} of this rank's parameters inside their padded
    master tensors (the record a shard keeps in the manifest)."""
    out = {}
    for name, param, spec in model.named_specs():
        index = tuple(spec.index) + (slice(None),) * (param.ndim - len(spec.index))
        out[name] = [[(s.start or 0), (s.start or 0) + size] for s, size in zip(index, param.shape)]
    return out


def saved_places(manifest, model, grid, same_layout):
    """{shard file: {name: place}} of a checkpoint. Checkpoints from before places were recorded
    can still be read at their own layout, where this rank's shard is its own."""
    shards = manifest["shards"]
    if all("places" in info for info in shards.values()):
        return {name: info["places"] for name, info in shards.items()}
    if not same_layout:
        raise InputError("the checkpoint was saved by an older npmegatron that did not record where "
                         "each tensor sits, so it loads only at its own TP and PP sizes and layout; "
                         "resume it there and save again to make it reshardable")
    return {shard_name(grid.tp_rank, grid.pp_rank): places(model)}


def _overlap(mine, theirs, real):
    """(slices into the saved piece, slices into this rank's array) of their common real part,
    or None when they do not meet."""
    source, target = [], []
    for (lo, hi), (their_lo, their_hi), size in zip(mine, theirs, real):
        start, stop = max(lo, their_lo), min(hi, their_hi, size)
        if start >= stop:
            return None
        source.append(slice(start - their_lo, stop - their_lo))
        target.append(slice(start - lo, stop - lo))
    return tuple(source), tuple(target)


def read_parameters(folder, saved, model, kinds):
    """{'KIND.NAME': host array shaped like this rank's parameter} for every parameter and every
    kind ('model', 'exp_avg', ...), assembled from the saved pieces it overlaps."""
    mine = places(model)
    out, covered = {}, {}
    for name, param, spec in model.named_specs():
        for kind in kinds:
            out[f"{kind}.{name}"] = numpy.zeros(param.shape, precision.master_dtype(param.dtype))
        covered[name] = numpy.zeros(param.shape, bool)
    for file, records in saved.items():
        wanted = [(name, _overlap(mine[name], records[name], spec.shape))
                  for name, _, spec in model.named_specs() if name in records]
        wanted = [(name, where) for name, where in wanted if where is not None]
        if not wanted:
            continue
        path = shard_path(folder, file, os.path.join(folder, "manifest.json"))
        try:
            with safe_open(path, framework="numpy") as f:
                for name, (source, target) in wanted:
                    for kind in kinds:
                        out[f"{kind}.{name}"][target] = _piece(f, file, f"{kind}.{name}", records[name], source)
                    covered[name][target] = True
        except (SafetensorError, OSError) as e:
            raise InputError(f"checkpoint shard {path} cannot be read as safetensors ({e}); it is "
                             "corrupt, load an earlier checkpoint") from None
    _check_covered(folder, model, mine, covered, saved)
    return out


def _one_expert_a_tensor(saved):
    """A saved name of one expert's own tensor ("blocks.0.mlp.experts.3.fc.weight"), or None."""
    return next((name for records in saved.values() for name in records
                 if re.search(r"\.experts\.\d+\.", name)), None)


def _piece(f, file, key, record, source):
    """One saved piece, after checking the tensor is there with the shape its place says."""
    if key not in f.keys():
        raise InputError(f"checkpoint shard {file} lacks tensor {key}; it was saved from a different model")
    saved, expected = f.get_slice(key), [hi - lo for lo, hi in record]
    if saved.get_dtype() not in SAVED_DTYPES:
        raise InputError(f"checkpoint shard {file}: tensor {key} has dtype {saved.get_dtype()}, but the "
                         f"saver writes only {' or '.join(SAVED_DTYPES)}; the checkpoint is corrupt")
    if list(saved.get_shape()) != expected:
        raise InputError(f"checkpoint shard {file}: tensor {key} has shape {saved.get_shape()}, "
                         f"but the manifest places it as {expected}; the checkpoint is corrupt")
    return saved[source]


def _check_covered(folder, model, mine, covered, saved):
    """Every real (unpadded) element of this rank's parameters was found in some shard."""
    for name, _, spec in model.named_specs():
        real = tuple(slice(0, max(0, min(hi, size) - lo)) for (lo, hi), size in zip(mine[name], spec.shape))
        old = ".experts." in name and not covered[name][real].all() and _one_expert_a_tensor(saved)
        if old:
            raise InputError(f"checkpoint {folder} holds its MoE experts one tensor each (such as "
                             f"{old}), as npmegatron saved them before it stacked each "
                             "layer's experts into one tensor; this version cannot load it, so train again")
        if not covered[name][real].all():
            raise InputError(f"checkpoint {folder} does not hold all of parameter {name}; a shard is "
                             "missing from its manifest, so load an earlier checkpoint")
