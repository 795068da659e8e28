"""Byte-level BPE: `npmegatron train-tokenizer` learns one and writes vocab.json, merges.txt and
tokenizer.json; `preprocess --tokenizer-type GPT2BPETokenizer --vocab-file --merge-file` reads
GPT-2's pair of files into the same tokenizer; a run trains and evaluates on the tokens, its loss
per byte counted over the bytes the tokens stand for; --workers processes tokenize, the files the
same for any number."""
import json
import os
import re
import subprocess
import sys

import numpy
import pytest
from click.testing import CliRunner

tokenizers = pytest.importorskip("tokenizers")

from npmegatron.autograd import InputError  # noqa: E402
from npmegatron.cli import main  # noqa: E402
from npmegatron.data import HFTokenizer, open_dataset, preprocess, preprocess_megatron  # noqa: E402
from npmegatron.data import tokenizing  # noqa: E402
from npmegatron.data.bpe import gpt2_tokenizer_json, train_bpe  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "npmegatron.cli"]
DOCS = os.path.join(ROOT, "docs")         # this project's documentation: real text, in the checkout
TEXT = "def add(a, b):\n    return a + b  # sum, café\n<|endoftext|>\nclass Point:\n    x: int = 0\n"
PLAIN = TEXT.replace("<|endoftext|>", "")      # decoding leaves special tokens out, as GPT-2's does


def run(args):
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def learnt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    result = run(["train-tokenizer", DOCS, "--vocab-size", "300", "--output", str(folder / "tok")])
    assert result.returncode == 0, result.stderr
    assert "vocab.json, merges.txt and tokenizer.json, 300 tokens learnt from" in result.stdout
    return folder


def test_train_tokenizer_writes_gpt2s_files_and_a_tokenizer_json(learnt):
    vocab = json.loads((learnt / "tok" / "vocab.json").read_text())
    assert len(vocab) == 300 and vocab["<|endoftext|>"] == 0
    assert (learnt / "tok" / "merges.txt").read_text().startswith("#version")
    tokenizer = HFTokenizer(str(learnt / "tok" / "tokenizer.json"))
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == PLAIN and tokenizer.byte_count(ids) == len(PLAIN.encode())
    assert len(ids) < len(TEXT.encode()) and tokenizer.eod_id == 0 and ids.count(0) == 1


def test_gpt2_bpe_from_vocab_and_merges_is_the_learnt_tokenizer(learnt, tmp_path):
    (tmp_path / "gpt2.json").write_text(gpt2_tokenizer_json(str(learnt / "tok" / "vocab.json"),
                                                             str(learnt / "tok" / "merges.txt")))
    mine, theirs = HFTokenizer(str(tmp_path / "gpt2.json")), HFTokenizer(str(learnt / "tok" / "tokenizer.json"))
    assert mine.encode(TEXT) == theirs.encode(TEXT) and mine.decode(mine.encode(TEXT)) == PLAIN
    assert mine.eod_id == theirs.eod_id == 0


