"""scripts/train.py under mpiexec: tensor-parallel training that equals the serial run, output
from rank 0 only, and bad input reported once with a non-zero exit."""
import json
import shutil

import pytest

from helpers import launch

SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "4", "--train-iters", "6", "--log-interval", "3", "--eval-interval", "6",
         "--eval-iters", "1", "--lr-warmup-iters", "2", "--dtype", "float64"]


def losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


@pytest.mark.slow
def test_tensor_parallel_training_follows_the_serial_trajectory(tmp_path):
    serial = launch(0, SMALL + ["--log-file", str(tmp_path / "tp1.jsonl")])
    assert serial.returncode == 0, serial.stderr
    for extra in ([], ["--sequence-parallel"]):
        run = launch(2, SMALL + ["--tp", "2", "--log-file", str(tmp_path / "tp2.jsonl")] + extra)
        assert run.returncode == 0, run.stderr
        assert run.stdout.count("done: loss") == 1          # rank 0 alone prints
        assert "TP(2)-PP(1)-DP(1)-Rank(0)" in run.stdout
        ref, got = losses(tmp_path / "tp1.jsonl"), losses(tmp_path / "tp2.jsonl")
        assert len(got) == len(ref) == 2
        assert got == pytest.approx(ref, rel=1e-9)


@pytest.mark.quick_variants("hidden")
@pytest.mark.parametrize("n,args,message", [
    (2, ["--tp", "2", "--num-attention-heads", "3", "--hidden-size", "24"],
     "3 attention heads are not divisible by tensor-parallel size 2"),
    (3, ["--tp", "2"], "world size 3 is not divisible by TP x PP = 2"),
    (2, ["--tp", "2", "--hidden-size", "30", "--num-attention-heads", "4"],
     "hidden size 30 is not divisible by 4 attention heads"),
    (2, ["--tp", "2", "--sequence-parallel", "--seq-length", "33", "--max-position-embeddings", "64"],
     "sequence length 33 is not divisible by the tensor-parallel size 2"),
], ids=["heads", "world", "hidden", "sequence"])
def test_bad_input_under_mpirun_is_one_sentence_from_one_rank(n, args, message):
    result = launch(n, args + ["--train-iters", "2"], timeout=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.count(message) == 1, result.stderr
    assert f"Error: {message}" in result.stderr
    # every rank hit it, so the job ends normally: exit 1 and no MPI_Abort noise
    assert result.returncode == 1 and "Abort" not in result.stdout + result.stderr, result.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An empty data file for the bad-input cases; the checkpoints some of them load are made on
    first use (with_checkpoints), so the quick run's cases do not wait for a training run."""
    folder = tmp_path_factory.mktemp("bad-input")
    (folder / "empty.bin").write_bytes(b"")
    (folder / "empty.json").write_text(json.dumps({"format": "npmegatron-tokens-1", "dtype": "uint16",
                                                   "num_tokens": 0, "vocab_size": 256,
                                                   "tokenizer": {"type": "bytes"},
                                                   "document_offsets": [0], "sources": []}))
    return folder


def with_checkpoints(folder):
    """A tiny TP=2 checkpoint in folder/ck, and a copy in folder/corrupt with one shard's byte
    flipped; made once."""
    if (folder / "corrupt").exists():
        return
    run = launch(2, SMALL + ["--tp", "2", "--train-iters", "2", "--sample-tokens", "0",
                             "--save", str(folder / "ck")])
    assert run.returncode == 0, run.stderr
    shutil.copytree(folder / "ck", folder / "corrupt")
    shard = folder / "corrupt" / "iter_0000002" / "mp_rank_01_000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x55
    shard.write_bytes(bytes(data))


@pytest.mark.quick_variants("lr", "empty-data")
@pytest.mark.parametrize("args,message", [
    (["--data-path", "{d}/missing"], "--data-path {d}/missing: {d}/missing.bin and {d}/missing.json not found"),
    (["--data-path", "{d}/empty"], "--data-path {d}/empty: {d}/empty.bin is empty"),
    (["--global-batch-size", "6"], "--global-batch-size 6 is not divisible by micro-batch x DP = 4 x 1 = 4"),
    (["--load", "{d}/nothing", "--finetune"], "--finetune starts from the weights in --load {d}/nothing, but it "
                                              "holds no checkpoint"),
    (["--load", "{d}/corrupt"], "checkpoint shard {d}/corrupt/iter_0000002/mp_rank_01_000.safetensors "
                                "fails its SHA-256 check"),
    (["--load", "{d}/ck", "--hidden-size", "64"], "holds a model with --hidden-size 32, but this run "
                                                  "has --hidden-size 64"),
    (["--lr", "0"], "--lr is 0.0; the learning rate must be positive"),
    (["--lr", "1e30", "--dtype", "float32", "--clip-grad", "0", "--lr-warmup-iters", "0",
      "--save", "{d}/nan", "--save-interval", "1"],
     "the loss became nan at iteration 2, so training stopped before applying it; the last "
     "checkpoint (iteration 1 in {d}/nan) is untouched"),
], ids=["no-data", "empty-data", "global-batch", "no-checkpoint", "corrupt-checkpoint",
        "other-model", "lr", "nan"])
def test_bad_training_input_is_reported_once(saved, args, message):
    if any(a.startswith(("{d}/ck", "{d}/corrupt")) for a in args):
        with_checkpoints(saved)
    args = [a.format(d=saved) for a in args]
    result = launch(2, SMALL + ["--tp", "2", "--train-iters", "4"] + args, timeout=90)
    message = message.format(d=saved)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count(message) == 1, result.stderr
    assert result.returncode == 1 and "Abort" not in result.stdout + result.stderr, result.stderr
    if "--save" in args:
        assert (saved / "nan" / "latest").read_text() == "iter_0000001"


@pytest.mark.slow
def test_with_dropout_tensor_parallel_tracks_serial(tmp_path):
    """Attention-dropout masks differ per TP rank, so the runs are not equal, but they must be
    the same model statistically: the loss curves stay close."""
    args = SMALL[:-2] + ["--train-iters", "40", "--log-interval", "10", "--eval-interval", "40",
                         "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--lr", "3e-3"]
    serial = launch(0, args + ["--log-file", str(tmp_path / "tp1.jsonl")])
    parallel = launch(2, args + ["--tp", "2", "--log-file", str(tmp_path / "tp2.jsonl")])
    assert serial.returncode == 0 and parallel.returncode == 0, serial.stderr + parallel.stderr
    ref, got = losses(tmp_path / "tp1.jsonl"), losses(tmp_path / "tp2.jsonl")
    assert ref[-1] < ref[0] - 1.0
    assert max(abs(a - b) for a, b in zip(ref, got)) < 0.1, (ref, got)
    assert ref != got      # different attention-dropout streams really were used
