"""Megatron's indexed dataset (PREFIX.bin + PREFIX.idx), JSONL preprocessing with --json-keys and
--append-eod, --data-path blends and --split."""
import json
import os
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import write_indexed_dataset
from npmegatron.autograd import InputError
from npmegatron.cli import main
from npmegatron.config import TrainConfig
from npmegatron.data import (BlendedSampler, TrainingData, open_dataset, parse_blend, parse_split,
                             preprocess, split_boundaries)
from npmegatron.data.indexed import IndexedDataset, megatron_token_dtype, read_index

WORDS = ["[UNK]", "<|endoftext|>", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
DOCUMENTS = [np.array([5, 1, 2]), np.array([7]), np.array([3, 3, 3, 3, 9]), np.array([], np.int64),
             np.array([0, 65535])]


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def words_tokenizer(path):
    """A tiny word-level tokenizer.json with GPT-2's end-of-document token (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return str(path)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# ---- the format ---------------------------------------------------------------------------------

def test_a_dataset_written_in_megatron_format_reads_back_identically(tmp_path):
    write_indexed_dataset(str(tmp_path / "d"), DOCUMENTS, np.uint16)
    data = IndexedDataset(str(tmp_path / "d"))
    assert isinstance(data.tokens, np.memmap) and data.tokens.dtype == np.uint16 and len(data) == 5
    for i, document in enumerate(DOCUMENTS):
        np.testing.assert_array_equal(data[i], document)
        np.testing.assert_array_equal(data.tokens[data.document_offsets[i]:data.document_offsets[i + 1]], document)
    np.testing.assert_array_equal(data.tokens, np.concatenate(DOCUMENTS))
    assert list(data.document_offsets) == [0, 3, 4, 9, 9, 11]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]


def test_the_idx_layout_field_by_field(tmp_path):
    write_indexed_dataset(str(tmp_path / "d"), DOCUMENTS, np.int32)
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, sequences, documents = struct.unpack_from("<QBQQ", raw, 9)
    assert (version, code, sequences, documents) == (1, 4, 5, 6)          # 4: int32
    at = 9 + 8 + 1 + 8 + 8
    lengths = struct.unpack_from("<5i", raw, at)
    pointers = struct.unpack_from("<5q", raw, at + 5 * 4)
    document_indices = struct.unpack_from("<6q", raw, at + 5 * 4 + 5 * 8)
    assert lengths == (3, 1, 5, 0, 2)
    assert pointers == (0, 12, 16, 36, 36)                          # bytes: 4 per int32 token
    assert document_indices == (0, 1, 2, 3, 4, 5)                   # one sequence per document
    assert len(raw) == at + 5 * 4 + 5 * 8 + 6 * 8
    assert (tmp_path / "d.bin").read_bytes() == np.concatenate(DOCUMENTS).astype("<i4").tobytes()


def test_dtype_codes_and_megatron_s_choice_of_token_type(tmp_path):
    assert megatron_token_dtype(256) == np.uint16 and megatron_token_dtype(65499) == np.uint16
    assert megatron_token_dtype(65500) == np.int32 and megatron_token_dtype(50257) == np.uint16
    for dtype, code in ((np.uint8, 1), (np.int8, 2), (np.int16, 3), (np.int64, 5), (np.float64, 6),
                        (np.float32, 7), (np.uint16, 8)):
        write_indexed_dataset(str(tmp_path / "d"), [np.array([1, 2, 3])], dtype)
        assert (tmp_path / "d.idx").read_bytes()[17] == code
        assert read_index(str(tmp_path / "d.idx"))[0] == np.dtype(dtype)
    with pytest.raises(InputError, match="token ids 0..65536 do not fit uint16"):
        write_indexed_dataset(str(tmp_path / "e"), [np.array([0, 65536])], np.uint16)
    assert not (tmp_path / "e.bin").exists() and not (tmp_path / "e.bin.partial").exists()


def damage(prefix, case):
    idx = prefix + ".idx"
    raw = bytearray(open(idx, "rb").read())
    if case == "magic":
        raw[:9] = b"NOTMMIDX\x00"
    elif case == "version":
        raw[9:17] = struct.pack("<Q", 2)
    elif case == "code":
        raw[17] = 9
    elif case == "truncated":
        raw = raw[:-5]
    elif case == "header":
        raw = raw[:20]
    elif case == "pointers":
        raw[34 + 3 * 4:34 + 3 * 4 + 8] = struct.pack("<q", 7)
    if case == "bin":
        with open(prefix + ".bin", "ab") as f:
            f.write(b"\0\0")
    else:
        open(idx, "wb").write(bytes(raw))


@pytest.mark.parametrize("case,message", [
    ("magic", "{p}.idx starts with b'NOTMMIDX\\x00', not Megatron's magic b'MMIDIDX\\x00\\x00', so it is "
              "not a Megatron indexed-dataset index"),
    ("version", "{p}.idx is index version 2, but only version 1 is supported"),
    ("code", "{p}.idx has dtype code 9, not one of Megatron's codes 1-8"),
    ("truncated", "{p}.idx holds 97 bytes but its header promises 102 (3 sequences, 4 documents); it is "
                  "truncated or corrupt"),
    ("header", "{p}.idx holds 20 bytes, fewer than the 34-byte header of a Megatron index"),
    ("pointers", "{p}.idx: the sequence pointers are not the sequences back to back from byte 0"),
    ("bin", "{p}.bin holds 14 bytes but {p}.idx expects 12; it is truncated or corrupt"),
])
def test_a_bad_idx_is_one_sentence_naming_the_file_and_the_fix(tmp_path, case, message):
    prefix = str(tmp_path / "d")
    write_indexed_dataset(prefix, [np.array([1, 2]), np.array([3]), np.array([4, 5, 6])], np.uint16)
    damage(prefix, case)
    for read in (IndexedDataset, TrainingData):
        with pytest.raises(InputError) as error:
            read(prefix)
        text = str(error.value)
        assert text.startswith(message.format(p=prefix)), text
        assert "\n" not in text and text.endswith("`npmegatron preprocess --output-format megatron`")


# ---- preprocess ---------------------------------------------------------------------------------

def test_jsonl_with_json_keys_and_append_eod_through_the_command(tmp_path):
    pytest.importorskip("tokenizers")
    tokenizer = words_tokenizer(tmp_path / "tokenizer.json")
    data = write_jsonl(tmp_path / "corpus.jsonl", [
        {"text": "the quick brown fox", "title": "fox", "id": 1},
        {"text": "", "title": "nothing"},                 # an empty document is skipped
        {"text": "jumps over the lazy dog", "title": "dog"}])
    result = cli("preprocess", "--input", data, "--output-prefix", tmp_path / "out", "--tokenizer", tokenizer,
                 "--json-keys", "text", "--json-keys", "title", "--append-eod")
    assert result.exit_code == 0, result.output
    assert f"{tmp_path}/out_text_document.bin/.idx: 11 tokens (uint16) from 2 documents, vocabulary 10" \
        in result.output
    text = open_dataset(str(tmp_path / "out_text_document"))
    assert list(text.tokens) == [2, 3, 4, 5, 1, 6, 7, 2, 8, 9, 1]        # <|endoftext|> is 1
    assert list(text.document_offsets) == [0, 5, 11]
    title = IndexedDataset(str(tmp_path / "out_title_document"))
    assert [list(title[i]) for i in range(3)] == [[5, 1], [0, 1], [9, 1]]     # "nothing" is [UNK]
    sidecar = json.loads((tmp_path / "out_text_document.npmegatron.json").read_text())
    assert sidecar["vocab_size"] == 10 and sidecar["eod_id"] == 1
    assert (tmp_path / "out_text_document.tokenizer.json").exists()
    assert text.tokenizer().decode(text.tokens[:4]) == "the quick brown fox"


def test_text_files_in_megatron_format_and_back(tmp_path):
    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / "b.txt").write_text("world")
    result = cli("preprocess", tmp_path / "a.txt", tmp_path / "b.txt", "-o", tmp_path / "d",
                 "--output-format", "megatron")
    assert result.exit_code == 0, result.output
    data = open_dataset(str(tmp_path / "d"))
    assert data.tokens.dtype == np.uint16 and data.tokenizer().decode(data.tokens) == "hello world"
    assert list(data.document_offsets) == [0, 6, 11] and data.vocab_size == 256
    preprocess([str(tmp_path / "a.txt")], str(tmp_path / "d"))     # the npmegatron format replaces it
    assert not (tmp_path / "d.idx").exists() and len(open_dataset(str(tmp_path / "d")).tokens) == 6
    result = cli("preprocess", tmp_path / "b.txt", "-o", tmp_path / "d", "--output-format", "megatron")
    assert result.exit_code == 0
    assert not (tmp_path / "d.json").exists() and len(open_dataset(str(tmp_path / "d")).tokens) == 5


def test_data_from_megatron_itself_needs_its_tokenizer_beside_it(tmp_path):
    pytest.importorskip("tokenizers")
    write_indexed_dataset(str(tmp_path / "m"), [np.array([2, 3, 4]), np.array([5, 1])], np.uint16)
    with pytest.raises(InputError, match=f"copy the tokenizer.json the data was made with to {tmp_path}/m.tok"):
        open_dataset(str(tmp_path / "m"))
    words_tokenizer(tmp_path / "m.tokenizer.json")
    data = open_dataset(str(tmp_path / "m"))
    assert data.vocab_size == 10 and data.tokenizer().decode(data.tokens[:3]) == "the quick brown"
    write_indexed_dataset(str(tmp_path / "m"), [np.array([2, 30])], np.uint16)
    with pytest.raises(InputError, match="holds token ids 2..30, outside the vocabulary"):
        open_dataset(str(tmp_path / "m"))


@pytest.mark.parametrize("args,message", [
    (["{d}/a.jsonl", "--append-eod"], "--append-eod needs an end-of-document token, which the byte-level "
                                      "tokenizer lacks"),
    (["{d}/a.jsonl", "--append-eod", "--tokenizer", "{d}/plain.json"],
     "--append-eod needs an end-of-document token, but tokenizer file {d}/plain.json has no <|endoftext|>"),
    (["{d}/a.jsonl", "--json-keys", "body"], "{d}/a.jsonl line 1 has no 'body' key, not text; pass --json"),
    (["{d}/bad.jsonl"], "{d}/bad.jsonl line 2 is not JSON ("),
    (["{d}/list.jsonl"], "{d}/list.jsonl line 1 is a JSON list, not an object"),
    (["{d}/number.jsonl"], "{d}/number.jsonl line 1 has a int under the 'text' key, not text"),
    (["{d}/empty.jsonl"], "no text found under key 'text' in {d}/empty.jsonl"),
    (["{d}/a.jsonl", "{d}/a.txt"], "inputs mix JSONL ({d}/a.jsonl) and text ({d}/a.txt)"),
    (["{d}/a.jsonl", "--output-format", "npmegatron"], "JSONL input is written in Megatron's format"),
    (["{d}/a.txt", "--json-keys", "text"], "--json-keys text picks fields of JSONL input, but the inputs"),
])
def test_bad_preprocess_input_is_one_sentence(tmp_path, args, message):
    tokenizers = pytest.importorskip("tokenizers")
    plain = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    plain.save(str(tmp_path / "plain.json"))
    write_jsonl(tmp_path / "a.jsonl", [{"text": "the fox"}])
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    write_jsonl(tmp_path / "list.jsonl", [["text"]])
    write_jsonl(tmp_path / "number.jsonl", [{"text": 3}])
    write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}])
    (tmp_path / "a.txt").write_text("text")
    result = cli("preprocess", *[a.format(d=tmp_path) for a in args], "--output", tmp_path / "out")
    assert result.exit_code == 1
    assert result.output.startswith("Error: " + message.format(d=tmp_path)), result.output
    assert result.output.count("\n") == 1
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]      # nothing half-written


# ---- blends and splits --------------------------------------------------------------------------

def two_datasets(tmp_path):
    """A: 40 documents of 'a' bytes; B: 40 of 'b' bytes (a sample's first token tells its dataset)."""
    for name in "ab":
        write_jsonl(tmp_path / f"{name}.jsonl", [{"text": name * 50} for _ in range(40)])
        assert cli("preprocess", tmp_path / f"{name}.jsonl", "-o", tmp_path / name).exit_code == 0
    return str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")


def test_a_blend_draws_in_proportion_to_its_weights_deterministically(tmp_path):
    a, b = two_datasets(tmp_path)
    data = TrainingData(f"0.7 {a} 0.3 {b}")
    assert data.train.weights == pytest.approx([0.7, 0.3]) and len(data.train) == 2 * len(data.train.parts[0])
    sampler = data.sampler("train", 16, seed=5)
    assert isinstance(sampler, BlendedSampler)
    x, y = sampler.batch(0, 1000)
    from_a = x[:, 0] == ord("a")
    assert from_a.sum() == 700 and (x[~from_a, 0] == ord("b")).all()        # exactly 70/30 over 1000
    assert abs(from_a[:10].sum() - 7) <= 1                                  # and already early on
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    again = TrainingData(f"0.7 {a} 0.3 {b}").sampler("train", 16, seed=5)
    np.testing.assert_array_equal(again.batch(613, 7)[0], x[613:620])      # sample k depends on k only
    assert parse_blend(f"7 {a} 3 {b}") == [(0.7, a), (0.3, b)]            # weights normalised
    assert parse_blend(a) == [(1.0, a)] and parse_blend(f"2 {a}") == [(1.0, a)]
    assert data.validation_or_train(16).names == [a, b]


@pytest.mark.parametrize("blend,message", [
    ("0.7 {a} 0.3", "--data-path '0.7 {a} 0.3' has 3 words; a blend is weight and PREFIX pairs"),
    ("x {a} 0.3 {b}", "--data-path blend weight 'x' is not a positive number"),
    ("0.7 {a} -1 {b}", "--data-path blend weight '-1' is not a positive number"),
    ("0.7 {a} nan {b}", "--data-path blend weight 'nan' is not a positive number"),
    ("{a} 0.5 {b} 0.5", "--data-path blend weight '{a}' is not a positive number"),
])
def test_bad_blends_are_refused_in_one_sentence(tmp_path, blend, message):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with pytest.raises(InputError) as error:
        TrainingData(blend.format(a=a, b=b))
    assert str(error.value).startswith(message.format(a=a, b=b))
    assert str(error.value).endswith("e.g. '0.7 data/a 0.3 data/b'")


def test_a_blend_of_different_vocabularies_is_refused(tmp_path):
    pytest.importorskip("tokenizers")
    a, _ = two_datasets(tmp_path)
    write_jsonl(tmp_path / "w.jsonl", [{"text": "the fox"}])
    tokenizer = words_tokenizer(tmp_path / "t.json")
    result = cli("preprocess", tmp_path / "w.jsonl", "-o", tmp_path / "w", "--tokenizer", tokenizer)
    assert result.exit_code == 0, result.output
    with pytest.raises(InputError, match="preprocess them with the same --tokenizer"):
        TrainingData(f"0.5 {a} 0.5 {tmp_path}/w_text_document")


def test_split_proportions_follow_megatron(tmp_path):
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_split("98/2") == [0.98, 0.02, 0.0]
    assert split_boundaries(parse_split("949,50,1"), 1000) == [0, 949, 999, 1000]
    assert split_boundaries(parse_split("80,15,5"), 100) == [0, 80, 95, 100]
    assert split_boundaries(parse_split("1,1,1"), 10) == [0, 4, 7, 10]     # the shortfall: first part
    assert split_boundaries(parse_split("949,50,1"), 10) == [0, 10, 10, 10]
    documents = [np.full(10 + i, i) for i in range(20)]          # document i: 10 + i tokens of value i
    write_indexed_dataset(str(tmp_path / "d"), documents, np.uint16)
    (tmp_path / "d.npmegatron.json").write_text(json.dumps(
        {"format": "npmegatron-megatron-sidecar-1", "vocab_size": 256, "tokenizer": {"type": "bytes"}}))
    data = TrainingData(str(tmp_path / "d"), "75,15,10")
    assert sorted(set(data.train.tolist())) == list(range(15))             # documents 0..14
    assert sorted(set(data.valid.tolist())) == [15, 16, 17]                # 15..17; 18, 19 are test
    default = TrainingData(str(tmp_path / "d"))
    assert sorted(set(default.valid.tolist())) == [19]                     # about 5 % of the tokens


@pytest.mark.parametrize("split", ["", "a,b", "1,2,3,4", "-1,2", "0,0,0", "inf,1"])
def test_bad_splits_are_one_sentence(tmp_path, split):
    with pytest.raises(InputError) as error:
        TrainConfig.from_flat(data_path=str(tmp_path / "d"), split=split)
    assert str(error.value) == (f"--split {split!r} must be up to three proportions for train, validation "
                                "and test, not negative and not all 0, e.g. 949,50,1")
    with pytest.raises(InputError, match="--split 98,2 divides --data-path datasets, but the run uses the "
                                         "embedded corpus"):
        TrainConfig.from_flat(split="98,2")


# ---- training -----------------------------------------------------------------------------------

def tiny_run(**options):
    from npmegatron.training import train
    config = TrainConfig.from_flat(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                                   micro_batch_size=2, train_iters=2, lr_warmup_iters=1, log_interval=1,
                                   eval_interval=2, eval_iters=1, sample_tokens=0, **options)
    lines = []
    losses = train(config, echo=lines.append)
    return losses, "\n".join(lines)


def test_training_reads_a_jsonl_dataset_with_end_of_document_tokens(tmp_path):
    pytest.importorskip("tokenizers")
    tokenizer = words_tokenizer(tmp_path / "tokenizer.json")
    write_jsonl(tmp_path / "c.jsonl", [{"text": "the quick brown fox jumps over the lazy dog"}] * 30)
    assert cli("preprocess", tmp_path / "c.jsonl", "-o", tmp_path / "c", "--tokenizer", tokenizer,
               "--append-eod").exit_code == 0
    losses, log = tiny_run(data_path=str(tmp_path / "c_text_document"))
    assert len(losses) == 2 and all(np.isfinite(losses)) and losses[0] == pytest.approx(np.log(10), rel=0.2)
    assert f"data {tmp_path}/c_text_document" in log


def test_training_on_a_blend_with_a_split(tmp_path):
    a, b = two_datasets(tmp_path)
    losses, log = tiny_run(data_path=f"0.7 {a} 0.3 {b}", split="90,10,0")
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert f"data blend 0.7 x {a} + 0.3 x {b} (--split 90,10,0)" in log
    assert losses == tiny_run(data_path=f"0.7 {a} 0.3 {b}", split="90,10,0")[0]
