"""Where a run's interval figures go besides the log line and --log-file: TensorBoard event files
(--tensorboard-dir, written by tensorboardX, no torch) and Weights & Biases (--wandb-project, the
optional `wandb` package; WANDB_MODE=offline writes its run folder without a network). Scalars
carry Megatron-LM's names where it has them, so dashboards made for Megatron runs read these.
Only rank 0 writes, as with the log."""
import importlib
import math
import os

from .. import config_file
from ..autograd import InputError

#: record key -> the scalar's name (Megatron-LM's: training_log and evaluate_and_print_results)
SCALARS = {
    "loss": "lm loss",
    "val_loss": "lm loss validation",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "loss_scale": "loss-scale",
    "tflops_per_rank": "throughput",               # Megatron: TFLOP/s per GPU
    "tokens_per_s": "tokens-per-second",
    "mfu": "model-flops-utilisation",
    "iteration_s": "iteration-time",
    "memory_bytes_max": "mem-max-allocated-bytes",
    "load_balancing_loss": "load_balancing_loss",     # Megatron-Core's MoE names
    "z_loss": "z_loss",
    "tokens_per_expert_max_over_mean": "tokens-per-expert-max-over-mean",
    "dropped_tokens": "dropped-tokens",
}


def scalars(record):
    """{name: value} of an interval's record, perplexity of the validation loss included."""
    values = {name: float(record[key]) for key, name in SCALARS.items() if record.get(key) is not None}
    if "val_loss" in record:
        values["lm loss validation ppl"] = math.exp(min(record["val_loss"], 700.0))
    return values


def _module(name, flag, install):
    try:
        return importlib.import_module(name)
    except ImportError:
        raise InputError(f"{flag} needs the {name} package, which is not installed: {install}") from None


class Trackers:
    """The trackers a configuration asks for (none: every call does nothing)."""

    def __init__(self, config, echo):
        self.writers = []
        if not echo:
            return
        if config.tensorboard_dir:
            tensorboardX = _module("tensorboardX", "--tensorboard-dir", "pip install tensorboardX")
            os.makedirs(config.tensorboard_dir, exist_ok=True)
            self.writers.append(TensorBoard(tensorboardX.SummaryWriter(config.tensorboard_dir)))
        if config.wandb_project:
            wandb = _module("wandb", "--wandb-project", "pip install 'npmegatron[wandb]'")
            folder = config.wandb_save_dir or (os.path.join(config.save, "wandb") if config.save else "wandb")
            os.makedirs(folder, exist_ok=True)
            run = wandb.init(project=config.wandb_project, name=config.wandb_exp_name, dir=folder,
                             config=config_file.resolved(config))
            self.writers.append(WeightsAndBiases(run))

    def write(self, record):
        values = scalars(record)
        for writer in self.writers:
            writer.write(values, record["iteration"])

    def close(self):
        for writer in self.writers:
            writer.close()


class TensorBoard:
    def __init__(self, writer):
        self.writer = writer

    def write(self, values, iteration):
        for name, value in values.items():
            self.writer.add_scalar(name, value, iteration)
        self.writer.flush()

    def close(self):
        self.writer.close()


class WeightsAndBiases:
    def __init__(self, run):
        self.run = run

    def write(self, values, iteration):
        self.run.log(values, step=iteration)

    def close(self):
        self.run.finish()
