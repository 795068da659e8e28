"""The training loop shared by `scripts/train.py` (under mpirun) and `npmegatron train`.

nanoGPT's shape: build the model, draw batches, forward, backward, clip, step, log; Megatron's
names for the settings.
"""
import json
import math
import time
from dataclasses import dataclass
from typing import Optional

import numpy
from tqdm import tqdm

from . import comm
from .autograd import InputError, no_grad
from .data import BYTE_VOCAB_SIZE, WindowSampler, load_default_corpus
from .model import GPT, GPTConfig, model_flops
from .optimizer import AdamW, clip_grad_norm, learning_rate


@dataclass
class TrainArgs:
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None   # None: seq_length
    micro_batch_size: int = 16
    train_iters: int = 500
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 50
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    seed: int = 1234
    dtype: str = "float32"
    device: str = "cpu"
    log_interval: int = 25
    eval_interval: int = 100
    eval_iters: int = 10
    log_file: Optional[str] = None     # metrics JSONL, one line per logging interval

    def __post_init__(self):
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        for name in ("seq_length", "micro_batch_size", "train_iters", "log_interval", "eval_iters"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} is {getattr(self, name)}; it must be "
                                 "a positive integer")
        if self.seq_length > self.max_position_embeddings:
            raise InputError(f"--seq-length {self.seq_length} is longer than the position table "
                             f"(--max-position-embeddings {self.max_position_embeddings}); raise "
                             "--max-position-embeddings or shorten --seq-length")

    def model_config(self):
        return GPTConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, vocab_size=BYTE_VOCAB_SIZE,
            max_position_embeddings=self.max_position_embeddings,
            hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout,
            sequence_parallel=self.sequence_parallel, dtype=self.dtype, device=self.device,
            seed=self.seed)


def evaluate(model, sampler, iters):
    model.eval()
    with no_grad():
        losses = [model(*sampler.batch(i))[1].item() for i in range(iters)]
    model.train()
    return float(numpy.mean(losses))


def build_grid(args):
    """The process grid: serial without mpirun, else TP ranks per model replica."""
    tp = args.tensor_model_parallel_size
    if tp < 1:
        raise InputError(f"--tensor-model-parallel-size {tp} must be a positive integer")
    if tp == 1 and not comm.launched_by_mpi():
        return comm.ProcessGrid.single()
    world = comm.init()
    grid = comm.ProcessGrid(tp=tp, pp=1)
    if grid.dp_size > 1:
        raise InputError(f"world size {world.size} with TP {tp} leaves {grid.dp_size} data-parallel "
                         f"replicas, and data parallelism is not implemented yet; launch exactly "
                         f"{tp} ranks (mpirun -n {tp})")
    return grid


def train(args: TrainArgs, echo=print):
    """Train on the embedded corpus; returns the list of per-step losses (the same on every rank)."""
    cfg = args.model_config()
    grid = build_grid(args)
    leader = grid.rank == 0
    if not leader:
        echo = lambda *a, **k: None
    model = GPT(cfg, grid)
    replicated = {id(p) for _, p, spec in model.named_specs() if spec.tp_axis is None}
    skip = replicated if grid.tp_rank != 0 else set()
    train_tokens, valid_tokens = load_default_corpus()
    sampler = WindowSampler(train_tokens, args.seq_length, args.micro_batch_size, args.seed)
    valid_sampler = WindowSampler(valid_tokens, args.seq_length, args.micro_batch_size, args.seed + 1)
    params = model.parameters()
    optimizer = AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    tokens_per_step = args.micro_batch_size * args.seq_length
    flops_per_step = model_flops(cfg, model.num_parameters(), args.micro_batch_size, args.seq_length)
    echo(f"GPT: {model.num_parameters():,} parameters, {cfg.num_layers} layers, hidden "
         f"{cfg.hidden_size}, {cfg.num_attention_heads} heads, {cfg.dtype} on {cfg.device}, "
         f"{grid}{' sequence-parallel' if cfg.sequence_parallel else ''}; corpus "
         f"{len(train_tokens):,} training / {len(valid_tokens):,} validation bytes")
    log = open(args.log_file, "w") if args.log_file and leader else None
    losses, window_start = [], time.perf_counter()
    bar = tqdm(range(args.train_iters), desc="training", unit="it", leave=False, disable=not leader)
    for step in bar:
        lr = learning_rate(step, args.lr, args.min_lr, args.lr_warmup_iters, args.train_iters,
                           args.lr_decay_style)
        inputs, targets = sampler.batch(step)
        model.zero_grad()
        _, loss = model(inputs, targets)
        loss.backward()
        model.finalize_grads()
        grad_norm = clip_grad_norm(params, args.clip_grad, grid.mp_group, skip)
        optimizer.step(lr)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise InputError(f"the loss became {losses[-1]} at step {step + 1}; lower --lr or "
                             "raise --lr-warmup-iters")
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        done = step + 1
        if done % args.log_interval == 0 or done == args.train_iters:
            elapsed = time.perf_counter() - window_start
            steps = done % args.log_interval or args.log_interval
            record = {"iteration": done, "loss": float(numpy.mean(losses[-steps:])), "lr": lr,
                      "grad_norm": grad_norm, "tokens_per_s": steps * tokens_per_step / elapsed,
                      "tflops": steps * flops_per_step / elapsed / 1e12}
            if done % args.eval_interval == 0 or done == args.train_iters:
                record["val_loss"] = evaluate(model, valid_sampler, args.eval_iters)
            if leader:
                bar.write(_format(record, args.train_iters))
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
            window_start = time.perf_counter()
    bar.close()
    if log:
        log.close()
    echo(f"done: loss {losses[0]:.4f} -> {numpy.mean(losses[-10:]):.4f} (mean of the last "
         f"{min(10, len(losses))} steps)")
    return losses


def _format(r, total):
    line = (f"iter {r['iteration']:>5}/{total} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"grad norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | "
            f"{r['tflops']:.4f} TFLOP/s")
    return line + (f" | val loss {r['val_loss']:.4f}" if "val_loss" in r else "")
