"""The `npmegatron` command line (click): train, preprocess, generate, convert, bench
step|comm|pipeline|scaling.
Megatron-LM's flag names; the training and model flags are generated from config.py's fields."""
import contextlib
import json
import os
import sys
import tempfile
import time

import click

from .autograd import InputError
from . import config_file
from .cli_support import (Group, config_options, model_preset_option, relaunch_under_mpiexec, user_errors,
                          with_config_file, with_model_preset)
from .config import TRAIN_MODEL_DEFAULTS, GPTConfig, ParallelConfig, TrainConfig, check_given

POSITIVE = click.IntRange(min=1)
BENCH_MODEL_FIELDS = {"num_layers", "hidden_size", "num_attention_heads", "vocab_size", "dtype", "device",
                      "tf32", "fp16", "bf16"}
BENCH_BATCH_FIELDS = {"seq_length", "micro_batch_size"}


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """npmegatron: Megatron-LM's model parallelism on NumPy and CuPy."""


@main.command()
@config_options(GPTConfig, skip={"vocab_size"}, defaults=TRAIN_MODEL_DEFAULTS)
@config_options(ParallelConfig)
@config_options(TrainConfig)
@click.option("--config", "config_path", default=None, help="A YAML, TOML or JSON file of these flags, their "
              "names as keys (sections allowed); flags on the command line override it.")
@click.option("--print-config", is_flag=True, help="Print the resolved configuration (as --config reads it, "
              "and as each checkpoint's config.yaml holds it) and exit.")
@user_errors
def train(config_path, print_config, **options):
    """Train GPT-2 on the embedded corpus (the standard library's .py files, byte-level) or on
    --data-path. Under mpirun -n N: TP x PP ranks per replica, N / (TP x PP) data-parallel replicas."""
    config = TrainConfig.from_flat(**with_config_file(config_path, options))
    if print_config:
        click.echo(config_file.dump(config), nl=False)
        return
    from .training import train as run_training
    run_training(config, echo=click.echo)


@main.command()
@config_options(TrainConfig, only={"load", "data_path", "split", "eval_iters", "micro_batch_size",
                                   "global_batch_size"},
                defaults={"eval_iters": None, "micro_batch_size": None})
@config_options(ParallelConfig, only={"tensor_model_parallel_size", "pipeline_model_parallel_size"})
@config_options(GPTConfig, only={"device"})
@user_errors
def evaluate(**options):
    """A checkpoint's validation and test loss and perplexity, per token and per byte, without
    training, at any layout (mpirun -n TP x PP x DP). By default on the data, held-out parts and
    batches of the run that saved it, so the validation loss is the one its last evaluation
    printed; the test part is --split's third. The last line is the result as JSON."""
    from . import comm
    from .training.evaluate import evaluate_checkpoint, evaluation_config, format_scores
    result = evaluate_checkpoint(evaluation_config(**options))
    if comm.launch_rank() == 0:
        click.echo(format_scores(result))
        click.echo(json.dumps(result))


@main.command()
@click.argument("inputs", nargs=-1)
@click.option("--input", "input_files", multiple=True, help="Megatron's spelling of INPUTS (repeatable): "
              "a .jsonl file, one JSON object per line, or text files and folders.")
@click.option("--output", "--output-prefix", "-o", "output", required=True,
              help="PREFIX: writes PREFIX.bin and PREFIX.json, or with --output-format megatron PREFIX.bin "
                   "and PREFIX.idx; JSONL input writes PREFIX_KEY_document.bin/.idx per --json-keys key.")
@click.option("--tokenizer", "tokenizer_file", default=None,
              help="A local Hugging Face tokenizer.json (default: byte-level, vocabulary 256).")
@click.option("--tokenizer-type", type=click.Choice(["bytes", "HuggingFaceTokenizer", "GPT2BPETokenizer"]),
              default=None, help="Megatron's name of the tokenizer (default: HuggingFaceTokenizer with "
              "--tokenizer, else bytes); GPT2BPETokenizer reads --vocab-file and --merge-file.")
