"""Datasets: preprocess into a memory-mapped token file, tokenizers, the window sampler."""

import json

import numpy as np
import pytest

from npmegatron.autograd import InputError
from npmegatron.data import (ByteTokenizer, TokenDataset, WindowSampler, load_default_corpus,
                             preprocess, stdlib_python_files, token_dtype)


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_embedded_corpus_is_the_standard_library_split_by_file():
    files = stdlib_python_files()
    assert files == sorted(files) and len(files) > 100
    assert not any("site-packages" in f for f in files)
    train_tokens, valid_tokens = load_default_corpus()
    assert train_tokens.dtype == np.uint8 and len(train_tokens) > 10 * len(valid_tokens) > 0
    again, _ = load_default_corpus()
    assert np.array_equal(train_tokens[:100000], again[:100000])


def test_preprocess_bytes_of_files_and_folders(tmp_path):
    a = write(tmp_path / "in" / "a.txt", "héllo\n")
    write(tmp_path / "in" / "sub" / "b.txt", "world\n")
    write(tmp_path / "in" / "sub" / "empty.txt", "")
    c = write(tmp_path / "c.txt", "x" * 100)
    index = preprocess([str(tmp_path / "in"), str(c)], str(tmp_path / "data"))
    assert index["dtype"] == "uint8" and index["vocab_size"] == 256
    assert index["document_offsets"] == [0, 7, 13, 113]       # empty documents are skipped
    assert (tmp_path / "data.bin").stat().st_size == 113      # one byte per byte-level token
    assert index["sources"][0] == str(a)
    ds = TokenDataset(str(tmp_path / "data"))
    assert isinstance(ds.tokens, np.memmap)
    assert bytes(ds.tokens.astype(np.uint8)) == "héllo\nworld\n".encode() + b"x" * 100
    train, valid = ds.split()
    assert len(train) == 13 and len(valid) == 100       # cut at the last document boundary
    assert TokenDataset(str(tmp_path / "data.bin")).prefix == str(tmp_path / "data")
    assert ds.tokenizer().decode(ds.tokens[:7]) == "héllo\n"


def test_token_dtype_is_the_narrowest_that_holds_the_vocabulary():
    assert token_dtype(256) == np.uint8 and token_dtype(257) == np.uint16
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_uint16_byte_datasets_written_before_uint8_still_read(tmp_path):
    tokens = np.frombuffer(b"hello world", np.uint8)
    tokens.astype(np.uint16).tofile(tmp_path / "old.bin")
    (tmp_path / "old.json").write_text(json.dumps({
        "format": "npmegatron-tokens-1", "dtype": "uint16", "num_tokens": 11, "vocab_size": 256,
        "tokenizer": {"type": "bytes"}, "document_offsets": [0, 11], "sources": ["a.txt"]}))
    ds = TokenDataset(str(tmp_path / "old"))
    assert ds.tokens.dtype == np.uint16 and ds.tokenizer().decode(ds.tokens) == "hello world"


@pytest.mark.parametrize("change,message", [
    ({"num_tokens": None}, "has no 'num_tokens' entry"),
    ({"document_offsets": None}, "has no 'document_offsets' entry"),
    ({"num_tokens": "11"}, "'num_tokens' is str, not an integer"),
    ({"tokenizer": "bytes"}, "'tokenizer' is str, not an object"),
    ({"dtype": "float32"}, "dtype 'float32' is not one of uint8, uint16, uint32"),
    ({"vocab_size": 0}, "vocab_size 0 is not positive"),
    ({"tokenizer": {"kind": "bytes"}}, "tokenizer type None is not 'bytes' or 'huggingface'"),
    ({"document_offsets": [1, 11]},
     "document_offsets must be integers from 0, never decreasing, to num_tokens 11"),
    ({"document_offsets": [0, 8, 4, 11]}, "never decreasing"),
    ({"document_offsets": [0, 10]}, "to num_tokens 11"),
], ids=["no-num-tokens", "no-offsets", "num-tokens-str", "tokenizer-str", "dtype", "vocab", "tokenizer-type",
        "offsets-start", "offsets-order", "offsets-end"])
