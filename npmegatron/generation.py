"""Text generation: a key/value cache, so each new token runs one position through the model,
and temperature / top-k sampling over the full (TP-gathered) vocabulary. Over pipeline stages,
each token runs the sequence through the stages (see _generate_pipelined).

Under tensor parallelism every rank holds its heads' keys and values; the logits are gathered,
and all ranks draw the same token from identically seeded generators on identical logits.
"""
import copy
import dataclasses
import math

import numpy

from . import autograd as ag
from . import comm
from .autograd import InputError
from .autograd.backend import to_numpy
from .checkpointing import checkpoint
from .data import tokenizer_from_spec
from .model import GPT
from .pipeline import StageExchange, run_schedule
from .pipeline_layout import default_layout
from .run import build_grid, build_model


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


def sample_token(logits, rng, temperature, top_k, top_p=1.0):
    """One token id from a (vocab,) float64 array: greedy at temperature 0; else sampled among
    the top_k likeliest (None: all), then among the fewest likeliest whose probabilities reach
    top_p (nucleus sampling, Holtzman et al., 2019; 1.0: all)."""
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
    probs /= probs.sum()
    if top_p < 1.0:
        order = numpy.argsort(-probs, kind="stable")
        # keep a token while the likelier ones before it have not yet reached top_p
        before = numpy.cumsum(probs[order]) - probs[order]
        kept = numpy.zeros_like(probs)
        kept[order[before < top_p]] = probs[order[before < top_p]]
        probs = kept / kept.sum()
    return int(rng.choice(logits.size, p=probs))


def for_generation(model):
    """The same weights (shared, not copied) in a model with sequence and context parallelism
    off: one new token cannot be split over ranks, and the weights' layout depends on neither.
    Every CP rank holds all the weights, so each generates the same tokens on its own."""
    grid = model.grid
    if grid.cp_size > 1:
        grid = copy.copy(grid)
        grid.cp_group, grid.cp_size, grid.cp_rank = comm.Group.single("cp"), 1, 0
    twin = GPT(dataclasses.replace(model.cfg, sequence_parallel=False), grid)
    mine = dict(model.named_parameters())
    for name, param in twin.named_parameters():
        param.data = mine[name].data
    return twin


def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, seed=0, top_p=1.0):
    """The prompt followed by max_new_tokens sampled ids. Past the position table the model
    attends to the last positions it holds (a sliding window, as nanoGPT's sample.py). `model`
    is a GPT, or a PipelineModel of any layout. Collective over the model's ranks; every rank
    returns the same ids."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InputError(f"temperature {temperature} must be a finite number >= 0; use 0 for greedy "
                         "decoding or a positive value to sample")
    if top_k is not None and top_k < 1:
        raise InputError(f"top-k {top_k} must be a positive integer (or omitted)")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"top-p {top_p} must be in (0, 1]; 1 samples from every token")
    if len(prompt_ids) == 0:
        raise InputError("the prompt is empty; give at least one character")
    whole = getattr(model, "whole", model)      # a pipeline rank holding every layer is a GPT
    capacity = model.cfg.max_position_embeddings
    ids = list(prompt_ids)[-capacity:]      # keep the end of a prompt longer than the table
    rng = numpy.random.default_rng(seed)
    draw = lambda row: sample_token(row.astype(numpy.float64), rng, temperature, top_k, top_p)
    was_training = model.training
    model.eval()
    try:
        with ag.no_grad():
            if whole is None:
                return _generate_pipelined(model, ids, max_new_tokens, draw)
            return _generate_cached(whole, ids, max_new_tokens, draw)
    finally:
        model.train(was_training)


def _generate_cached(model, ids, max_new_tokens, draw):
    """One stage: the prompt once, then one position per token through the key/value cache; once
    the table is full, each token runs the last `capacity` positions afresh (the positions shift,
    so the cached keys and values no longer hold), as the pipelined path does."""
    if model.cfg.sequence_parallel or model.cp_size > 1:
        model = for_generation(model)
    capacity, cache, out = model.cfg.max_position_embeddings, KVCache(model), list(ids)
    logits, _ = model(numpy.array([ids]), cache=cache)
    while True:
        out.append(draw(to_numpy(model.full_logits(logits.data[:, -1:]))[0, -1]))
        if len(out) - len(ids) == max_new_tokens:
            return out
        if cache.length < capacity:
            logits, _ = model(numpy.array([[out[-1]]]), cache=cache)
        else:
            cache = KVCache(model)
            logits, _ = model(numpy.array([out[-capacity:]]), cache=cache)


def _generate_pipelined(model, ids, max_new_tokens, draw):
    """Several pipeline stages: each token runs the whole sequence through the stages (no key/
    value cache crosses stages here, so a token costs the prefix again), the last stage draws it,
    and the last pipeline rank broadcasts it to the others."""
    if model.cfg.sequence_parallel or model.grid.cp_size > 1:
        raise InputError("generation over pipeline stages needs sequence and context parallelism off (one "
                         "new token cannot be split over ranks); build the model without them")
    grid, capacity, out = model.grid, model.cfg.max_position_embeddings, list(ids)
    exchange = StageExchange(grid, model.cfg.dtype, model.xp, 1, variable_seq_lengths=True)
    last_stage = model.chunks[-1] if model.stage_specs[-1].post_process else None
    while len(out) - len(ids) < max_new_tokens:
        logits = []
        run_schedule(model, exchange, [(numpy.array([out[-capacity:]]), None)], forward_only=True,
                     outputs=logits)
        token = numpy.zeros(1, numpy.int64)
        if last_stage is not None:
            token[0] = draw(to_numpy(last_stage.full_logits(logits[0][:, -1:]))[0, -1])
        out.append(int(comm.broadcast(token, grid.pp_group, root=grid.pp_size - 1)[0]))
    return out


def load_for_generation(path, device="cpu", tp=None, pp=1):
    """(model, tokenizer) from a checkpoint saved at any layout, resharded to TP x PP ranks (TP
    default: the launched ranks / PP; one process without mpirun); sequence parallelism and
    dropout off."""
    folder, manifest = checkpoint.read_manifest(path)
    world = comm.launch_size()
    tp = tp or max(1, world // pp)
    if world != tp * pp:
        raise InputError(f"generation with TP {tp} x PP {pp} needs {tp * pp} ranks but {world} were "
                         f"launched; run it under mpirun -n {tp * pp}")
    cfg = checkpoint.saved_config(manifest, sequence_parallel=False, hidden_dropout=0.0, attention_dropout=0.0,
                                  device=device, tf32=bool(manifest["model"].get("tf32")) and device == "gpu")
    grid = build_grid(tp, pp, nccl=device == "gpu")
    model = build_model(cfg, grid, default_layout(cfg.num_layers, pp, 1))
    checkpoint.load(folder, model, None, grid)
    spec, file = manifest.get("tokenizer", {"type": "bytes"}), checkpoint.tokenizer_file(folder)
    if spec["type"] == "huggingface" and file is None:
        raise InputError(f"checkpoint {folder} was trained with a Hugging Face tokenizer, but its "
                         "tokenizer.json is missing; copy the run's tokenizer.json into that folder")
    tokenizer = tokenizer_from_spec(spec, file)
    return model, tokenizer
