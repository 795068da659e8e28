"""Datasets: preprocess into a memory-mapped token file, tokenizers, the window sampler."""

import numpy as np
import pytest

from npmegatron.autograd import InputError
from npmegatron.data import (TokenDataset, WindowSampler, load_default_corpus,
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
    assert index["dtype"] == "uint16" and index["vocab_size"] == 256
    assert index["document_offsets"] == [0, 7, 13, 113]       # empty documents are skipped
    assert index["sources"][0] == str(a)
    ds = TokenDataset(str(tmp_path / "data"))
    assert isinstance(ds.tokens, np.memmap)
    assert bytes(ds.tokens.astype(np.uint8)) == "héllo\nworld\n".encode() + b"x" * 100
    train, valid = ds.split()
    assert len(train) == 13 and len(valid) == 100       # cut at the last document boundary
    assert TokenDataset(str(tmp_path / "data.bin")).prefix == str(tmp_path / "data")
    assert ds.tokenizer().decode(ds.tokens[:7]) == "héllo\n"


def test_token_dtype_widens_past_uint16():
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


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


@pytest.mark.parametrize("case,message", [
    ("missing-input", "input {tmp}/nope does not exist"),
    ("empty-input", "no text found in"),
    ("missing-dataset", "--data-path {tmp}/none: {tmp}/none.bin and {tmp}/none.json not found"),
    ("empty-bin", "is empty; preprocess some text into it"),
    ("truncated-bin", "holds 10 bytes but its index expects 20"),
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
                (tmp_path / "d.bin").write_bytes(b"\0" * 10)
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