def test_a_bad_index_names_its_entry_in_one_sentence(tmp_path, change, message):
    preprocess([str(write(tmp_path / "a.txt", "hello world"))], str(tmp_path / "d"))
    index = json.loads((tmp_path / "d.json").read_text())
    index.update(change)
    (tmp_path / "d.json").write_text(json.dumps({k: v for k, v in index.items() if v is not None}))
    with pytest.raises(InputError) as error:
        TokenDataset(str(tmp_path / "d"))
    text = str(error.value)
    assert text.startswith(str(tmp_path / "d.json")) and message in text
    assert text.endswith("; recreate it with `npmegatron preprocess`") and "\n" not in text


def test_text_that_is_not_utf8_is_one_sentence():
    with pytest.raises(InputError) as error:
        ByteTokenizer().encode("a\udcff")       # byte 0xff, as surrogateescape carries it
    assert str(error.value) == r"the text is not UTF-8 text ('\udcff' at character 1); pass it as UTF-8"
    assert ByteTokenizer().encode("é") == [0xc3, 0xa9]


def test_preprocess_with_a_local_hugging_face_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers, decoders
    text = "def add(a, b):\n    return a + b\n" * 50
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    write(tmp_path / "code.py", text)
    index = preprocess([str(tmp_path / "code.py")], str(tmp_path / "data"), str(tmp_path / "tokenizer.json"))
    assert index["tokenizer"] == {"type": "huggingface"} and index["vocab_size"] == tok.get_vocab_size()
    ds = TokenDataset(str(tmp_path / "data"))
    assert list(ds.tokens) == tok.encode(text).ids
    assert (tmp_path / "data.tokenizer.json").exists()
    assert ds.tokenizer().decode(ds.tokens) == text
    assert len(ds.tokens) < len(text)                 # merges happened
    with pytest.raises(InputError, match="the text is not UTF-8 text"):
        ds.tokenizer().encode("def \udcff")


@pytest.mark.parametrize("case,message", [
    ("missing-input", "input {tmp}/nope does not exist"),
    ("empty-input", "no text found in"),
    ("missing-dataset", "--data-path {tmp}/none: {tmp}/none.bin and {tmp}/none.json not found"),
    ("empty-bin", "is empty; preprocess some text into it"),
    ("truncated-bin", "holds 5 bytes but its index expects 10"),
    ("bad-tokenizer", "tokenizer file {tmp}/nope.json does not exist"),
])
def test_bad_data_is_one_clear_sentence(tmp_path, case, message):
    write(tmp_path / "empty.txt", "")
    write(tmp_path / "ten.txt", "0123456789")
    with pytest.raises(InputError) as error:
        if case == "missing-input":
            preprocess([str(tmp_path / "nope")], str(tmp_path / "d"))
        elif case == "empty-input":
            preprocess([str(tmp_path / "empty.txt")], str(tmp_path / "d"))
        elif case == "missing-dataset":
            TokenDataset(str(tmp_path / "none"))
        elif case == "bad-tokenizer":
            preprocess([str(tmp_path / "ten.txt")], str(tmp_path / "d"), str(tmp_path / "nope.json"))
        else:
            preprocess([str(tmp_path / "ten.txt")], str(tmp_path / "d"))
            if case == "empty-bin":
                (tmp_path / "d.bin").write_bytes(b"")
            else:
                (tmp_path / "d.bin").write_bytes(b"\0" * 5)
            TokenDataset(str(tmp_path / "d"))
    assert message.format(tmp=tmp_path) in str(error.value)
    assert not (tmp_path / "d.bin.partial").exists()


def test_sampler_visits_every_window_once_per_epoch():
    tokens = np.arange(1001)
    s = WindowSampler(tokens, 10, seed=3)
    assert s.num_windows == 100
    x, y = s.batch(0, 100)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    assert sorted(x[:, 0]) == list(range(0, 1000, 10))             # each window once
    again = WindowSampler(tokens, 10, seed=3)
    np.testing.assert_array_equal(again.batch(37, 5)[0], x[37:42])  # sample k depends on k only
    second, _ = s.batch(100, 100)
    assert sorted(second[:, 0]) == list(range(0, 1000, 10))
    assert not np.array_equal(second, x)                            # a new order each epoch
    with pytest.raises(InputError, match="too few for --seq-length"):
        WindowSampler(tokens[:10], 16, 0)