@click.option("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json (or train-tokenizer's).")
@click.option("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt (or train-tokenizer's).")
@click.option("--embedded-corpus", is_flag=True, help="Tokenize the embedded corpus (the standard library's "
              ".py files, what train reads without --data-path) instead of INPUTS.")
@click.option("--output-format", type=click.Choice(["npmegatron", "megatron"]), default=None,
              help="npmegatron (the default for text: PREFIX.json index) or megatron (always for JSONL: "
                   "Megatron's PREFIX.idx, plus PREFIX.npmegatron.json with the vocabulary).")
@click.option("--json-keys", multiple=True, help="JSON fields to tokenize, each its own dataset "
              "(default: text); repeat the flag or separate keys with commas.")
@click.option("--append-eod", is_flag=True, help="Append the tokenizer's <|endoftext|> to every document.")
@click.option("--workers", type=int, default=None, help="Processes that tokenize with a subword tokenizer "
              "(default: every core this process may use, within a container's CPU quota); the output is the "
              "same for any number.")
@user_errors
def preprocess(inputs, input_files, output, tokenizer_file, tokenizer_type, vocab_file, merge_file,
               embedded_corpus, output_format, json_keys, append_eod, workers):
    """Tokenize text files or folders, or Megatron's JSONL, into a memory-mapped token file for
    --data-path. The last line is the throughput."""
    inputs = corpus_inputs(list(inputs) + list(input_files), embedded_corpus)
    with tokenizer_json(tokenizer_file, tokenizer_type, vocab_file, merge_file) as tokenizer_file:
        run_preprocessing(inputs, output, tokenizer_file, output_format, json_keys, append_eod, workers)


def corpus_inputs(inputs, embedded_corpus):
    """The input files and folders of preprocess and train-tokenizer."""
    from .data import stdlib_python_files
    if embedded_corpus and inputs:
        raise InputError("--embedded-corpus takes the standard library's files; give it or INPUTS, not both")
    if embedded_corpus:
        return stdlib_python_files()
    if not inputs:
        raise click.UsageError("Missing argument 'INPUTS...' (or --input FILE, or --embedded-corpus).")
    return inputs


@contextlib.contextmanager
def tokenizer_json(tokenizer_file, tokenizer_type, vocab_file, merge_file):
    """The tokenizer.json preprocess reads (None: bytes): --tokenizer's, or GPT-2's BPE made from
    --vocab-file and --merge-file into a temporary file (the dataset keeps its copy)."""
    from .data.bpe import gpt2_tokenizer_json
    kind = tokenizer_type or ("HuggingFaceTokenizer" if tokenizer_file else "bytes")
    if (kind == "GPT2BPETokenizer") != bool(vocab_file or merge_file) or (kind == "GPT2BPETokenizer" and tokenizer_file):
        raise InputError("--vocab-file and --merge-file go with --tokenizer-type GPT2BPETokenizer (and no "
                         "--tokenizer), which needs both")
    if (kind == "HuggingFaceTokenizer") != bool(tokenizer_file):
        raise InputError(f"--tokenizer-type {kind} and --tokenizer {tokenizer_file} do not go together: "
                         "HuggingFaceTokenizer reads --tokenizer FILE, bytes needs none")
    if kind != "GPT2BPETokenizer":
        yield tokenizer_file
        return
    text = gpt2_tokenizer_json(vocab_file, merge_file)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        yield path


