"""`npmegatron evaluate`: a checkpoint's validation and test loss and perplexity, per token and
per byte, at any layout and without training. It reads the batches `train`'s evaluations read
(--eval-iters global batches of each held-out part, from its start), so the validation loss is
the one the training run printed at its last evaluation; the test part is --split's third."""
import math

from ..autograd import InputError
from ..checkpointing import checkpoint
from ..config import GPTConfig, ParallelConfig, TrainConfig, check_given
from .trainer import Trainer


#: What evaluate takes from the checkpoint's training run unless given: its data, its held-out
#: parts and the batches of its evaluations.
FROM_THE_RUN = ("data_path", "split", "eval_iters", "micro_batch_size", "global_batch_size")


def evaluation_config(load, **given):
    """The TrainConfig that evaluates checkpoint `load`: the flags given (None: not given), the
    rest of FROM_THE_RUN from the run that saved it, the model's shape from its manifest. The
    flags are checked first, so a bad one is named whether or not the checkpoint is there."""
    check_given(given, TrainConfig, ParallelConfig, GPTConfig)
    if not load:
        raise InputError("evaluate needs the checkpoint to evaluate; pass --load DIR")
    if not checkpoint.holds_checkpoint(load):
        raise InputError(f"--load {load} holds no checkpoint; pass the --save folder of a training run")
    saved = checkpoint.read_manifest(load)[1].get("args", {})
    options = {name: given.pop(name, None) for name in FROM_THE_RUN}
    options = {name: saved.get(name) if value is None else value for name, value in options.items()}
    options = {name: value for name, value in options.items() if value is not None}
    return TrainConfig.from_flat(load=load, use_checkpoint_args=True, train_iters=1, sample_tokens=0,
                                 **options, **{k: v for k, v in given.items() if v is not None})


def evaluate_checkpoint(config):
    """{"iteration", "validation": {...}, "test": {...} or None} of the checkpoint config.load."""
    trainer = Trainer(config)
    try:
        seed, seq = trainer.cfg.seed, trainer.config.seq_length
        parts = {"validation": trainer.valid_sampler, "test": trainer.data.sampler("test", seq, seed + 2)}
        return {"checkpoint": config.load, "iteration": trainer.iteration, "eval_iters": config.eval_iters,
                **{name: None if sampler is None else _scores(trainer, sampler) for name, sampler in parts.items()}}
    finally:
        trainer.close()


def _scores(trainer, sampler):
    """Loss and perplexity per token and per byte over the evaluation's batches of `sampler`."""
    loss = trainer.evaluate(sampler)
    tokens, nbytes = _tokens_and_bytes(trainer, sampler)
    per_byte = loss * tokens / nbytes
    return {"loss": loss, "perplexity": math.exp(loss), "loss_per_byte": per_byte,
            "perplexity_per_byte": math.exp(per_byte), "tokens": tokens, "bytes": nbytes}


def _tokens_and_bytes(trainer, sampler):
    """The predicted tokens of the evaluation's global batches (all data-parallel shares), and
    the bytes of text they stand for."""
    size, tokenizer, tokens, nbytes = trainer.config.micro_batch_size, trainer.data.tokenizer, 0, 0
    for k in range(trainer.config.eval_iters):
        for first in range(k * trainer.plan.global_batch, (k + 1) * trainer.plan.global_batch, size):
            _, targets = sampler.batch(first, size)
            tokens += targets.size
            nbytes += sum(tokenizer.byte_count(row) for row in targets)
    return tokens, nbytes


def format_scores(result):
    lines = [f"checkpoint {result['checkpoint']} (iteration {result['iteration']}), "
             f"{result['eval_iters']} global batch(es) of each held-out part:"]
    for name in ("validation", "test"):
        s = result[name]
        lines.append(f"  {name}: no such part (--split gives a test part)" if s is None else
                     f"  {name}: loss {s['loss']:.6f} (perplexity {s['perplexity']:.3f}) per token, "
                     f"{s['loss_per_byte']:.6f} (perplexity {s['perplexity_per_byte']:.3f}) per byte, over "
                     f"{s['tokens']:,} tokens = {s['bytes']:,} bytes")
    return "\n".join(lines)
