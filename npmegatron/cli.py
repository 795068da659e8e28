"""The `npmegatron` command line (click): train, bench step. Megatron-LM's flag names."""
import functools
import os
import re
import shutil
import subprocess
import sys

import click

from .autograd import InputError

POSITIVE = click.IntRange(min=1)


def user_errors(command):
    """Bad input ends the command with its one-sentence message and a non-zero exit, no
    traceback. Under mpirun it is printed once: by rank 0 when every rank hit it (then all exit
    normally), else by the rank that hit it, which aborts the job."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except InputError as error:
            from . import comm
            error = InputError(in_flag_names(str(error)))
            if comm.launch_size() > 1 and not comm.reports_input_error(error):
                sys.exit(1)
            raise click.ClickException(str(error)) from None
    return wrapper


def in_flag_names(message):
    """The library names parameters (`num_micro_batches`); a user of this command reads its
    flags (`--num-micro-batches`). Parameters the command has no flag for stay as they are."""
    context = click.get_current_context(silent=True)
    for param in context.command.params if context else ():
        if isinstance(param, click.Option) and "_" in param.name:
            flag = max(param.opts, key=len)
            message = re.sub(rf"(?<![-\w]){param.name}(?!\w)", flag, message)
    return message


class OneRankUsageErrors:
    """Every rank parses the same command line, so under mpirun rank 0 alone prints a usage
    error (an unknown flag, a bad value) and the other ranks exit with the same status quietly."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as error:
            from .comm import launch_rank
            if launch_rank() != 0:
                raise click.exceptions.Exit(error.exit_code) from None
            raise


class Command(OneRankUsageErrors, click.Command):
    pass


class Group(OneRankUsageErrors, click.Group):
    command_class = Command


Group.group_class = Group


def relaunch_under_mpiexec(ranks):
    """Run this same command line on `ranks` ranks with the environment's mpiexec."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        raise InputError("no mpiexec found; install the MPI extra (pip install 'npmegatron[mpi]') "
                         "or launch this command with your MPI's mpirun")
    command = [mpiexec, "-n", str(ranks), sys.executable, "-m", "npmegatron.cli"] + sys.argv[1:]
    return subprocess.call(command)


def model_options(defaults):
    """Megatron's model-shape flags, shared by `train` and `bench step`."""
    options = [
        click.option("--num-layers", type=POSITIVE, default=defaults["num_layers"], show_default=True,
                     help="Transformer layers."),
        click.option("--hidden-size", type=POSITIVE, default=defaults["hidden_size"], show_default=True,
                     help="Hidden (embedding) size."),
        click.option("--num-attention-heads", type=POSITIVE, default=defaults["num_attention_heads"],
                     show_default=True, help="Attention heads; must divide --hidden-size."),
        click.option("--seq-length", type=POSITIVE, default=defaults["seq_length"], show_default=True,
                     help="Tokens per sample."),
        click.option("--micro-batch-size", type=POSITIVE, default=defaults["micro_batch_size"],
                     show_default=True, help="Samples per forward/backward."),
        click.option("--dtype", type=click.Choice(["float32", "float64"]), default="float32",
                     show_default=True, help="Parameter and activation precision."),
        click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu",
                     show_default=True, help="NumPy on the CPU or CuPy on the GPU."),
    ]
    return lambda f: functools.reduce(lambda g, option: option(g), reversed(options), f)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """npmegatron: Megatron-LM's model parallelism on NumPy and CuPy."""


@main.command()
@model_options({"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 128,
                "micro_batch_size": 16})
@click.option("--tensor-model-parallel-size", "--tp", "tensor_model_parallel_size", type=int, default=1,
              show_default=True, help="Tensor-parallel ranks (launch with mpirun -n TP).")
@click.option("--pipeline-model-parallel-size", "--pp", "pipeline_model_parallel_size", type=int, default=1,
              show_default=True, help="Pipeline stages (ranks = TP x PP x DP).")
@click.option("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
              help="Layers per virtual stage: interleaved schedule with num-layers / (PP x this) stages per rank.")
@click.option("--pipeline-model-parallel-layout", default=None,
              help="Stages as a string, e.g. 'Et*3|(tt|)*4,tL' (E embedding, t layer, L loss, | stage).")
@click.option("--pipeline-schedule", type=click.Choice(["1f1b", "afab", "interleaved"]), default=None,
              help="Default: 1f1b, or interleaved with virtual stages.")
@click.option("--num-micro-batches", type=int, default=None,
              help="Micro-batches per step on each DP rank (default: from --global-batch-size).")
@click.option("--deallocate-pipeline-outputs/--no-deallocate-pipeline-outputs", default=True,
              show_default=True, help="Free a stage's output data once it is sent.")
@click.option("--variable-seq-lengths", is_flag=True, help="Exchange shapes before each activation.")
@click.option("--overlap-p2p-communication/--no-overlap-p2p-communication", default=True,
              show_default=True, help="Post the next receive before the current compute.")
@click.option("--sequence-parallel", is_flag=True, help="LayerNorm and dropout on sequence shards.")
@click.option("--max-position-embeddings", type=int, default=None,
              help="Length of the position table (default: --seq-length).")