def run_preprocessing(inputs, output, tokenizer_file, output_format, json_keys, append_eod, workers):
    from .data import choose_output_format, preprocess as run_preprocess, preprocess_megatron
    from .data.preprocessing import input_files
    from .data.tokenizing import check_workers, default_workers, processes_for
    keys = [key for value in json_keys for key in value.replace(",", " ").split()]
    workers = default_workers() if workers is None else workers
    check_workers(workers)
    start = time.perf_counter()
    if choose_output_format(inputs, output_format, keys) == "npmegatron":
        index = run_preprocess(inputs, output, tokenizer_file, append_eod, workers)
        click.echo(f"{output}.bin: {index['num_tokens']:,} tokens ({index['dtype']}) from "
                   f"{len(index['sources'])} documents, vocabulary {index['vocab_size']:,}")
        tokens = index["num_tokens"]
    else:
        made = preprocess_megatron(inputs, output, tokenizer_file, keys, append_eod, workers)
        for dataset in made:
            click.echo(f"{dataset['prefix']}.bin/.idx: {dataset['num_tokens']:,} tokens ({dataset['dtype']}) "
                       f"from {dataset['num_documents']} documents, vocabulary {dataset['vocab_size']:,}")
        tokens = sum(dataset["num_tokens"] for dataset in made)
    seconds = max(time.perf_counter() - start, 1e-6)
    files = input_files(inputs)
    megabytes = sum(os.path.getsize(path) for path in files) / 1e6
    processes = processes_for(files, tokenizer_file, workers)
    click.echo(f"{megabytes:,.1f} MB in {seconds:.2f} s on {processes} process{'es' if processes > 1 else ''}: "
               f"{megabytes / seconds:,.2f} MB/s, {tokens / seconds:,.0f} tokens/s")


@main.command("train-tokenizer")
@click.argument("inputs", nargs=-1)
@click.option("--vocab-size", type=POSITIVE, required=True, help="Tokens in all: the 256 bytes, <|endoftext|> "
              "and the merges learnt.")
@click.option("--output", "-o", required=True, help="Folder to write vocab.json, merges.txt and tokenizer.json.")
@click.option("--embedded-corpus", is_flag=True, help="Learn from the embedded corpus (the standard library's "
              ".py files) instead of INPUTS.")
@user_errors
def train_tokenizer(inputs, vocab_size, output, embedded_corpus):
    """Learn a byte-level BPE (GPT-2's kind) from text files or folders; preprocess then reads it
    with --tokenizer OUTPUT/tokenizer.json."""
    from .data.bpe import train_bpe
    from .data.preprocessing import input_files
    made = train_bpe(input_files(corpus_inputs(list(inputs), embedded_corpus)), vocab_size, output)
    click.echo(f"{output}: vocab.json, merges.txt and tokenizer.json, {made['vocab_size']:,} tokens learnt from "
               f"{made['bytes']:,} bytes in {made['files']:,} files")
    if made["vocab_size"] < vocab_size:
        click.echo(f"(fewer than the {vocab_size:,} asked: no other pair of tokens occurs twice in the inputs)")


@main.command()
@click.option("--load", required=True, help="Checkpoint folder (a --save folder).")
@click.option("--prompt", default=None, help="Text to continue.")
@click.option("--prompts-file", default=None, help="A UTF-8 text file of prompts, one per line (blank lines "
              "skipped), each continued in turn; instead of --prompt.")
@click.option("--max-tokens", type=int, default=200, show_default=True, help="Tokens to generate (past the "
              "model's positions it attends to the last ones).")
@click.option("--temperature", type=float, default=0.8, show_default=True, help="0: greedy.")
@click.option("--top-k", type=int, default=40, show_default=True, help="Sample among the k likeliest (0: all).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Then among the fewest likeliest "
              "whose probabilities reach p (nucleus sampling; 1: all).")
@click.option("--num-samples", type=POSITIVE, default=1, show_default=True, help="Samples of each prompt "
              "(seeds --seed, --seed + 1, ...), separated by a line of dashes.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Sampling seed.")
@click.option("--tensor-model-parallel-size", "--tp", "tp", type=POSITIVE, default=None,
              help="TP ranks (default: the launched ranks / PP).")
@click.option("--pipeline-model-parallel-size", "--pp", "pp", type=POSITIVE, default=1, show_default=True,
              help="Pipeline stages.")
