"""The training loop shared by `scripts/train.py` (under mpirun) and `npmegatron train`.

nanoGPT's shape, Megatron's names: build the grid, data and model (or resume them from a
checkpoint), then per iteration accumulate gradients over micro-batches, average them over the
data-parallel group (bucketed, overlapping the last backward), clip, step, log, evaluate, save.
The global batch is micro-batch x accumulation steps x data-parallel size, and sample k of the
run is the same whatever that split, so every (TP, DP) layout follows the same trajectory.
"""
import json
import math
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Optional

import numpy
from tqdm import tqdm

from . import checkpoint, comm
from .autograd import InputError
from .data import ByteTokenizer, TokenDataset, WindowSampler, load_default_corpus
from .data_parallel import GradientBuckets
from .generation import generate
from .model import GPTConfig, model_flops
from .pipeline import PipelineModel, StageExchange, default_layout, parse_layout, plan_stages, run_schedule
from .optimizer import AdamW, clip_grad_norm, learning_rate
from .save_folder import SaveFolder


class TrainingDiverged(InputError):
    """The loss or gradient norm stopped being finite; nothing of that step was applied or saved."""


@dataclass
class TrainArgs:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    pipeline_model_parallel_layout: Optional[str] = None
    pipeline_schedule: Optional[str] = None         # None: 1f1b, or interleaved with virtual stages
    num_micro_batches: Optional[int] = None         # None: from --global-batch-size
    deallocate_pipeline_outputs: bool = True
    variable_seq_lengths: bool = False
    overlap_p2p_communication: bool = True
    sequence_parallel: bool = False
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None   # None: seq_length
    micro_batch_size: int = 16
    global_batch_size: Optional[int] = None         # None: micro_batch_size x DP
    train_iters: int = 1000
    lr: float = 2e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 100
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    seed: int = 1234
    dtype: str = "float32"
    device: str = "cpu"
    data_path: Optional[str] = None                 # None: the embedded corpus
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None             # None: save at the end only
    exit_interval: Optional[int] = None             # stop (after saving) at a multiple of this
    overwrite: bool = False                         # replace another run's checkpoints in --save
    exit_signal_handler: bool = False               # SIGTERM: finish the iteration, save, exit 0
    ddp_bucket_size: int = 2 ** 20                  # parameters per data-parallel all-reduce
    log_interval: int = 50
    eval_interval: int = 250
    eval_iters: int = 10
    log_file: Optional[str] = None                  # metrics JSONL, one line per logging interval
    sample_tokens: int = 200                        # generated at the end (0: none)

    def __post_init__(self):
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        for name in ("seq_length", "micro_batch_size", "train_iters", "log_interval", "eval_iters",
                     "eval_interval", "ddp_bucket_size"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} is {getattr(self, name)}; it must be "
                                 "a positive integer")
        for name in ("save_interval", "exit_interval", "global_batch_size", "num_micro_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} is {getattr(self, name)}; it must be a "
                                 "positive integer")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise InputError(f"--lr is {self.lr}; the learning rate must be positive, e.g. 1e-3")
        if not 0 <= self.min_lr <= self.lr:
            raise InputError(f"--min-lr is {self.min_lr}; it must be between 0 and --lr ({self.lr})")
        for name in ("weight_decay", "clip_grad", "lr_warmup_iters", "sample_tokens", "seed"):
            if not getattr(self, name) >= 0 or not math.isfinite(getattr(self, name)):
                raise InputError(f"--{name.replace('_', '-')} is {getattr(self, name)}; it must be a "
                                 "finite number, not negative")
        log_folder = os.path.dirname(os.path.abspath(self.log_file or "."))
        if self.log_file and not os.path.isdir(log_folder):
            raise InputError(f"--log-file {self.log_file}: folder {log_folder} does not exist; "
                             "create it or choose another file")
        if self.seq_length > self.max_position_embeddings:
            raise InputError(f"--seq-length {self.seq_length} is longer than the position table "
                             f"(--max-position-embeddings {self.max_position_embeddings}); raise "
                             "--max-position-embeddings or shorten --seq-length")

    def model_config(self, vocab_size):
        return GPTConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, vocab_size=vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout,
            sequence_parallel=self.sequence_parallel, dtype=self.dtype, device=self.device,
            seed=self.seed)


def resumes_in_place(load, save):
    """True when --load names the --save folder (or one of its iteration folders)."""
    if not load or not save:
        return False
    load = os.path.realpath(load)
    return os.path.realpath(save) in (load, os.path.dirname(load))