@click.option("--global-batch-size", type=int, default=None,
              help="Samples per optimizer step = micro-batch x accumulation x DP (default: micro-batch x DP).")
@click.option("--train-iters", type=int, default=1000, show_default=True, help="Optimizer steps.")
@click.option("--lr", type=float, default=2e-3, show_default=True, help="Peak learning rate.")
@click.option("--min-lr", type=float, default=1e-4, show_default=True, help="Final learning rate.")
@click.option("--lr-warmup-iters", type=int, default=100, show_default=True, help="Linear warmup steps.")
@click.option("--lr-decay-style", type=click.Choice(["cosine", "linear", "constant"]),
              default="cosine", show_default=True, help="Decay after warmup.")
@click.option("--weight-decay", type=float, default=0.01, show_default=True,
              help="AdamW decay (not on biases and LayerNorm).")
@click.option("--clip-grad", type=float, default=1.0, show_default=True,
              help="Global gradient-norm clip (0: off).")
@click.option("--hidden-dropout", type=float, default=0.0, show_default=True,
              help="Dropout on embeddings and residual branches.")
@click.option("--attention-dropout", type=float, default=0.0, show_default=True,
              help="Dropout on attention probabilities.")
@click.option("--seed", type=click.IntRange(min=0), default=1234, show_default=True, help="Seed of weights, data, dropout.")
@click.option("--log-interval", type=int, default=50, show_default=True, help="Steps per log line.")
@click.option("--eval-interval", type=int, default=250, show_default=True,
              help="Steps between validation losses.")
@click.option("--eval-iters", type=int, default=10, show_default=True, help="Validation batches.")
@click.option("--log-file", type=click.Path(dir_okay=False), default=None,
              help="Write metrics as JSON lines here.")
@click.option("--data-path", default=None,
              help="PREFIX written by `npmegatron preprocess` (default: the embedded corpus).")
@click.option("--save", default=None, help="Checkpoint folder to write (locked while the run lasts).")
@click.option("--overwrite", is_flag=True,
              help="Replace another run's checkpoints in --save (by default that is refused).")
@click.option("--exit-signal-handler", is_flag=True,
              help="On SIGTERM, finish the iteration, save (with --save) and exit 0.")
@click.option("--load", default=None, help="Checkpoint folder to resume from.")
@click.option("--save-interval", type=int, default=None, help="Steps between checkpoints (default: at the end).")
@click.option("--exit-interval", type=int, default=None,
              help="Save (with --save) and stop when the iteration is a multiple of this.")
@click.option("--ddp-bucket-size", type=int, default=2 ** 20, show_default=True,
              help="Parameters per data-parallel gradient all-reduce.")
@click.option("--sample-tokens", type=int, default=200, show_default=True,
              help="Tokens to generate at the end (0: none).")
@user_errors
def train(**options):
    """Train GPT-2 on the embedded corpus (the standard library's .py files, byte-level) or on
    --data-path. Under mpirun -n N with --tp T: T-way tensor parallel, N/T-way data parallel."""
    from .training import TrainArgs, train as run_training
    args = TrainArgs(**options)
    run_training(args, echo=click.echo)


@main.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("--output", "-o", required=True, help="PREFIX: writes PREFIX.bin and PREFIX.json.")
@click.option("--tokenizer", "tokenizer_file", default=None,
              help="A local Hugging Face tokenizer.json (default: byte-level, vocabulary 256).")
@user_errors
def preprocess(inputs, output, tokenizer_file):
    """Tokenize text files or folders into a memory-mapped token file for --data-path."""
    from .data import preprocess as run_preprocess
    index = run_preprocess(inputs, output, tokenizer_file)
    click.echo(f"{output}.bin: {index['num_tokens']:,} tokens ({index['dtype']}) from "
               f"{len(index['sources'])} documents, vocabulary {index['vocab_size']:,}")


@main.command()
@click.option("--load", required=True, help="Checkpoint folder (a --save folder).")
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-tokens", type=int, default=200, show_default=True, help="Tokens to generate.")
@click.option("--temperature", type=float, default=0.8, show_default=True, help="0: greedy.")
@click.option("--top-k", type=int, default=40, show_default=True, help="Sample among the k likeliest (0: all).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Sampling seed.")
@click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True)
@user_errors
def generate(load, prompt, max_tokens, temperature, top_k, seed, device):
    """Continue a prompt from a checkpoint with a key/value cache; tensor-parallel under
    mpirun -n TP (the checkpoint's TP size)."""
    if max_tokens < 1:
        raise InputError(f"--max-tokens {max_tokens} must be a positive integer")
    from .data import utf8_bytes
    utf8_bytes(prompt, "--prompt")      # before the checkpoint loads: argv bytes need not be UTF-8
    from .generation import generate as run_generate, load_for_generation
    model, tokenizer = load_for_generation(load, device)
    ids = run_generate(model, tokenizer.encode(prompt), max_tokens, temperature, top_k or None, seed)
    if model.grid.rank == 0:
        click.echo(tokenizer.decode(ids))