def test_preprocess_train_and_evaluate_on_subword_tokens(learnt, tmp_path):
    tok = learnt / "tok"
    made = run(["preprocess", DOCS, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                str(tok / "vocab.json"), "--merge-file", str(tok / "merges.txt"), "--output", str(tmp_path / "d")])
    assert made.returncode == 0, made.stderr
    assert f"(uint16) from {len(os.listdir(DOCS))} documents, vocabulary 300" in made.stdout
    index = json.loads((tmp_path / "d.json").read_text())
    tokens = numpy.fromfile(tmp_path / "d.bin", numpy.uint16)
    assert index["num_tokens"] == tokens.size < sum(os.path.getsize(os.path.join(DOCS, p)) for p in os.listdir(DOCS))
    trained = subprocess.run([sys.executable, "scripts/train.py", "--data-path", str(tmp_path / "d"), "--split",
                              "4,2,0", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                              "--seq-length", "32", "--micro-batch-size", "4", "--train-iters", "30", "--lr", "1e-2",
                              "--log-interval", "30", "--eval-interval", "30", "--eval-iters", "1",
                              "--sample-tokens", "0", "--save", str(tmp_path / "ck")],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert trained.returncode == 0, trained.stderr
    scored = run(["evaluate", "--load", str(tmp_path / "ck"), "--eval-iters", "2"])
    assert scored.returncode == 0, scored.stderr
    result = json.loads(scored.stdout.strip().splitlines()[-1])
    validation = result["validation"]
    # nats per token over the bytes per token: fewer nats per byte than per token
    assert 0 < validation["loss_per_byte"] < validation["loss"]
    sample = run(["generate", "--load", str(tmp_path / "ck"), "--prompt", "The model", "--max-tokens", "12"])
    assert sample.returncode == 0 and sample.stdout.startswith("The model"), sample.stderr
    assert len(sample.stdout.rstrip("\n")) > len("The model")


@pytest.mark.quick_variants("vocab-alone")
@pytest.mark.parametrize("args,message", [
    (["--vocab-file", "v.json"], "--vocab-file and --merge-file go with --tokenizer-type GPT2BPETokenizer"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file and --merge-file go with --tokenizer-type"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nonexistent/v.json", "--merge-file", "m.txt"],
     "--vocab-file /nonexistent/v.json is not a file"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-type HuggingFaceTokenizer and --tokenizer None"),
], ids=["vocab-alone", "type-alone", "missing-vocab", "hf-without-file"])
def test_bad_tokenizer_flags_are_one_sentence(tmp_path, args, message):
    (tmp_path / "a.txt").write_text("hello")
    result = run(["preprocess", str(tmp_path / "a.txt"), "--output", str(tmp_path / "x")] + args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1 and message in lines[0], result.stderr


def test_bad_train_tokenizer_input_is_one_sentence(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(InputError, match="--vocab-size 200 leaves no room for merges"):
        train_bpe([str(tmp_path / "a.txt")], 200, str(tmp_path / "tok"))
    result = run(["train-tokenizer", "--vocab-size", "1000", "--output", str(tmp_path / "tok")])
    assert result.returncode != 0 and "Missing argument 'INPUTS...'" in result.stderr
    result = run(["train-tokenizer", str(tmp_path / "missing"), "--vocab-size", "1000", "--output", str(tmp_path)])
    assert result.returncode != 0 and f"input {tmp_path / 'missing'} does not exist" in result.stderr


def test_the_embedded_corpus_is_an_input(tmp_path):
    result = run(["preprocess", "--embedded-corpus", "--output", str(tmp_path / "stdlib")])
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "stdlib.json").read_text())["vocab_size"] == 256
    both = run(["preprocess", "--embedded-corpus", str(tmp_path / "x"), "--output", str(tmp_path / "y")])
    assert both.returncode != 0 and "--embedded-corpus takes the standard library's files" in both.stderr



def written(folder, prefix):
    """{file name less the prefix: its bytes} of every file `prefix` names in `folder`."""
    return {name[len(prefix):]: (folder / name).read_bytes() for name in os.listdir(folder) if name.startswith(prefix)}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 2 KB, so that small inputs take the workers' path, and at most three of them in
    flight (fewer than two workers' two each: the bytes' bound binds, and the order still holds)."""
    monkeypatch.setattr(tokenizing, "CHUNK_BYTES", 2048)
    monkeypatch.setattr(tokenizing, "BYTES_IN_FLIGHT", 3 * 2048)


def test_two_workers_write_megatrons_files_as_one_then_the_throughput(learnt, tmp_path, small_chunks):
    """JSONL cut into many chunks, tokenized on two processes and taken back in order: both keys'
    .bin, .idx, sidecar and tokenizer are byte for byte one worker's (skipped empty records and
    --append-eod included), and the command's last line is its throughput."""
    docs = sorted((os.path.join(DOCS, name) for name in os.listdir(DOCS)), key=os.path.getsize)[:2]
    records = [{"text": part, "title": f"{os.path.basename(path)} {n}"} for path in docs
               for n, part in enumerate(open(path, encoding="utf-8").read().split("\n\n")) if part.strip()]
    records[3]["text"] = ""                                # an empty document is skipped
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records[:40]) + "\n\n" +      # and a blank line
                     "".join(json.dumps(r) + "\n" for r in records[40:]))
    for workers in ("1", "2"):
        result = CliRunner().invoke(main, ["preprocess", "--input", str(jsonl), "-o", str(tmp_path / f"m{workers}"),
                                           "--tokenizer", str(learnt / "tok" / "tokenizer.json"), "--json-keys",
                                           "text,title", "--append-eod", "--workers", workers])
        assert result.exit_code == 0, result.output
        assert f"from {len(records) - 1} documents" in result.output and f"from {len(records)} documents" in result.output
        processes = "1 process" if workers == "1" else "2 processes"
        last = result.output.splitlines()[-1]
        assert re.fullmatch(rf"[\d,.]+ MB in [\d.]+ s on {processes}: [\d,.]+ MB/s, [\d,]+ tokens/s", last), last
    one = written(tmp_path, "m1")
    assert one == written(tmp_path, "m2") and len(one) == 8, sorted(one)
    data = open_dataset(str(tmp_path / "m2_text_document"))
    first = data.tokens[data.document_offsets[0]:data.document_offsets[1] - 1]      # less <|endoftext|>
    assert data.tokenizer().decode(first) == records[0]["text"]