def build_grid(args):
    """The process grid: serial without mpirun, else TP x PP ranks per replica, DP replicas."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for flag, size in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp)):
        if size < 1:
            raise InputError(f"{flag} {size} must be a positive integer")
    if not comm.launched_by_mpi():
        if tp * pp > 1:
            raise InputError(f"--tp {tp} x --pp {pp} needs {tp * pp} ranks; launch with mpirun -n "
                             f"{tp * pp} (or a multiple for data parallelism)")
        return comm.ProcessGrid.single()
    comm.init()
    return comm.ProcessGrid(tp=tp, pp=pp)


def accumulation_steps(args, grid):
    """Micro-batches per optimizer step on each DP rank (M of the pipeline schedule)."""
    per_step = args.micro_batch_size * grid.dp_size
    if args.num_micro_batches is not None:
        implied = per_step * args.num_micro_batches
        if args.num_micro_batches < 1 or (args.global_batch_size or implied) != implied:
            raise InputError(f"--num-micro-batches {args.num_micro_batches} x micro-batch "
                             f"{args.micro_batch_size} x DP {grid.dp_size} does not give "
                             f"--global-batch-size {args.global_batch_size}; pass one of the two")
        return args.num_micro_batches
    global_batch = args.global_batch_size or per_step
    if global_batch < 1 or global_batch % per_step:
        raise InputError(f"--global-batch-size {global_batch} is not divisible by micro-batch x DP = "
                         f"{args.micro_batch_size} x {grid.dp_size} = {per_step}; use a multiple of "
                         f"{per_step}")
    return global_batch // per_step


def pipeline_layout(args):
    """The layout string: --pipeline-model-parallel-layout, or layers split evenly."""
    if args.pipeline_model_parallel_layout:
        return args.pipeline_model_parallel_layout
    pp, per_virtual = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    virtual = 1
    if per_virtual is not None:
        if per_virtual < 1 or args.num_layers % (pp * per_virtual):
            raise InputError(f"--num-layers-per-virtual-pipeline-stage {per_virtual} does not split "
                             f"{args.num_layers} layers over {pp} pipeline ranks evenly; choose a "
                             "divisor of num-layers / PP")
        virtual = args.num_layers // (pp * per_virtual)
    return default_layout(args.num_layers, pp, virtual)


class Data:
    """Training and validation token arrays, the vocabulary and the tokenizer."""

    def __init__(self, data_path):
        if data_path is None:
            self.train, self.valid = load_default_corpus()
            self.tokenizer, self.tokenizer_file = ByteTokenizer(), None
            self.description = "the embedded corpus"
        else:
            dataset = TokenDataset(data_path)
            self.train, self.valid = dataset.split()
            self.tokenizer, self.tokenizer_file = dataset.tokenizer(), dataset.tokenizer_file
            self.description = dataset.prefix
        self.vocab_size = self.tokenizer.vocab_size

    def validation_or_train(self, seq_length):
        """The held-out tokens, or the training tokens when too few are held out for a window."""
        if len(self.valid) > seq_length:
            return self.valid
        self.description += " (too little held out for one window: validating on training data)"
        return self.train


class Trainer:
    def __init__(self, args: TrainArgs):
        self.args = args
        self.grid = grid = build_grid(args)
        self.accumulation = accumulation_steps(args, grid)
        self.global_batch = args.micro_batch_size * self.accumulation * grid.dp_size
        self.data = Data(args.data_path)
        self.cfg = args.model_config(self.data.vocab_size)
        self.layout = pipeline_layout(args)
        stages = plan_stages(parse_layout(self.layout), args.num_layers, grid.pp_size, self.layout)
        self.model = PipelineModel(self.cfg, grid, stages)
        self.schedule = args.pipeline_schedule or ("interleaved" if self.model.virtual_size > 1 else "1f1b")
        self.exchange = StageExchange(grid, self.cfg.dtype, self.model.xp, self.accumulation,
                                      args.variable_seq_lengths)
        self.sampler = WindowSampler(self.data.train, args.seq_length, args.seed)
        self.valid_sampler = WindowSampler(self.data.validation_or_train(args.seq_length),
                                           args.seq_length, args.seed + 1)
        self.params = self.model.parameters()
        self.optimizer = AdamW(self.params, lr=args.lr, weight_decay=args.weight_decay)
        self.buckets = GradientBuckets(self.params, grid.dp_group, args.ddp_bucket_size)
        self.norm_skip = self.model.norm_skip()    # what counts once in the global norm
        self.iteration = 0
        self.last_saved = None
        self.run_id = uuid.uuid4().hex      # rank 0's is the one recorded; a resumed run keeps its own
        if args.load:
            manifest = checkpoint.load(args.load, self.model, self.optimizer, grid, self.layout)
            self.iteration = self.last_saved = manifest["iteration"]
            self.run_id = manifest.get("run_id", self.run_id)
            saved_batch = manifest["data"]["global_batch_size"]
            if saved_batch != self.global_batch:
                raise InputError(f"checkpoint {args.load} was trained with global batch {saved_batch}, "
                                 f"this run has {self.global_batch}; pass --global-batch-size {saved_batch}")
        self.save_folder = None
        if args.save:
            self.save_folder = SaveFolder(args.save, self.run_id, grid.world, args.overwrite,
                                          resuming=resumes_in_place(args.load, args.save))

    def micro_batches(self, sampler, step):
        """This rank's micro-batches of global batch `step`: samples are numbered globally, DP rank
        r takes the r-th contiguous share, so the split never changes what is trained on."""
        mb, rank = self.args.micro_batch_size, self.grid.dp_rank
        first = step * self.global_batch
        for j in range(self.accumulation):
            yield sampler.batch(first + (rank * self.accumulation + j) * mb, mb)

    def mean_loss(self, loss_sum, count):
        """The mean over micro-batches and DP replicas of losses summed on the last stage."""
        total = comm.all_reduce(numpy.array([loss_sum]), self.grid.pp_group)
        total = comm.all_reduce(total, self.grid.dp_group)
        return float(total[0]) / (count * self.grid.dp_size)

    def run(self, batches, **options):
        args = self.args
        return run_schedule(self.model, self.exchange, batches, self.schedule,
                            deallocate_outputs=args.deallocate_pipeline_outputs,
                            overlap=args.overlap_p2p_communication, **options)

    def train_step(self):
        """Forward and backward over the micro-batches, DP average, clip. Returns (loss, norm)."""
        self.buckets.zero_grad()
        loss_sum = self.run(list(self.micro_batches(self.sampler, self.iteration)), buckets=self.buckets)
        self.buckets.finish_sync()
        self.model.finalize_grads()
        loss = self.mean_loss(loss_sum, self.accumulation)
        norm = clip_grad_norm(self.params, self.args.clip_grad, self.grid.mp_group, self.norm_skip)
        return loss, norm

    def evaluate(self):
        self.model.eval()
        total = 0.0
        for k in range(self.args.eval_iters):
            total += self.run(list(self.micro_batches(self.valid_sampler, k)), forward_only=True)
        self.model.train()
        return self.mean_loss(total, self.args.eval_iters * self.accumulation)

    def save(self):
        args = self.args
        extra = {"run_id": self.run_id, "pipeline_layout": self.layout,
                 "data": {"consumed_samples": self.iteration * self.global_batch,
                          "global_batch_size": self.global_batch, "seed": args.seed,
                          "data_path": args.data_path},
                 "tokenizer": self.data.tokenizer.spec, "args": asdict(args)}
        files = {"tokenizer.json": self.data.tokenizer_file} if self.data.tokenizer_file else {}
        folder = checkpoint.save(args.save, self.iteration, self.model, self.optimizer, self.grid,
                                 extra, files)
        self.save_folder.saved(folder)
        self.last_saved = self.iteration
        return folder

    def close(self):
        """Let go of the --save folder's lock (also dropped when the process ends)."""
        if self.save_folder is not None:
            self.save_folder.release()

    def diverged(self, what, value):
        kept = (f"the last checkpoint (iteration {self.last_saved} in {self.args.save or self.args.load}) "
                "is untouched" if self.last_saved is not None else "no checkpoint was written")
        return TrainingDiverged(f"the {what} became {value} at iteration {self.iteration + 1}, so "
                                f"training stopped before applying it; {kept}; lower --lr or raise "
                                "--lr-warmup-iters")


