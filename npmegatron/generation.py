"""Text generation: a key/value cache, so each new token runs one position through the model,
and temperature / top-k sampling over the full (TP-gathered) vocabulary.

Under tensor parallelism every rank holds its heads' keys and values; the logits are gathered,
and all ranks draw the same token from identically seeded generators on identical logits.
"""
import math

import numpy

from . import autograd as ag
from .autograd import InputError
from .autograd.backend import to_numpy


class LayerCache:
    """Keys and values of one layer's local heads, preallocated to the position table."""

    def __init__(self, owner):
        self.owner, self.k, self.v = owner, None, None

    def extend(self, k, v):
        """Store the new positions' k, v (batch, heads, t, d); return all positions' so far."""
        start, end = self.owner.length, self.owner.length + k.shape[2]
        if self.k is None:
            xp = ag.get_array_module(k)
            shape = k.shape[:2] + (self.owner.capacity,) + k.shape[3:]
            self.k, self.v = xp.empty(shape, k.dtype), xp.empty(shape, v.dtype)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return ag.Tensor(self.k[:, :, :end]), ag.Tensor(self.v[:, :, :end])


class KVCache:
    def __init__(self, model):
        self.capacity = model.cfg.max_position_embeddings
        self.length = 0
        self.layers = [LayerCache(self) for _ in model.blocks]

    def layer(self, i):
        return self.layers[i]


def sample_token(logits, rng, temperature, top_k):
    """One token id from a (vocab,) float64 array: greedy at temperature 0."""
    if temperature == 0:
        return int(numpy.argmax(logits))
    # Shift before scaling: a tiny temperature then overflows to -inf (probability 0), never to
    # inf - inf = nan.
    with numpy.errstate(over="ignore"):
        logits = (logits - logits.max()) / temperature
    if top_k and top_k < logits.size:
        cutoff = numpy.partition(logits, -top_k)[-top_k]
        logits = numpy.where(logits < cutoff, -numpy.inf, logits)
    probs = numpy.exp(logits)
    return int(rng.choice(logits.size, p=probs / probs.sum()))


def without_sequence_parallel(model):
    """The same weights (shared, not copied) in a model with sequence parallelism off: one new
    token cannot be split over the TP ranks, and the weights' layout does not depend on SP."""
    import dataclasses
    from .model import GPT
    twin = GPT(dataclasses.replace(model.cfg, sequence_parallel=False), model.grid)
    mine = dict(model.named_parameters())
    for name, param in twin.named_parameters():
        param.data = mine[name].data
    return twin


def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, seed=0):
    """The prompt followed by up to max_new_tokens sampled ids (fewer if the position table
    fills). Collective over the model's TP group."""
    if model.cfg.sequence_parallel:
        model = without_sequence_parallel(model)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InputError(f"temperature {temperature} must be a finite number >= 0; use 0 for greedy "
                         "decoding or a positive value to sample")
    if top_k is not None and top_k < 1:
        raise InputError(f"top-k {top_k} must be a positive integer (or omitted)")
    if len(prompt_ids) == 0:
        raise InputError("the prompt is empty; give at least one character")
    capacity = model.cfg.max_position_embeddings
    ids = list(prompt_ids)[-capacity:]      # keep the end of a prompt longer than the table
    rng = numpy.random.default_rng(seed)
    was_training = model.training
    model.eval()
    cache = KVCache(model)
    out = list(ids)
    with ag.no_grad():
        logits, _ = model(numpy.array([ids]), cache=cache)
        while len(out) - len(ids) < max_new_tokens:
            last = to_numpy(model.full_logits(logits.data[:, -1:]))[0, -1].astype(numpy.float64)
            token = sample_token(last, rng, temperature, top_k)
            out.append(token)
            if cache.length >= capacity or len(out) - len(ids) == max_new_tokens:
                break
            logits, _ = model(numpy.array([[token]]), cache=cache)
    model.train(was_training)
    return out


def load_for_generation(path, device="cpu"):
    """(model, tokenizer) from a checkpoint, on the TP layout it was saved with (mpirun -n TP,
    or one process for TP 1); sequence parallelism and dropout off."""
    import dataclasses
    import os

    from . import comm
    from .build import build_grid
    from .data import tokenizer_from_spec
    from .model import GPT, GPTConfig
    from .training import checkpoint
    folder, manifest = checkpoint.read_manifest(path)
    tp = manifest["layout"]["tp"]
    if tp > 1 and not comm.launched_by_mpi():
        raise InputError(f"checkpoint {folder} was saved with TP size {tp}; generate under "
                         f"mpirun -n {tp}")
    grid = build_grid(tp)
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    saved = {k: v for k, v in manifest["model"].items() if k in fields}
    cfg = GPTConfig(**{**saved, "sequence_parallel": False, "hidden_dropout": 0.0,
                       "attention_dropout": 0.0, "device": device,
                       "tf32": bool(saved.get("tf32")) and device == "gpu"})
    model = GPT(cfg, grid)
    checkpoint.load(folder, model, None, grid)
    tokenizer = tokenizer_from_spec(manifest["tokenizer"], os.path.join(folder, "tokenizer.json"))
    return model, tokenizer