def test_two_workers_write_npmegatrons_files_as_one(learnt, tmp_path, small_chunks, monkeypatch):
    """Spawned workers (macOS's) too, and forked ones (Linux's) under a script read from stdin,
    whose __main__ has no file to run again."""
    docs = sorted((os.path.join(DOCS, name) for name in os.listdir(DOCS)), key=os.path.getsize)[:3]
    tokenizer = str(learnt / "tok" / "tokenizer.json")
    assert preprocess(docs, str(tmp_path / "one"), tokenizer)["sources"] == docs
    monkeypatch.setattr(tokenizing, "START_METHOD", "spawn")
    preprocess(docs, str(tmp_path / "spawned"), tokenizer, workers=2)
    script = ("from npmegatron.data import preprocess, tokenizing\ntokenizing.CHUNK_BYTES = 2048\n"
              f"preprocess({docs!r}, {str(tmp_path / 'stdin')!r}, {tokenizer!r}, workers=2)\n")
    made = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert made.returncode == 0, made.stderr
    one = written(tmp_path, "one")
    assert one == written(tmp_path, "spawned") == written(tmp_path, "stdin")
    assert sorted(one) == [".bin", ".json", ".tokenizer.json"]


def test_two_workers_report_the_first_bad_line_as_one_does(learnt, tmp_path, small_chunks):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"line {n} of the text " * 20}) + "\n" for n in range(60)) +
                     "{oops\n" + json.dumps({"body": "a later error"}) + "\n")
    for workers in (1, 2):
        with pytest.raises(InputError, match=f"^{jsonl} line 61 is not JSON"):
            preprocess_megatron([str(jsonl)], str(tmp_path / "out"), str(learnt / "tok" / "tokenizer.json"),
                                workers=workers)
        assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]      # nothing half-written


@pytest.mark.parametrize("workers,message,status", [
    ("0", "Error: --workers is 0; it must be a positive integer (the processes that tokenize; the default", 1),
    ("-2", "Error: --workers is -2; it must be a positive integer", 1),
    ("two", "Error: Invalid value for '--workers': 'two' is not a valid integer.", 2),
], ids=["zero", "negative", "not-a-number"])
def test_a_bad_workers_is_refused_in_one_sentence(tmp_path, workers, message, status):
    (tmp_path / "a.txt").write_text("hello")
    result = CliRunner().invoke(main, ["preprocess", str(tmp_path / "a.txt"), "-o", str(tmp_path / "x"),
                                       "--workers", workers])
    assert result.exit_code == status and result.output.splitlines()[-1].startswith(message), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("x")]
