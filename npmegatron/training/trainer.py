"""The training run, shared by `scripts/train.py` (under mpirun) and `npmegatron train`.

nanoGPT's shape, Megatron's names: a Trainer builds the grid, data and model (or resumes them
from a checkpoint), then `fit()` runs the iterations: the training step over the micro-batches
(step.py), clip, optimizer step, log, evaluate, save. The global batch is micro-batch x
micro-batches x data-parallel size, and sample k of the run is the same whatever that split, so
every layout follows the same trajectory.
"""
import contextlib
import dataclasses
import math
import os
import time
import uuid

import numpy

from .. import comm, config_file
from ..autograd import InputError
from ..autograd.backend import to_numpy
from ..checkpointing import checkpoint
from ..checkpointing.save_folder import SaveFolder
from ..config import TrainConfig
from ..data import TrainingData
from ..generation import generate
from ..optim.adamw import scheduled_learning_rate
from ..optim.loss_scale import build_loss_scale
from ..perf.fit import refuse_unless_fits, run_shape
from ..pipeline import run_schedule
from ..run import assemble
from ..timers import NO_TIMERS, OPTIMIZER
from .cuda_graph import GraphedStep
from .log import TrainingLog
from .metrics import MemoryLog, current_resident_bytes, run_timers
from .step import clip_after_step, schedule_options, setup_objects_frozen, sum_losses, train_step


#: Where the end-of-run sample's prompt ends and the generated text begins.
PROMPT_END = " ▶ "


class TrainingDiverged(InputError):
    """The loss or gradient norm stopped being finite; nothing of that step was saved (nor applied,
    but under --cuda-graph, whose graph applies its update)."""