@config_options(GPTConfig, only={"device"})
@user_errors
def generate(load, prompt, prompts_file, max_tokens, temperature, top_k, top_p, num_samples, seed, tp, pp,
             device):
    """Continue a prompt (or each line of a file) from a checkpoint saved at any layout, resharded
    to the one launched (mpirun -n TP x PP): a key/value cache on one stage, the stages in turn
    over several."""
    if max_tokens < 1:
        raise InputError(f"--max-tokens {max_tokens} must be a positive integer")
    prompts = generation_prompts(prompt, prompts_file)   # before the checkpoint loads
    from .generation import generate as run_generate, load_for_generation
    model, tokenizer = load_for_generation(load, device, tp, pp)
    capacity, first = model.cfg.max_position_embeddings, True
    for text in prompts:
        ids = tokenizer.encode(text)
        if model.grid.rank == 0 and len(ids) + max_tokens > capacity and first:
            click.echo(f"note: the model holds {capacity} positions; past them each new token attends to the "
                       f"last {capacity} (a full forward each)", err=True)
            first = False
        for sample in range(num_samples):
            out = run_generate(model, ids, max_tokens, temperature, top_k or None, seed + sample, top_p)
            if model.grid.rank == 0:
                click.echo(("-" * 40 + "\n" if len(prompts) * num_samples > 1 else "") + tokenizer.decode(out))