@main.group()
def bench():
    """Benchmarks that report a ratio to the machine's own ceiling."""


@bench.command("step")
@model_options({"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 256,
                "micro_batch_size": 8})
@click.option("--vocab-size", type=POSITIVE, default=256, show_default=True, help="Vocabulary size.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed steps first.")
@click.option("--iters", type=POSITIVE, default=5, show_default=True, help="Timed steps (median reported).")
@user_errors
def bench_step_command(num_layers, hidden_size, num_attention_heads, seq_length, micro_batch_size,
                       dtype, device, vocab_size, warmup, iters):
    """Time forward + backward + SGD step against the matmul FLOP/s at the model's GEMM shapes."""
    from . import comm
    if comm.launch_size() > 1:
        # Every rank would time its own copy and print its own table. Rank 0 alone says so, without
        # user_errors, which under mpirun starts MPI to meet ranks that have already exited.
        if comm.launch_rank() != 0:
            sys.exit(1)
        raise click.ClickException(f"bench step times one process, but mpirun started "
                                   f"{comm.launch_size()} ranks; run it without mpirun")
    from .bench import bench_step, format_table
    from .model import GPTConfig
    cfg = GPTConfig(num_layers=num_layers, hidden_size=hidden_size,
                    num_attention_heads=num_attention_heads, vocab_size=vocab_size,
                    max_position_embeddings=seq_length, hidden_dropout=0.0, attention_dropout=0.0,
                    dtype=dtype, device=device)
    click.echo(format_table(bench_step(cfg, micro_batch_size, seq_length, warmup, iters)))


@bench.command("comm")
@click.option("--ranks", type=int, default=None,
              help="Launch this many ranks with mpiexec (default: 2, or the ranks mpirun started).")
@click.option("--min-bytes", type=int, default=1024, show_default=True, help="Smallest message.")
@click.option("--max-bytes", type=int, default=64 * 2 ** 20, show_default=True, help="Largest message.")
@click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
              help="NumPy buffers through MPI, or CuPy buffers (NCCL when each rank has a GPU).")
@user_errors
def bench_comm_command(ranks, min_bytes, max_bytes, device):
    """All-reduce, all-gather, reduce-scatter and send/recv bandwidth with an alpha-beta fit."""
    if not 1 <= min_bytes <= max_bytes:
        raise InputError(f"--min-bytes {min_bytes} and --max-bytes {max_bytes} must satisfy "
                         "1 <= min <= max")
    if ranks is not None and ranks < 2:
        raise InputError(f"--ranks {ranks} must be at least 2; bench comm measures traffic between ranks")
    from . import comm
    if not comm.launched_by_mpi():      # one rank alone would time no-ops: absurd bandwidths
        sys.exit(relaunch_under_mpiexec(ranks or 2))
    if comm.init().size < 2:
        raise InputError("bench comm runs on 1 rank but measures traffic between ranks; launch it with "
                         "mpirun -n 2 or more, or without mpirun")
    from .bench_comm import bench_comm, format_report
    result = bench_comm(min_bytes, max_bytes, device)
    if comm.init().rank == 0:
        click.echo(format_report(result))


@bench.command("pipeline")
@model_options({"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128,
                "micro_batch_size": 4})
@click.option("--num-micro-batches", type=POSITIVE, default=8, show_default=True, help="M per step.")
@click.option("--ranks", type=POSITIVE, default=None, help="Launch this many pipeline ranks with mpiexec.")
@click.option("--iters", type=POSITIVE, default=5, show_default=True, help="Timed steps (median reported).")
@user_errors
def bench_pipeline_command(num_layers, hidden_size, num_attention_heads, seq_length, micro_batch_size,
                           dtype, device, num_micro_batches, ranks, iters):
    """Peak tape memory per stage for each schedule (with and without output deallocation) and
    1F1B step time with and without receives posted ahead of compute."""
    from . import comm
    if ranks is not None and not comm.launched_by_mpi():
        sys.exit(relaunch_under_mpiexec(ranks))
    from .bench_pipeline import format_memory, memory_table, overlap_timing
    from .model import GPTConfig
    world = comm.init()
    cfg = GPTConfig(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                    vocab_size=256, max_position_embeddings=seq_length, hidden_dropout=0.0,
                    attention_dropout=0.0, dtype=dtype, device=device)
    table = memory_table(cfg, world.size, num_micro_batches, micro_batch_size, seq_length)
    timing = overlap_timing(cfg, world.size, num_micro_batches, micro_batch_size, seq_length, iters)
    if world.rank == 0:
        click.echo(f"PP={world.size}, M={num_micro_batches}, {num_layers} layers, hidden {hidden_size}, "
                   f"micro-batch {micro_batch_size} x {seq_length}, {dtype}")
        click.echo(format_memory(table))
        click.echo(f"1F1B step: {timing[False]:.4f} s without overlap, {timing[True]:.4f} s with "
                   f"receives posted ahead ({(timing[False] / timing[True] - 1) * 100:+.1f} %)")


if __name__ == "__main__":
    sys.exit(main())