class Trainer:
    """One training run on this rank: built from a TrainConfig, run by fit()."""

    def __init__(self, config: TrainConfig, timers=NO_TIMERS):
        # --load of a folder with no checkpoint yet: this is the first run of a job that resumes
        # from the same folder when requeued (Megatron's behaviour); fit() says so
        self.starts_fresh = bool(config.load) and not checkpoint.holds_checkpoint(config.load)
        if self.starts_fresh and config.finetune:
            raise InputError(f"--finetune starts from the weights in --load {config.load}, but it holds no "
                             "checkpoint; pass the folder of the checkpoint to fine-tune")
        if config.use_checkpoint_args and not self.starts_fresh:
            config = config.with_checkpoint_args(checkpoint.read_manifest(config.load)[1])
        self.config, self.timers = config, timers     # timers.py: off unless a Timers is passed
        self.data = TrainingData(config.data_path, config.split)
        baseline = current_resident_bytes()         # --log-memory: the process before the model
        # Before anything is allocated: a model too large for this rank's memory is one sentence.
        refuse_unless_fits(dataclasses.replace(config.model, vocab_size=self.data.vocab_size),
                           run_shape(config, config.plan(comm.launch_size())))
        run = assemble(config, vocab_size=self.data.vocab_size)
        self.plan, self.grid, self.cfg, self.model, self.schedule = run.plan, run.grid, run.cfg, run.model, run.schedule
        self.exchange, self.params, self.buckets, self.optimizer = run.exchange, run.params, run.buckets, run.optimizer
        self.norm_skip = run.norm_skip            # what counts once in the global norm
        if timers is NO_TIMERS:
            self.timers = run_timers(self) or NO_TIMERS     # --timing-log-level 1
        self.memory_log = MemoryLog(self, baseline) if config.log_memory else None
        self.sampler = self.data.sampler("train", config.seq_length, self.cfg.seed)
        self.valid_sampler = self.data.sampler("valid", config.seq_length, self.cfg.seed + 1)
        self.loss_scale = build_loss_scale(config)  # --fp16 (loss_scale.py), else None
        self.iteration, self.last_saved, self.last_saved_in, self.skipped = 0, None, None, 0
        self.run_id = uuid.uuid4().hex      # rank 0's is the one recorded; a resumed run keeps its own
        if config.load and not self.starts_fresh:
            self._resume()
        self.save_folder = None
        if config.save:
            self.save_folder = SaveFolder(config.save, self.run_id, self.grid.world, config.overwrite,
                                          resuming=resumes_in_place(config.load, config.save))
        comm.set_resume_hint(self.resume_hint())
        comm.set_checkpoint_folder(config.save)
        self.graphed = GraphedStep(self, config) if config.cuda_graph else None     # --cuda-graph (cuda_graph.py)

    def _resume(self):
        config = self.config
        manifest = checkpoint.load(config.load, self.model, self.optimizer, self.grid, self.plan.layout,
                                   optimizer_state=not (config.no_load_optim or config.finetune),
                                   rng=not (config.no_load_rng or config.finetune))
        if config.finetune:         # the weights only: iteration 0, the data from its start, a new run
            return
        self.iteration = self.last_saved = manifest["iteration"]
        self.last_saved_in = self.config.load
        self.run_id = manifest.get("run_id", self.run_id)
        self.skipped = manifest.get("skipped_iterations", 0)
        if self.loss_scale is not None and manifest.get("loss_scale") and not config.no_load_optim:
            self.loss_scale.load_state_dict(manifest["loss_scale"])
        saved_batch = manifest.get("data", {}).get("global_batch_size")
        if saved_batch is not None and saved_batch != self.plan.global_batch:   # None: converted weights
            raise InputError(f"checkpoint {self.config.load} was trained with global batch {saved_batch}, "
                             f"this run has {self.plan.global_batch}; pass --global-batch-size {saved_batch}")

    def micro_batches(self, sampler, step):
        """This rank's micro-batches of global batch `step`: samples are numbered globally, DP rank
        r takes the r-th contiguous share, so the split never changes what is trained on."""
        size, count = self.config.micro_batch_size, self.plan.micro_batches
        first = step * self.plan.global_batch + self.grid.dp_rank * count * size
        return [sampler.batch(first + j * size, size) for j in range(count)]

    def mean_loss(self, loss_sum, count):
        """The mean over micro-batches and DP replicas of losses summed on the last stage."""
        return float(to_numpy(sum_losses(self.model, loss_sum))[0]) / (count * self.grid.dp_size)

    def train_step(self):
        """Forward and backward over the micro-batches, DP average, unscale, clip. Returns (loss,
        norm). The loss and the squared gradient norm reach the host together: one synchronisation."""
        self.model.rng.iteration = self.iteration           # dropout masks are keyed by it
        scale = self.loss_scale.scale if self.loss_scale else 1.0
        # Under loss scaling an overflow is expected now and then (the step is skipped): NumPy's
        # warnings about the inf and NaN it makes would be noise.
        with numpy.errstate(over="ignore", invalid="ignore") if self.loss_scale else contextlib.nullcontext():
            loss_sum = train_step(self.model, self.exchange, self.micro_batches(self.sampler, self.iteration),
                                  self.buckets, self.schedule, self.timers, loss_scale=scale,
                                  **schedule_options(self.config.parallel))
        with self.timers(OPTIMIZER):        # the norm's reduction and clipping, as Megatron times them
            loss_total, norm = clip_after_step(self.model, self.params, loss_sum, self.norm_skip,
                                               self.config.clip_grad, self.optimizer, scale)
        return loss_total / (self.plan.micro_batches * self.grid.dp_size), norm

    def step(self):
        """One optimizer step; (loss, gradient norm, learning rate). Nothing is applied when the
        loss or the norm is not finite: under loss scaling, a step whose gradients overflowed is
        skipped and counted (Megatron's rule), otherwise training stops. As in Megatron, the
        learning-rate schedule counts applied steps only."""
        config = self.config
        lr = scheduled_learning_rate(config, self.iteration - self.skipped, self.plan.global_batch)
        if self.graphed is not None:
            return self._graphed_step(lr)
        loss, norm = self.train_step()
        overflow = self.loss_scale is not None and not math.isfinite(norm)
        if self.loss_scale is not None:
            self.loss_scale.update(overflow)
        if overflow:
            self.skipped += 1
        else:
            for what, value in (("loss", loss), ("gradient norm", norm)):
                if not math.isfinite(value):
                    raise self.diverged(what, value)
            with self.timers(OPTIMIZER):
                self.optimizer.step(lr)
        self.iteration += 1
        if self.memory_log is not None and not self.memory_log.settled:
            self.memory_log.settle()
        return loss, norm, lr

    def _graphed_step(self, lr):
        """step() under --cuda-graph: the update is part of the graph, so a loss or norm that is not
        finite stops the run after it (a graph cannot skip an update the host has not seen yet)."""
        total, norm = self.graphed.run(self.micro_batches(self.sampler, self.iteration), lr, self.iteration)
        loss = total / (self.plan.micro_batches * self.grid.dp_size)
        for what, value in (("loss", loss), ("gradient norm", norm)):
            if not math.isfinite(value):
                raise self.diverged(what, value)
        self.iteration += 1
        return loss, norm, lr

    def evaluate(self, sampler=None):
        """The mean loss over --eval-iters global batches of `sampler` (default: validation's)."""
        sampler = sampler or self.valid_sampler
        self.model.eval()
        total = 0.0
        for k in range(self.config.eval_iters):
            total += run_schedule(self.model, self.exchange, self.micro_batches(sampler, k),
                                  self.schedule, forward_only=True, **schedule_options(self.config.parallel))
        self.model.train()
        return self.mean_loss(total, self.config.eval_iters * self.plan.micro_batches)

    def save(self):
        config = self.config
        extra = {"run_id": self.run_id, "pipeline_layout": self.plan.layout,
                 "data": {"consumed_samples": self.iteration * self.plan.global_batch,
                          "global_batch_size": self.plan.global_batch, "seed": self.cfg.seed,
                          "data_path": config.data_path, "split": config.split},
                 "skipped_iterations": self.skipped,
                 "loss_scale": self.loss_scale.state_dict() if self.loss_scale else None,
                 "tokenizer": self.data.tokenizer.spec, "args": dataclasses.asdict(config)}
        files = {"config.yaml": config_file.dump(config).encode()}     # the run as --config reads it
        if self.data.tokenizer_file:
            files["tokenizer.json"] = self.data.tokenizer_file
        folder = checkpoint.save(config.save, self.iteration, self.model, self.optimizer, self.grid,
                                 extra, files)
        self.save_folder.saved(folder)
        self.last_saved, self.last_saved_in = self.iteration, config.save
        comm.set_resume_hint(self.resume_hint())
        return folder

    def resume_hint(self):
        """Where a run stopped now would resume from: the sentence naming a rank whose process
        died ends with it (comm.set_resume_hint)."""
        if self.last_saved is None:
            return "no checkpoint was saved yet" if self.config.save else "no checkpoint was saved (no --save)"
        return f"resume with --load {self.last_saved_in} (latest: iter_{self.last_saved:07d})"

    def diverged(self, what, value):
        kept = (f"the last checkpoint (iteration {self.last_saved} in {self.config.save or self.config.load}) "
                "is untouched" if self.last_saved is not None else "no checkpoint was written")
        stopped = ("training stopped (the CUDA graph had applied the step)" if self.graphed is not None
                   else "training stopped before applying it")
        return TrainingDiverged(f"the {what} became {value} at iteration {self.iteration + 1}, so "
                                f"{stopped}; {kept}; lower --lr or raise --lr-warmup-iters")

    def fit(self, echo=print, exit_signal=None):
        """Train to --train-iters (or --exit-interval, or a noted exit signal): log, evaluate,
        save, and sample at the end. Returns this run's per-iteration losses (the same on every
        rank); only rank 0 prints."""
        config, losses = self.config, []
        log = TrainingLog(self, echo if self.grid.rank == 0 else None)
        self.started = time.monotonic()         # --exit-duration-in-mins counts from here
        try:
            with setup_objects_frozen():
                self._iterate(losses, log, exit_signal)
        finally:
            log.close()
        log.summary(losses)
        if config.sample_tokens and self.iteration == config.train_iters:
            log.say(self.sample())
        return losses

    def _iterate(self, losses, log, exit_signal):
        """fit()'s loop: step, log, evaluate, save, until done or told to stop."""
        config = self.config
        while self.iteration < config.train_iters:
            loss, norm, lr = self.step()
            losses.append(loss)
            log.iteration(loss)
            done, last = self.iteration, self.iteration == config.train_iters
            if done % config.log_interval == 0 or last:
                evaluate = done % config.eval_interval == 0 or last
                started = time.perf_counter()
                val_loss = self.evaluate() if evaluate else None
                log.interval(done, lr, norm, val_loss, self.scaling(), time.perf_counter() - started)
            if self._save_or_stop(log, exit_signal):
                return

    def scaling(self):
        """The loss scale and the skipped steps so far, for the log (None without loss scaling)."""
        if self.loss_scale is None:
            return None
        return {"loss_scale": self.loss_scale.scale, "skipped_iterations": self.skipped}

    def _save_or_stop(self, log, exit_signal):
        """Save when due; True when the run stops here (--exit-interval, --exit-duration-in-mins, or
        an exit signal)."""
        config, done = self.config, self.iteration
        stop = bool(config.exit_interval) and done % config.exit_interval == 0
        late = config.exit_duration_in_mins is not None and self._past_duration()
        signalled = exit_signal is not None and exit_signal.received(self.grid.world)
        if config.save and (done == config.train_iters or stop or late or signalled or
                            (config.save_interval and done % config.save_interval == 0)):
            log.say(f"saved {os.path.basename(self.save())} in {config.save}")
        if stop:
            log.say(f"exiting at iteration {done} (--exit-interval {config.exit_interval})")
        elif late:
            saved = f"saved in {config.save}" if config.save else "nothing saved (no --save)"
            log.say(f"exiting at iteration {done}: {config.exit_duration_in_mins:g} minutes of training are "
                    f"over (--exit-duration-in-mins); {saved}")
            return True
        elif signalled:
            saved = (f"checkpoint saved in {os.path.join(config.save, f'iter_{done:07d}')}"
                     if config.save else "nothing saved (no --save)")
            log.say(f"{exit_signal.name} received: stopped after iteration {done}; {saved}")
        return stop or signalled

    def _past_duration(self):
        """Collective: whether any rank has trained longer than --exit-duration-in-mins, so that
        every rank stops after the same iteration."""
        over = time.monotonic() - self.started > 60.0 * self.config.exit_duration_in_mins
        return bool(to_numpy(comm.all_reduce(numpy.array([int(over)]), self.grid.world, "max"))[0])

    def sample(self):
        """Text generated from the first validation tokens, 32 or as many as the model's positions
        (over the pipeline stages when PP > 1)."""
        if self.model.whole is None and (self.cfg.sequence_parallel or self.grid.cp_size > 1):
            return "no sample: generation over pipeline stages needs sequence and context parallelism off"
        prompt = [int(t) for t in self.valid_sampler.tokens[:min(32, self.cfg.max_position_embeddings)]]
        ids = generate(self.model, prompt, self.config.sample_tokens, temperature=0.8, top_k=40,
                       seed=self.cfg.seed)
        decode = self.data.tokenizer.decode
        return (f"sample (the first {len(prompt)} validation tokens, then what the model generated after "
                f"{PROMPT_END!r}):\n{decode(ids[:len(prompt)])}{PROMPT_END}{decode(ids[len(prompt):])}")

    def close(self):
        """Let go of the --save folder's lock (also dropped when the process ends), and stop
        tracing allocations (--log-memory)."""
        if self.save_folder is not None:
            self.save_folder.release()
        if self.memory_log is not None:
            self.memory_log.close()


def resumes_in_place(load, save):
    """True when --load names the --save folder (or one of its iteration folders)."""
    if not load or not save:
        return False
    load = os.path.realpath(load)
    return os.path.realpath(save) in (load, os.path.dirname(load))


def train(config: TrainConfig, echo=print):
    """Train (or resume); returns the per-iteration losses of this run (the same on every rank).
    With --exit-signal-handler, SIGTERM is noted from the very start, before the slow set-up."""
    exit_signal = comm.ExitSignal() if config.exit_signal_handler else None
    trainer = None
    try:
        trainer = Trainer(config)
        return trainer.fit(echo, exit_signal)
    finally:
        if trainer is not None:
            trainer.close()
        if exit_signal is not None:
            exit_signal.restore()