def generation_prompts(prompt, prompts_file):
    """The prompts of `generate`: --prompt, or the non-blank lines of --prompts-file."""
    from .data import utf8_bytes
    if (prompt is None) == (prompts_file is None):
        raise InputError("generate needs a prompt: give --prompt TEXT or --prompts-file FILE (one of them)")
    if prompt is not None:
        utf8_bytes(prompt, "--prompt")      # argv bytes need not be UTF-8
        return [prompt]
    try:
        with open(prompts_file, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
        raise InputError(f"cannot read --prompts-file {prompts_file} ({e.strerror}); give a readable text "
                         "file") from None
    except UnicodeDecodeError:
        raise InputError(f"--prompts-file {prompts_file} is not UTF-8 text; save it as UTF-8") from None
    if not prompts:
        raise InputError(f"--prompts-file {prompts_file} holds no prompt (every line is blank); write one "
                         "prompt per line")
    return prompts


@main.command()
@click.option("--from-hf", "from_hf", default=None, help="A local Hugging Face GPT-2, Llama, Mixtral or "
              "Qwen2-MoE folder (config.json, model.safetensors, optionally tokenizer.json) to convert into a "
              "checkpoint in --save.")
@click.option("--save", default=None, help="With --from-hf: the new checkpoint folder (loads at any layout).")
@click.option("--to-hf", "to_hf", default=None, help="A folder to write the --load checkpoint into, as "
              "GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM or Qwen2MoeForCausalLM (as the model is) "
              ".from_pretrained reads it.")
@click.option("--load", default=None, help="With --to-hf: a checkpoint saved at any layout.")
@click.option("--overwrite", is_flag=True, default=False, help="With --to-hf: replace the config.json and "
              "weights the folder already holds (by default that is refused).")
@user_errors
def convert(from_hf, save, to_hf, load, overwrite):
    """Hugging Face GPT-2, Llama, Mixtral or Qwen2-MoE weights in (--from-hf DIR --save CK) or out (--load CK
    --to-hf DIR)."""
    from .convert import export_hf, import_hf
    if bool(from_hf) == bool(to_hf) or bool(from_hf) != bool(save) or bool(to_hf) != bool(load):
        raise InputError("convert needs either --from-hf DIR --save CHECKPOINT or --load CHECKPOINT "
                         "--to-hf DIR; give one of the two pairs")
    if from_hf and overwrite:
        raise InputError("--overwrite replaces a --to-hf folder's weights, but --from-hf writes a new "
                         "checkpoint into an empty --save folder; drop --overwrite")
    if from_hf:
        click.echo(f"wrote {import_hf(from_hf, save)}")
    else:
        click.echo(f"wrote {export_hf(load, to_hf, overwrite)}")


@main.group()
def bench():
    """Benchmarks that report a ratio to the machine's own ceiling."""


def bench_model_options(defaults):
    """The model and batch flags of the benchmarks: config.py's, with each benchmark's defaults."""
    model = config_options(GPTConfig, only=BENCH_MODEL_FIELDS, defaults=defaults)
    batch = config_options(TrainConfig, only=BENCH_BATCH_FIELDS, defaults=defaults)
    return lambda command: model(batch(command))


def bench_model_config(options):
    """The benchmarks' GPTConfig: their flags, the position table as long as the sequence, no dropout."""
    check_given(options, TrainConfig)
    return GPTConfig(**{k: options.pop(k) for k in BENCH_MODEL_FIELDS},
                     max_position_embeddings=options["seq_length"], hidden_dropout=0.0, attention_dropout=0.0)


@bench.command("step")
@bench_model_options({"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 256,
                      "micro_batch_size": 8})
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed steps first.")
@click.option("--iters", type=POSITIVE, default=5, show_default=True, help="Timed steps (median reported).")
@click.option("--threads", type=POSITIVE, default=None, help="BLAS threads (default: the BLAS library's own).")
@click.option("--profile", is_flag=True, help="Also print seconds per step by kind of op, the optimizer "
              "and the autograd's own overhead, and beside matmul and attention what their GEMMs take "
              "alone in the ceiling's rounds.")
@model_preset_option
@click.option("--torch/--no-torch", "with_torch", default=True, show_default=True,
              help="With --device gpu, also time the same model in PyTorch (eager with SDPA and fused AdamW, "
              "and torch.compile) on the same GPU, where torch is installed.")
@click.option("--cuda-graph", is_flag=True, help="With --device gpu, capture the step in a CUDA graph after "
              "the warm-up steps and time its replays (as train --cuda-graph).")
@user_errors
def bench_step_command(preset, with_torch, cuda_graph, **options):
    """Time forward + backward + AdamW step against the matmul FLOP/s at the model's GEMM shapes,
    with tokens/s, model-FLOP utilisation against the GPU's peak and peak memory."""
    from . import comm
    if comm.launch_size() > 1:
        # Every rank would time its own copy and print its own table. Rank 0 alone says so, without
        # user_errors, which under mpirun starts MPI to meet ranks that have already exited.
        if comm.launch_rank() != 0:
            sys.exit(1)
        raise click.ClickException(f"bench step times one process, but mpirun started "
                                   f"{comm.launch_size()} ranks; run it without mpirun")
    from .bench.step import bench_step, format_table
    options = with_model_preset(preset, options)
    cfg = bench_model_config(options)
    click.echo(format_table(bench_step(cfg, options["micro_batch_size"], options["seq_length"],
                                       options["warmup"], options["iters"], options["threads"],
                                       options["profile"], with_torch, cuda_graph)))


@bench.command("comm")
@click.option("--ranks", type=int, default=None,
              help="Launch this many ranks with mpiexec (default: 2, or the ranks mpirun started).")
@click.option("--min-bytes", type=int, default=1024, show_default=True, help="Smallest message.")
@click.option("--max-bytes", type=int, default=64 * 2 ** 20, show_default=True, help="Largest message.")
@config_options(GPTConfig, only={"device"})
@user_errors
def bench_comm_command(ranks, min_bytes, max_bytes, device):
    """All-reduce, all-gather, reduce-scatter and send/recv bandwidth with an alpha-beta fit
    (CuPy buffers on --device gpu: NCCL when each rank has a GPU)."""
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
    from .bench.comm import bench_comm, format_report
    result = bench_comm(min_bytes, max_bytes, device)
    if comm.init().rank == 0:
        click.echo(format_report(result))


@bench.command("pipeline")
@bench_model_options({"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128,
                      "micro_batch_size": 4})
@click.option("--num-micro-batches", type=POSITIVE, default=8, show_default=True, help="M per step.")
@click.option("--ranks", type=POSITIVE, default=None, help="Launch this many pipeline ranks with mpiexec.")
@click.option("--iters", type=POSITIVE, default=5, show_default=True, help="Timed steps (median reported).")
@user_errors
def bench_pipeline_command(ranks, **options):
    """Peak tape memory per stage for each schedule (with and without output deallocation) and
    1F1B step time with and without receives posted ahead of compute."""
    from . import comm
    if ranks is not None and not comm.launched_by_mpi():
        sys.exit(relaunch_under_mpiexec(ranks))
    from .bench.pipeline import format_memory, memory_table, overlap_timing
    world, cfg = comm.init(), bench_model_config(options)
    shape = (world.size, options["num_micro_batches"], options["micro_batch_size"], options["seq_length"])
    table = memory_table(cfg, *shape)
    timing = overlap_timing(cfg, *shape, options["iters"])
    if world.rank == 0:
        click.echo(f"PP={world.size}, M={shape[1]}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                   f"micro-batch {shape[2]} x {shape[3]}, {cfg.dtype}")
        click.echo(format_memory(table))
        click.echo(f"1F1B step: {timing[False]:.4f} s without overlap, {timing[True]:.4f} s with "
                   f"receives posted ahead ({(timing[False] / timing[True] - 1) * 100:+.1f} %)")


@bench.command("scaling")
@bench_model_options({"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 256,
                      "micro_batch_size": 8, "vocab_size": 256})
@click.option("--mode", type=click.Choice(["strong", "weak"]), default="strong", show_default=True,
              help="strong: one model and batch on every layout; weak: model (TP, PP) or batch (DP) "
                   "grows with the ranks.")
@click.option("--layouts", default=None,
              help="TPxPPxDP layouts, comma-separated (default: 1x1x1,2x1x1,1x2x1,1x1x2,2x1x2).")
@click.option("--ranks", default=None, help="Rank counts, comma-separated (e.g. 1,2,4), with --parallel.")
@click.option("--parallel", type=click.Choice(["tp", "pp", "dp"]), default=None,
              help="The axis --ranks goes to.")
@click.option("--global-batch-size", type=POSITIVE, default=None,
              help="Strong: samples per step (default: micro-batch x largest DP x 2). Weak: per DP "
                   "replica (default: micro-batch x 2).")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed steps first.")
@click.option("--iters", type=POSITIVE, default=3, show_default=True, help="Timed steps per layout.")
@click.option("--threads-per-rank", type=POSITIVE, default=None,
              help="BLAS and CPU-engine threads per rank (default: the cores shared among the ranks; "
                   "1 gives the single-core serial baseline).")
@click.option("--sequence-parallel", is_flag=True,
              help="Sequence parallelism in the layouts with TP > 1 (LayerNorm, dropout and residual "
                   "adds on sequence shards; reduce-scatter + all-gather instead of all-reduce).")
@click.option("--rounds", type=POSITIVE, default=1, show_default=True,
              help="Run all the layouts this many times in turn; each row is the round of its median "
                   "efficiency, every round's efficiency listed (for a machine whose speed drifts).")
@click.option("--output", default=None, help="Folder: results.jsonl, scaling.png, breakdown.png.")
@click.option("--json", "as_json", is_flag=True, help="Print the records (JSON lines), not the table.")
@user_errors
def bench_scaling_command(mode, layouts, ranks, parallel, global_batch_size, warmup, iters, threads_per_rank,
                          sequence_parallel, rounds, output, as_json, **options):
    """Strong or weak scaling over TP x PP x DP layouts, each launched as its own mpiexec job, with
    each step split into phases (compute, TP, DP and pipeline communication, optimizer)."""
    from . import comm
    if comm.launched_by_mpi():
        if comm.launch_rank() != 0:
            sys.exit(1)
        raise click.ClickException("bench scaling launches its own mpiexec job per layout; run it "
                                   "without mpirun")
    from .bench.scaling import ChildFailed, bench_scaling, format_table, parse_grid_shapes, write_output
    cfg = bench_model_config(options)
    parsed = parse_grid_shapes(layouts, ranks, parallel)
    try:
        records = bench_scaling(cfg, parsed, mode, options["micro_batch_size"], options["seq_length"],
                                global_batch_size, warmup, iters, threads=threads_per_rank,
                                sequence_parallel=sequence_parallel, rounds=rounds)
    except ChildFailed as error:
        raise click.ClickException(str(error)) from None
    if output:
        write_output(records, mode, output)
    if as_json:
        for record in records:
            click.echo(json.dumps(record))
    else:
        click.echo(format_table(records, mode))
        if output:
            click.echo(f"wrote {output}/results.jsonl, scaling.png, breakdown.png")



# `npmegatron plan` and `npmegatron plan calibrate` (bench/plan/command.py).
from .bench.plan.command import plan_command  # noqa: E402

main.add_command(plan_command)

if __name__ == "__main__":
    sys.exit(main())