def train(args: TrainArgs, echo=print):
    """Train (or resume); returns the per-iteration losses of this run (the same on every rank).
    With --exit-signal-handler, SIGTERM is noted from the very start, before the slow set-up."""
    exit_signal = comm.ExitSignal() if args.exit_signal_handler else None
    trainer = None
    try:
        trainer = Trainer(args)
        return _train_loop(trainer, echo, exit_signal)
    finally:
        if trainer is not None:
            trainer.close()
        if exit_signal is not None:
            exit_signal.restore()


def _train_loop(trainer, echo, exit_signal):
    args, grid, cfg, model = trainer.args, trainer.grid, trainer.cfg, trainer.model
    leader = grid.rank == 0
    if not leader:
        echo = lambda *a, **k: None
    tokens_per_step = trainer.global_batch * args.seq_length
    flops_per_step = model_flops(cfg, model.num_parameters(), trainer.global_batch, args.seq_length)
    pipeline = f", layout {trainer.layout!r} ({trainer.schedule})" if grid.pp_size > 1 else ""
    echo(f"GPT: {model.num_parameters():,} parameters, {cfg.num_layers} layers, hidden "
         f"{cfg.hidden_size}, {cfg.num_attention_heads} heads, {cfg.dtype} on {cfg.device}, {grid}"
         f"{' sequence-parallel' if cfg.sequence_parallel else ''}{pipeline}; global batch "
         f"{trainer.global_batch} = {args.micro_batch_size} x {trainer.accumulation} accumulation x "
         f"{grid.dp_size} DP; data {trainer.data.description}: {len(trainer.data.train):,} training / "
         f"{len(trainer.data.valid):,} validation tokens")
    if args.load:
        echo(f"resumed from {args.load} at iteration {trainer.iteration}")
    if args.train_iters < args.lr_warmup_iters:
        echo(f"warning: --train-iters {args.train_iters} is less than --lr-warmup-iters "
             f"{args.lr_warmup_iters}, so the whole run is warm-up and never reaches --lr {args.lr}")
    log = open_log(args.log_file, append=bool(args.load)) if args.log_file and leader else None
    losses, window_start, window = [], time.perf_counter(), []
    # A bar only on a terminal: captured to a file, its refreshes would bury the interval lines.
    bar = tqdm(total=args.train_iters, initial=trainer.iteration, desc="training", unit="it",
               leave=False, disable=not (leader and sys.stderr.isatty()))
    while trainer.iteration < args.train_iters:
        lr = learning_rate(trainer.iteration, args.lr, args.min_lr, args.lr_warmup_iters,
                           args.train_iters, args.lr_decay_style)
        loss, grad_norm = trainer.train_step()
        if not math.isfinite(loss):
            raise trainer.diverged("loss", loss)
        if not math.isfinite(grad_norm):
            raise trainer.diverged("gradient norm", grad_norm)
        trainer.optimizer.step(lr)
        trainer.iteration += 1
        done = trainer.iteration
        losses.append(loss)
        window.append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        if done % args.log_interval == 0 or done == args.train_iters:
            elapsed = time.perf_counter() - window_start
            record = {"iteration": done, "loss": float(numpy.mean(window)), "lr": lr,
                      "grad_norm": grad_norm, "tokens_per_s": len(window) * tokens_per_step / elapsed,
                      "tflops": len(window) * flops_per_step / elapsed / 1e12}
            if done % args.eval_interval == 0 or done == args.train_iters:
                record["val_loss"] = trainer.evaluate()
            if leader:
                bar.write(_format(record, args.train_iters))
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
            window, window_start = [], time.perf_counter()
        stop = bool(args.exit_interval) and done % args.exit_interval == 0
        signalled = exit_signal is not None and exit_signal.received(grid.world)
        if args.save and (done == args.train_iters or stop or signalled or
                          (args.save_interval and done % args.save_interval == 0)):
            trainer.save()
        if stop:
            echo(f"exiting at iteration {done} (--exit-interval {args.exit_interval})")
            break
        if signalled:
            saved = (f"checkpoint saved in {os.path.join(args.save, f'iter_{done:07d}')}"
                     if args.save else "nothing saved (no --save)")
            echo(f"{exit_signal.name} received: stopped after iteration {done}; {saved}")
            break
    bar.close()
    if log:
        log.close()
    if losses:
        echo(f"done: loss {losses[0]:.4f} -> {numpy.mean(losses[-10:]):.4f} (mean of the last "
             f"{min(10, len(losses))} iterations)")
    if args.sample_tokens and trainer.iteration == args.train_iters:
        if model.whole is None:
            echo("no sample: generation runs on one pipeline stage (PP = 1)")
        else:
            prompt = [int(t) for t in trainer.valid_sampler.tokens[:32]]
            ids = generate(model.whole, prompt, args.sample_tokens, temperature=0.8, top_k=40,
                           seed=args.seed)
            echo("sample (the first 32 validation tokens, then generated):\n"
                 + trainer.data.tokenizer.decode(ids))
    return losses


def open_log(path, append):
    try:
        return open(path, "a" if append else "w")
    except OSError as e:
        raise InputError(f"cannot write --log-file {path} ({e.strerror}); choose a writable file") from None


def _format(r, total):
    line = (f"iter {r['iteration']:>5}/{total} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"grad norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | "
            f"{r['tflops']:.4f} TFLOP/s")
    return line + (f" | val loss {r['val_loss']:.4f}" if "val_loss" in r else "")
