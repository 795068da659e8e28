"""A sweep of bad input across train, preprocess, generate, bench and plan, as a user meets it: every
case must end with a non-zero exit and its one sentence printed once (under mpiexec too), never
a traceback, a hang, MPI abort noise for an error every rank shares, or a changed checkpoint."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT, mpiexec_path, rank_environment, write_indexed_dataset

TRAIN = [sys.executable, "scripts/train.py", "--num-layers", "1", "--hidden-size", "32",
         "--num-attention-heads", "2", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2",
         "--eval-iters", "1", "--lr-warmup-iters", "1", "--sample-tokens", "0"]
CLI = [sys.executable, "-m", "npmegatron.cli"]
PREPROCESS, GENERATE, BENCH, PLAN = CLI + ["preprocess"], CLI + ["generate"], CLI + ["bench"], CLI + ["plan"]
USAGE = 2           # click's exit status for a bad flag or value; bad input otherwise exits 1

# (id, ranks (0: no mpiexec), command, the sentence's telling part, exit status)
CASES = [
    ("train-layers-0", 0, TRAIN + ["--num-layers", "0"], "--num-layers is 0; it must be a positive integer", 1),
    ("train-hidden-heads", 0, TRAIN + ["--hidden-size", "30", "--num-attention-heads", "4"],
     "hidden size 30 is not divisible by 4 attention heads", 1),
    ("train-iters-negative", 0, TRAIN + ["--train-iters", "-5"], "--train-iters is -5; it must be a positive integer", 1),
    ("train-lr-nan", 0, TRAIN + ["--lr", "nan"], "--lr is nan; the learning rate must be positive", 1),
    ("train-lr-inf", 0, TRAIN + ["--lr", "inf"], "--lr is inf; the learning rate must be positive", 1),
    ("train-min-lr", 0, TRAIN + ["--min-lr", "1"], "--min-lr is 1.0; it must be between 0 and --lr (0.002)", 1),
    ("train-warmup-init", 0, TRAIN + ["--lr-warmup-init", "0.01"],
     "--lr-warmup-init 0.01 is above --lr 0.002, but the warmup rises from it to --lr; lower it", 1),
    ("train-warmup-past-decay", 0, TRAIN + ["--lr-warmup-iters", "8", "--lr-decay-iters", "4"],
     "--lr-warmup-iters 8 is not shorter than --lr-decay-iters 4, but the warmup must end before the decay", 1),
    ("train-weight-decay-nan", 0, TRAIN + ["--weight-decay", "nan"], "--weight-decay is nan; it must be a finite number", 1),
    ("train-clip-negative", 0, TRAIN + ["--clip-grad", "-1"], "--clip-grad is -1.0; it must be a finite number", 1),
    ("train-hidden-dropout", 0, TRAIN + ["--hidden-dropout", "1.5"], "--hidden-dropout is 1.5; it must be in [0, 1)", 1),
    ("train-attention-dropout", 0, TRAIN + ["--attention-dropout", "-0.1"], "--attention-dropout is -0.1; it must be in [0, 1)", 1),
    ("train-eval-iters-0", 0, TRAIN + ["--eval-iters", "0"], "--eval-iters is 0; it must be a positive integer", 1),
    ("train-log-interval-0", 0, TRAIN + ["--log-interval", "0"], "--log-interval is 0; it must be a positive integer", 1),
    ("train-save-interval-0", 0, TRAIN + ["--save-interval", "0"], "--save-interval is 0; it must be a positive integer", 1),
    ("train-bucket-0", 0, TRAIN + ["--ddp-bucket-size", "0"], "--ddp-bucket-size is 0; it must be a positive integer", 1),
    ("train-global-batch-0", 0, TRAIN + ["--global-batch-size", "0"], "--global-batch-size is 0; it must be a positive integer", 1),
    ("train-global-batch-3", 0, TRAIN + ["--global-batch-size", "3"],
     "--global-batch-size 3 is not divisible by micro-batch x DP = 2 x 1 = 2", 1),
    ("train-micro-batches-0", 0, TRAIN + ["--num-micro-batches", "0"], "--num-micro-batches is 0; it must be a positive integer", 1),
    ("train-pp-0", 0, TRAIN + ["--pp", "0"], "--pipeline-model-parallel-size is 0; it must be a positive integer", 1),
    ("train-tp-without-mpirun", 0, TRAIN + ["--tp", "2"], "--tp 2 x --pp 1 needs 2 ranks; launch with mpirun -n 2", 1),
    ("train-layout", 0, TRAIN + ["--pipeline-model-parallel-layout", "XYZ"], "layout 'XYZ' has an unknown symbol 'X'", 1),
    ("train-virtual-stages", 0, TRAIN + ["--num-layers-per-virtual-pipeline-stage", "3"],
     "--num-layers-per-virtual-pipeline-stage 3 does not split 1 layers over 1 pipeline ranks", 1),
    ("train-positions", 0, TRAIN + ["--max-position-embeddings", "16"], "--seq-length 32 is longer than the position table", 1),
    ("train-dtype", 0, TRAIN + ["--dtype", "float16"], "Invalid value for '--dtype'", USAGE),
    ("train-fp16-and-bf16", 0, TRAIN + ["--fp16", "--bf16"], "--fp16 and --bf16 were both given; choose one", 1),
    ("train-fp16-float64", 0, TRAIN + ["--fp16", "--dtype", "float64"],
     "--fp16 computes in float32 on 16-bit values, but", 1),
    ("train-loss-scale-alone", 0, TRAIN + ["--loss-scale", "128"],
     "--loss-scale sets loss scaling, which only --fp16 or --bf16 training uses; add --fp16", 1),
    ("train-min-loss-scale", 0, TRAIN + ["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"],
     "--min-loss-scale 8 is above --initial-loss-scale 4", 1),
    ("train-loss-scale-0", 0, TRAIN + ["--fp16", "--loss-scale", "0"], "--loss-scale is 0; a loss scale must be positive", 1),
    ("train-tp-not-a-number", 0, TRAIN + ["--tp", "abc"], "'abc' is not a valid integer", USAGE),
    ("train-log-file-folder", 0, TRAIN + ["--log-file", "{d}/nowhere/log.jsonl"],
     "--log-file {d}/nowhere/log.jsonl: the folder {d}/nowhere must exist", 1),
    ("train-log-file-is-folder", 0, TRAIN + ["--log-file", "{d}"], "--log-file {d}: the folder", 1),
    ("train-adam-beta1-one", 0, TRAIN + ["--adam-beta1", "1.0"],
     "--adam-beta1 is 1.0; AdamW's betas must lie in [0, 1) (its bias correction divides by 1 - beta^t)", 1),
    ("train-adam-beta2-above-one", 0, TRAIN + ["--adam-beta2", "1.5"], "--adam-beta2 is 1.5; AdamW's betas must lie", 1),
    ("train-tensorboard-dir-a-file", 0, TRAIN + ["--tensorboard-dir", "{d}/deep.jsonl"],
     "--tensorboard-dir {d}/deep.jsonl is a file, not a folder; choose a folder", 1),
    ("train-load-a-file", 0, TRAIN + ["--load", "{d}/deep.jsonl"],
     "--load {d}/deep.jsonl is a file, not a checkpoint folder; give the folder --save wrote", 1),
    ("train-mpi-load-a-file", 2, TRAIN + ["--tp", "2", "--load", "{d}/deep.jsonl"],
     "--load {d}/deep.jsonl is a file, not a checkpoint folder", 1),
    ("train-seed-negative", 0, TRAIN + ["--seed", "-1"], "--seed is -1; it must be a finite number, not negative", 1),
    ("train-sample-tokens", 0, TRAIN + ["--sample-tokens", "-1"], "--sample-tokens is -1; it must be a finite number", 1),
    ("train-gpu-without-cupy", 0, TRAIN + ["--device", "gpu"], "device 'gpu' needs CuPy, which is not installed", 1),
    ("train-no-data", 0, TRAIN + ["--data-path", "{d}/missing"], "--data-path {d}/missing: {d}/missing.bin and "
                                                                "{d}/missing.json not found", 1),
    ("train-index-key", 0, TRAIN + ["--data-path", "{d}/nokey"], "{d}/nokey.json has no 'num_tokens' entry", 1),
    ("train-idx-pointers", 0, TRAIN + ["--data-path", "{d}/liar_idx"],
     "{d}/liar_idx.idx: the sequence pointers are not the sequences back to back from byte 0", 1),
    ("train-idx-token-outside-vocabulary", 0, TRAIN + ["--data-path", "{d}/big_ids"],
     "{d}/big_ids.bin holds token ids 1..300, outside the vocabulary of {d}/big_ids.npmegatron.json (256)", 1),
    ("train-mpi-idx-token-outside-vocabulary", 2, TRAIN + ["--tp", "2", "--data-path", "{d}/big_ids"],
     "{d}/big_ids.bin holds token ids 1..300, outside the vocabulary of {d}/big_ids.npmegatron.json (256)", 1),
    ("train-index-json-offsets-bool", 0, TRAIN + ["--data-path", "{d}/bool_offsets"],
     "{d}/bool_offsets.json: document_offsets must be integers", 1),
    ("train-blend-weights-too-far-apart", 0, TRAIN + ["--data-path", "1e308 {d}/good_idx 1e-308 {d}/good_idx"],
     "--data-path blend weight '1e-308' is too small beside '1e308' to be drawn", 1),
    ("train-split-no-training", 0, TRAIN + ["--data-path", "{d}/good_idx", "--split", "0,50,50"],
     "--split '0,50,50' leaves nothing to train on", 1),
    ("preprocess-jsonl-deeply-nested", 0, PREPROCESS + ["{d}/deep.jsonl", "--output", "{d}/out"],
     "{d}/deep.jsonl line 1 is not JSON (", 1),
    ("train-finetune-missing", 0, TRAIN + ["--load", "{d}/nothing", "--finetune"],
     "--finetune starts from the weights in --load {d}/nothing, but it holds no checkpoint", 1),
    ("train-load-corrupt", 0, TRAIN + ["--load", "{d}/corrupt"], "mp_rank_00_000.safetensors fails its SHA-256 check", 1),
    ("train-load-latest-outside", 0, TRAIN + ["--load", "{d}/outside"],
     "{d}/outside/latest names '../ck/iter_0000002', not a checkpoint of this folder", 1),
    ("train-load-manifest", 0, TRAIN + ["--load", "{d}/badmanifest"], "manifest.json is not valid JSON", 1),
    ("train-load-shard-outside", 0, TRAIN + ["--load", "{d}/traversal"],
     "'shards' names '../../x.safetensors', which is not a shard file name the saver writes", 1),
    ("train-load-manifest-type", 0, TRAIN + ["--load", "{d}/liar"], "model --hidden-size is '32', but it must be of type int", 1),
    ("train-mpi-load-shard-outside", 2, TRAIN + ["--tp", "2", "--load", "{d}/traversal"],
     "'shards' names '../../x.safetensors', which is not a shard file name the saver writes", 1),
    ("generate-load-shard-outside", 0, GENERATE + ["--load", "{d}/traversal", "--prompt", "x"],
     "'shards' names '../../x.safetensors', which is not a shard file name the saver writes", 1),
    ("train-load-other-model", 0, TRAIN + ["--load", "{d}/ck", "--hidden-size", "64"],
     "holds a model with --hidden-size 32, but this run has --hidden-size 64", 1),
    ("train-save-below-file", 0, TRAIN + ["--save", "{d}/file/ck"], "--save {d}/file/ck is not a writable folder", 1),
    ("train-save-other-run", 0, TRAIN + ["--save", "{d}/ck"], "--save {d}/ck holds checkpoints of another run", 1),
    ("train-mpi-unknown-flag", 2, TRAIN + ["--tp", "2", "--bogus"], "No such option", USAGE),
    ("train-mpi-heads", 2, TRAIN + ["--tp", "2", "--num-attention-heads", "3", "--hidden-size", "24"],
     "3 attention heads are not divisible by tensor-parallel size 2", 1),
    ("train-mpi-world", 3, TRAIN + ["--tp", "2"], "world size 3 is not divisible by TP x PP = 2", 1),
    ("train-mpi-load-other-model", 2, TRAIN + ["--tp", "2", "--load", "{d}/ck", "--hidden-size", "64"],
     "holds a model with --hidden-size 32, but this run has --hidden-size 64", 1),
    ("train-mpi-save-other-run", 2, TRAIN + ["--tp", "2", "--save", "{d}/ck"], "--save {d}/ck holds checkpoints of another run", 1),
    ("train-model-too-large", 0, TRAIN + ["--hidden-size", "262144"],
     "is available to each (the node's available host memory); use fewer --num-layers", 1),
    ("train-mpi-model-too-large", 2, TRAIN + ["--tp", "2", "--hidden-size", "262144"],
     "of the node's available host memory shared by 2 ranks); use fewer --num-layers", 1),
    ("preprocess-missing", 0, PREPROCESS + ["{d}/missing.txt", "--output", "{d}/out"], "input {d}/missing.txt does not exist", 1),
    ("preprocess-empty", 0, PREPROCESS + ["{d}/empty.txt", "--output", "{d}/out"], "no text found in {d}/empty.txt", 1),
    ("preprocess-folder-is-a-file", 0, PREPROCESS + ["{d}/a.txt", "--output", "{d}/a.txt/out"],
     "output folder {d}/a.txt cannot be created", 1),
    ("preprocess-output-folder", 0, PREPROCESS + ["{d}/a.txt", "--output", "{d}/"], "--output {d}/ is a folder", 1),
    ("preprocess-unwritable", 0, PREPROCESS + ["{d}/a.txt", "--output", "/proc/npmegatron-out"],
     "/proc/npmegatron-out.bin.partial: No such file or directory", 1),
    ("preprocess-tokenizer-missing", 0, PREPROCESS + ["{d}/a.txt", "--output", "{d}/out", "--tokenizer", "{d}/none.json"],
     "tokenizer file {d}/none.json does not exist", 1),
    ("preprocess-tokenizer-bad", 0, PREPROCESS + ["{d}/a.txt", "--output", "{d}/out", "--tokenizer", "{d}/bad_tokenizer.json"],
     "tokenizer file {d}/bad_tokenizer.json could not be read", 1),
    ("preprocess-no-output", 0, PREPROCESS + ["{d}/a.txt"], "Missing option '--output'", USAGE),
    ("preprocess-workers-0", 0, PREPROCESS + ["{d}/a.txt", "--output", "{d}/out", "--workers", "0"],
     "--workers is 0; it must be a positive integer", 1),
    ("convert-hf-config-missing", 0, CLI + ["convert", "--from-hf", "{d}/hf_noconfig", "--save", "{d}/hf_ck"],
     "{d}/hf_noconfig/config.json does not exist", 1),
    ("convert-hf-config-disagrees", 0, CLI + ["convert", "--from-hf", "{d}/hf_layers", "--save", "{d}/hf_ck"],
     "config.json has n_layer 3, but the weights' layers are h.0 (1 in all)", 1),
    ("convert-hf-header-length", 0, CLI + ["convert", "--from-hf", "{d}/hf_header", "--save", "{d}/hf_ck"],
     "{d}/hf_header/model.safetensors cannot be read as safetensors: its header length is 1000000000 bytes", 1),
    ("convert-hf-index-outside", 0, CLI + ["convert", "--from-hf", "{d}/hf_index", "--save", "{d}/hf_ck"],
     "puts tensor 'transformer.wte.weight' in '../x.safetensors', which is not the name of a .safetensors file", 1),
    ("convert-to-hf-holds-weights", 0, CLI + ["convert", "--load", "{d}/ck", "--to-hf", "{d}/hf_good"],
     "--to-hf {d}/hf_good already holds config.json, model.safetensors; give a new folder, or add --overwrite", 1),
    ("generate-missing", 0, GENERATE + ["--load", "{d}/nothing", "--prompt", "x"], "--load {d}/nothing: no such checkpoint folder", 1),
    ("generate-temperature-nan", 0, GENERATE + ["--load", "{d}/ck", "--prompt", "x", "--temperature", "nan"],
     "temperature nan must be a finite number >= 0", 1),
    ("generate-temperature-negative", 0, GENERATE + ["--load", "{d}/ck", "--prompt", "x", "--temperature", "-1"],
     "temperature -1.0 must be a finite number >= 0", 1),
    ("generate-top-k", 0, GENERATE + ["--load", "{d}/ck", "--prompt", "x", "--top-k", "-1"], "top-k -1 must be a positive integer", 1),
    ("generate-max-tokens", 0, GENERATE + ["--load", "{d}/ck", "--prompt", "x", "--max-tokens", "0"],
     "--max-tokens 0 must be a positive integer", 1),
    ("generate-empty-prompt", 0, GENERATE + ["--load", "{d}/ck", "--prompt", ""], "the prompt is empty", 1),
    ("generate-seed", 0, GENERATE + ["--load", "{d}/ck", "--prompt", "x", "--seed", "-1"], "Invalid value for '--seed'", USAGE),
    ("generate-not-utf8", 0, GENERATE + ["--load", "{d}/ck", "--prompt", b"\xff\xfe"], "--prompt is not UTF-8 text", 1),
    ("generate-gpu", 0, GENERATE + ["--load", "{d}/ck", "--prompt", "x", "--device", "gpu"], "device 'gpu' needs CuPy", 1),
    ("generate-ranks", 0, GENERATE + ["--load", "{d}/ck_tp2", "--prompt", "x", "--tp", "2"],
     "generation with TP 2 x PP 1 needs 2 ranks but 1 were launched; run it under mpirun -n 2", 1),
    ("generate-mpi-temperature", 2, GENERATE + ["--load", "{d}/ck_tp2", "--prompt", "x", "--temperature", "inf"],
     "temperature inf must be a finite number >= 0", 1),
    ("bench-step-layers", 0, BENCH + ["step", "--num-layers", "0"], "--num-layers is 0; it must be a positive integer", 1),
    ("bench-step-hidden-heads", 0, BENCH + ["step", "--hidden-size", "30", "--num-attention-heads", "4"],
     "hidden size 30 is not divisible by 4 attention heads", 1),
    ("bench-step-iters", 0, BENCH + ["step", "--iters", "0"], "Invalid value for '--iters'", USAGE),
    ("bench-step-warmup", 0, BENCH + ["step", "--warmup", "-1"], "Invalid value for '--warmup'", USAGE),
    ("bench-step-mpi", 2, BENCH + ["step", "--num-layers", "1", "--hidden-size", "32"],
     "bench step times one process, but mpirun started 2 ranks", 1),
    ("bench-comm-ranks", 0, BENCH + ["comm", "--ranks", "1"], "--ranks 1 must be at least 2", 1),
    ("bench-comm-bytes", 0, BENCH + ["comm", "--min-bytes", "0"], "--min-bytes 0 and --max-bytes 67108864 must satisfy", 1),
    ("bench-comm-order", 0, BENCH + ["comm", "--min-bytes", "100", "--max-bytes", "10"],
     "--min-bytes 100 and --max-bytes 10 must satisfy 1 <= min <= max", 1),
    ("bench-comm-mpi-flag", 2, BENCH + ["comm", "--bogus"], "No such option", USAGE),
    ("bench-pipeline-micro-batches", 0, BENCH + ["pipeline", "--num-micro-batches", "0"],
     "Invalid value for '--num-micro-batches'", USAGE),
    ("bench-scaling-micro-batch-0", 0, BENCH + ["scaling", "--micro-batch-size", "0"],
     "--micro-batch-size is 0; it must be a positive integer", 1),
    ("plan-cp-0", 0, PLAN + ["--cp", "0"], "--context-parallel-size is 0; it must be a positive integer", 1),
    ("plan-search-micro-batch-0", 0, PLAN + ["--search", "4", "--micro-batch-size", "0"],
     "--micro-batch-size is 0; it must be a positive integer", 1),
    ("plan-cuda-graph-published-profile", 0, PLAN + ["--device", "gpu", "--cuda-graph"],
     "--cuda-graph prices a GPU step replayed as one graph, but profile 'dgx2h' has no GPU's measured rates", 1),
    ("plan-train-iters-0", 0, PLAN + ["--train-iters", "0"], "--train-iters is 0; it must be a positive integer", 1),
    ("plan-train-tokens-inf", 0, PLAN + ["--train-tokens", "inf"],
     "--train-tokens inf is not a positive number of tokens; give e.g. 300e9", 1),
    ("plan-run-length-twice", 0, PLAN + ["--train-iters", "5", "--train-tokens", "1e9"],
     "--train-iters and --train-tokens both give the run's length; give one of the two", 1),
]


def run(ranks, command, timeout=120):
    launcher = [mpiexec_path(), "-n", str(ranks)] if ranks else []
    return subprocess.run(launcher + command, capture_output=True, timeout=timeout, cwd=ROOT,
                          env=rank_environment())


def folder_digest(folder):
    digest = hashlib.sha256()
    for base, _, files in sorted(os.walk(folder)):
        for name in sorted(set(files) - {".npmegatron.lock"}):     # who holds it: not checkpoint data
            digest.update(name.encode())
            with open(os.path.join(base, name), "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def edit_manifest(root, change):
    path = root / "iter_0000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """Checkpoints (good, TP=2, corrupt, `latest` pointing out, broken manifest) and data files."""
    d = tmp_path_factory.mktemp("sweep")
    for ranks, extra, name in ((0, [], "ck"), (2, ["--tp", "2"], "ck_tp2")):
        made = run(ranks, TRAIN + extra + ["--dtype", "float64", "--save", str(d / name)])
        assert made.returncode == 0, made.stderr.decode()
    for name in ("corrupt", "outside", "badmanifest", "traversal", "liar"):
        shutil.copytree(d / "ck", d / name)
    shard = d / "corrupt" / "iter_0000002" / "mp_rank_00_000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3] + b"\x00\x00\x00")
    (d / "outside" / "latest").write_text("../ck/iter_0000002")
    (d / "badmanifest" / "iter_0000002" / "manifest.json").write_text("{not json")
    shutil.copy(d / "ck" / "iter_0000002" / "mp_rank_00_000.safetensors", d / "x.safetensors")
    edit_manifest(d / "traversal", lambda m: m.update(shards={"../../x.safetensors": m["shards"]["mp_rank_00_000.safetensors"]}))
    edit_manifest(d / "liar", lambda m: m["model"].update(hidden_size="32"))
    (d / "a.txt").write_text("some text to tokenize\n")
    (d / "empty.txt").write_bytes(b"")
    (d / "file").write_text("a file, not a folder")
    (d / "bad_tokenizer.json").write_text("{not json")
    (d / "nokey.bin").write_bytes(bytes(range(64)))
    (d / "nokey.json").write_text(json.dumps({"format": "npmegatron-tokens-1", "dtype": "uint8", "vocab_size": 256,
                                              "tokenizer": {"type": "bytes"}, "document_offsets": [0, 64]}))
    sidecar = {"format": "npmegatron-megatron-sidecar-1", "vocab_size": 256, "tokenizer": {"type": "bytes"}}
    for name, last in (("good_idx", 3), ("liar_idx", 3), ("big_ids", 300)):      # Megatron data, 2 sequences
        write_indexed_dataset(str(d / name), [list(range(1, 99)), [2, last]], "uint16")
        (d / f"{name}.npmegatron.json").write_text(json.dumps(sidecar))
    idx = (d / "liar_idx.idx").read_bytes()          # the second pointer (bytes 50-57) says 5, not 196
    (d / "liar_idx.idx").write_bytes(idx[:50] + (5).to_bytes(8, "little") + idx[58:])
    shutil.copy(d / "nokey.bin", d / "bool_offsets.bin")
    (d / "bool_offsets.json").write_text(json.dumps({"format": "npmegatron-tokens-1", "dtype": "uint8", "num_tokens": 64,
                                                     "vocab_size": 256, "tokenizer": {"type": "bytes"},
                                                     "document_offsets": [0, True, 64]}))
    (d / "deep.jsonl").write_text("[" * 100000 + "\n")
    made = run(0, CLI + ["convert", "--load", str(d / "ck"), "--to-hf", str(d / "hf_good")])
    assert made.returncode == 0, made.stderr.decode()
    for name in ("hf_noconfig", "hf_layers", "hf_header", "hf_index"):
        shutil.copytree(d / "hf_good", d / name)
    (d / "hf_noconfig" / "config.json").unlink()
    hf_config = json.loads((d / "hf_good" / "config.json").read_text())
    (d / "hf_layers" / "config.json").write_text(json.dumps({**hf_config, "n_layer": 3}))
    weights = d / "hf_header" / "model.safetensors"          # its header length now runs past the file
    weights.write_bytes((10 ** 9).to_bytes(8, "little") + weights.read_bytes()[8:])
    (d / "hf_index" / "model.safetensors").unlink()          # the index names a file outside the folder
    (d / "hf_index" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"transformer.wte.weight": "../x.safetensors"}}))
    return d


@pytest.mark.slow
@pytest.mark.parametrize("ranks,command,message,status", [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_bad_input_is_one_sentence_printed_once(d, ranks, command, message, status):
    assert len(CASES) >= 40
    checkpoints = {name: folder_digest(d / name) for name in ("ck", "ck_tp2")}
    command = [part.format(d=d) if isinstance(part, str) else part for part in command]
    result = run(ranks, command)
    output = (result.stdout + result.stderr).decode(errors="replace")
    message = message.format(d=d)
    assert result.returncode == status, output
    assert output.count(message) == 1, output
    assert "Traceback" not in output and "Abort" not in output, output
    assert {name: folder_digest(d / name) for name in checkpoints} == checkpoints, "a checkpoint changed"


@pytest.mark.slow
def test_a_run_all_in_warm_up_is_accepted_with_one_warning(d):
    result = run(2, TRAIN + ["--tp", "2", "--lr-warmup-iters", "5"])
    output = (result.stdout + result.stderr).decode()
    assert result.returncode == 0, output
    assert output.count("warning: --train-iters 2 is not more than the 5 warm-up steps, so the whole run is "
                        "warm-up and never trains at --lr 0.002") == 1, output
