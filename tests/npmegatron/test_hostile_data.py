"""Datasets that lie (issue 26): Megatron's .idx + .bin, npmegatron's PREFIX.json + .bin, the sidecar,
JSONL input, --data-path blends and --split are checked when they are read; a lie is one sentence
(InputError) naming the file or value and the fix, never a traceback or silently wrong tokens."""
import json
import os
import shutil
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import strategies as st

from hostile import BUDGETS, check_property, one_sentence
from npmegatron.autograd import InputError
from npmegatron.data import (TrainingData, open_dataset, parse_blend, parse_split, preprocess,
                             preprocess_megatron)
from helpers import write_indexed_dataset
from npmegatron.data.indexed import HEADER, IndexedDataset

DOCUMENTS = [np.array([1, 2]), np.array([3]), np.array([4, 5, 6])]
SIDECAR = {"format": "npmegatron-megatron-sidecar-1", "vocab_size": 256, "tokenizer": {"type": "bytes"}}
HEADER_FIELDS = ("magic", "version", "code", "count", "documents")


def megatron(folder, documents=DOCUMENTS, dtype=np.uint16, sidecar=SIDECAR):
    """A valid Megatron dataset FOLDER/m (.bin, .idx and the sidecar), written by the project's writer."""
    prefix = os.path.join(str(folder), "m")
    write_indexed_dataset(prefix, documents, dtype)
    with open(prefix + ".npmegatron.json", "w") as f:
        json.dump(sidecar, f)
    return prefix


def tokens_dataset(folder, tokenizer=None):
    """A valid npmegatron dataset FOLDER/t (.bin and .json) of two documents, 'hello ' and 'world'."""
    paths = []
    for name, text in (("a.txt", "hello "), ("b.txt", "world")):
        paths.append(os.path.join(str(folder), name))
        with open(paths[-1], "w") as f:
            f.write(text)
    preprocess(paths, os.path.join(str(folder), "t"), tokenizer)
    return os.path.join(str(folder), "t")


def words_tokenizer(folder):
    """A three-word Hugging Face tokenizer.json (no download)."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2},
                                                                 unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(str(folder), "words.json"))
    return os.path.join(str(folder), "words.json")


# ---- the lies, one function each: it damages a valid file, then reads it ------------------------

def idx_arrays(lengths, pointers, documents, code=8):
    """An .idx whose header counts agree with the arrays given (so only the arrays lie)."""
    return (HEADER.pack(b"MMIDIDX\x00\x00", 1, code, len(lengths), len(documents))
            + np.asarray(lengths, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes()
            + np.asarray(documents, "<i8").tobytes())


def header(**fields):
    """The valid .idx with header fields changed (the arrays after it left as they are)."""
    def change(raw):
        values = dict(zip(HEADER_FIELDS, HEADER.unpack(bytes(raw[:HEADER.size]))))
        values.update(fields)
        return HEADER.pack(*values.values()) + raw[HEADER.size:]
    return change


def read_idx(change=None, dtype=np.uint16, documents=DOCUMENTS, sidecar=SIDECAR, bin_change=None):
    """A reader of FOLDER/m once its .idx bytes went through `change` (or were replaced by bytes)."""
    def read(folder):
        prefix = megatron(folder, documents, dtype, sidecar)
        for suffix, how in ((".idx", change), (".bin", bin_change)):
            if how is not None:
                with open(prefix + suffix, "rb") as f:
                    raw = f.read()
                with open(prefix + suffix, "wb") as f:
                    f.write(how if isinstance(how, bytes) else how(raw))
        return TrainingData(prefix)
    return read


def read_sidecar(text):
    def read(folder):
        prefix = megatron(folder)
        with open(prefix + ".npmegatron.json", "w") as f:
            f.write(text)
        return TrainingData(prefix)
    return read


def read_index(hf_tokenizer=False, bin_bytes=None, **changes):
    """A reader of FOLDER/t once its .json index has `changes` (and its .bin holds `bin_bytes`)."""
    def read(folder):
        prefix = tokens_dataset(folder, words_tokenizer(folder) if hf_tokenizer else None)
        with open(prefix + ".json") as f:
            index = json.load(f)
        index.update(changes)
        with open(prefix + ".json", "w") as f:
            json.dump(index, f)
        if bin_bytes is not None:
            with open(prefix + ".bin", "wb") as f:
                f.write(bin_bytes)
        return TrainingData(prefix)
    return read


def read_index_text(text):
    def read(folder):
        prefix = tokens_dataset(folder)
        with open(prefix + ".json", "wb") as f:
            f.write(text)
        return TrainingData(prefix)
    return read


def read_jsonl(text, keys=()):
    def read(folder):
        path = os.path.join(str(folder), "in.jsonl")
        with open(path, "w") as f:
            f.write(text)
        return preprocess_megatron([path], os.path.join(str(folder), "out"), json_keys=keys)
    return read


def read_blend(blend):
    def read(folder):
        tokens_dataset(folder)
        return TrainingData(blend.format(d=folder))
    return read


def read_split(split):
    return lambda folder: parse_split(split)


DEEP = "[" * 100000 + "]" * 100000


LIES = [
    # Megatron's .idx (header, arrays) and .bin
    pytest.param(read_idx(header(magic=b"NOTMMIDX\x00")),
                 "{d}/m.idx starts with b'NOTMMIDX\\x00', not Megatron's magic",
                 id="idx-bad-magic"),
    pytest.param(read_idx(header(version=2)), "{d}/m.idx is index version 2, but only version 1", id="idx-bad-version"),
    pytest.param(read_idx(header(code=9)), "{d}/m.idx has dtype code 9, not one of Megatron's codes 1-8",
                 id="idx-unknown-dtype-code"),
    pytest.param(read_idx(header(code=0)), "{d}/m.idx has dtype code 0", id="idx-dtype-code-zero"),
    pytest.param(read_idx(lambda raw: raw[:-5]), "{d}/m.idx holds 97 bytes but its header promises 102",
                 id="idx-truncated"),
    pytest.param(read_idx(lambda raw: raw[:20]), "{d}/m.idx holds 20 bytes, fewer than the 34-byte header",
                 id="idx-header-truncated"),
    pytest.param(read_idx(header(count=1000)), "its header promises 12066 (1000 sequences, 4 documents)",
                 id="idx-count-claims-more"),
    pytest.param(read_idx(header(documents=2 ** 64 - 1)), "(3 sequences, 18446744073709551615 documents)",
                 id="idx-document-count-claims-more"),
    pytest.param(read_idx(header(count=5, documents=1)), "{d}/m.idx: the sequence pointers are not the sequences back",
                 id="idx-document-count-vs-sequence-count"),
    pytest.param(read_idx(idx_arrays([2, 1, 3], [0, 4, 5], [0, 1, 2, 3])),
                 "{d}/m.idx: the sequence pointers are not the sequences back to back", id="idx-pointers-disagree"),
    pytest.param(read_idx(idx_arrays([2, 1, 30], [0, 4, 6], [0, 1, 2, 3])),
                 "{d}/m.bin holds 12 bytes but {d}/m.idx expects 66", id="idx-pointer-past-bin"),
    pytest.param(read_idx(idx_arrays([2, -1, 3], [0, 4, 2], [0, 1, 2, 3])), "{d}/m.idx has negative sequence lengths",
                 id="idx-negative-length"),
    pytest.param(read_idx(idx_arrays([2, 1, 3], [0, 4, 6], [1, 2, 3])), "the document indices must rise from 0 to",
                 id="idx-documents-not-from-0"),
    pytest.param(read_idx(idx_arrays([2, 1, 3], [0, 4, 6], [0, 1, 5])), "the document indices must rise from 0 to the "
                 "sequence count 3", id="idx-documents-past-count"),
    pytest.param(read_idx(idx_arrays([2, 1, 3], [0, 4, 6], [0, 2, 1, 3])), "the document indices must rise",
                 id="idx-documents-decreasing"),
    pytest.param(read_idx(idx_arrays([2, 1, 3], [0, 4, 6], [])), "the document indices must rise",
                 id="idx-no-documents"),
    pytest.param(read_idx(bin_change=lambda raw: raw[:-2]), "{d}/m.bin holds 10 bytes but {d}/m.idx expects 12",
                 id="idx-bin-truncated"),
    pytest.param(read_idx(dtype=np.float32), "{d}/m.idx stores float32 values, but token ids are integers",
                 id="idx-float-tokens"),
    pytest.param(read_idx(bin_change=lambda raw: raw[:-2] + struct.pack("<H", 300)),
                 "{d}/m.bin holds token ids 1..300, outside the vocabulary of {d}/m.npmegatron.json (256)",
                 id="idx-token-outside-vocabulary"),
    pytest.param(read_idx(dtype=np.int8, documents=[np.array([-5, 3])]),
                 "{d}/m.bin holds token ids -5..3, outside the vocabulary", id="idx-negative-token"),
    # the sidecar beside a Megatron dataset
    pytest.param(read_idx(sidecar=dict(SIDECAR, vocab_size=300)),
                 "{d}/m.npmegatron.json: vocab_size 300 is not the byte tokenizer's 256",
                 id="sidecar-bytes-vocabulary"),
    pytest.param(read_idx(sidecar=dict(SIDECAR, vocab_size=True)), "{d}/m.npmegatron.json is not an npmegatron sidecar",
                 id="sidecar-vocab-bool"),
    pytest.param(read_sidecar(DEEP), "{d}/m.npmegatron.json is not an npmegatron sidecar", id="sidecar-deeply-nested"),
    # npmegatron's PREFIX.json index
    pytest.param(read_index(document_offsets=[0, True, 11]), "{d}/t.json: document_offsets must be integers",
                 id="index-offsets-bool"),
    pytest.param(read_index(document_offsets=[False, 6, 11]), "{d}/t.json: document_offsets must be integers",
                 id="index-offsets-bool-zero"),
    pytest.param(read_index(document_offsets=[0, 6.0, 11]), "document_offsets must be integers",
                 id="index-offsets-float"),
    pytest.param(read_index(document_offsets=[0, [6], 11]), "document_offsets must be integers",
                 id="index-offsets-nested"),
    pytest.param(read_index(document_offsets=[0, 6, 20], num_tokens=20), "{d}/t.bin holds 11 bytes but its index "
                 "expects 20", id="index-offsets-past-bin"),
    pytest.param(read_index(num_tokens=True), "{d}/t.json: 'num_tokens' is bool, not an integer",
                 id="index-count-bool"),
    pytest.param(read_index(vocab_size=True), "'vocab_size' is bool, not an integer", id="index-vocab-bool"),
    pytest.param(read_index(vocab_size=300), "{d}/t.json: vocab_size 300 is not the byte tokenizer's 256",
                 id="index-bytes-vocabulary"),
    pytest.param(read_index(tokenizer={"type": ["bytes"]}), "tokenizer type ['bytes'] is not 'bytes' or 'huggingface'",
                 id="index-tokenizer-nested"),
    pytest.param(read_index(dtype="uint16", num_tokens=2, document_offsets=[0, 2],
                            bin_bytes=struct.pack("<HH", 7, 300)),
                 "{d}/t.bin holds token ids 7..300, outside the vocabulary of {d}/t.json (256)",
                 id="index-token-outside-vocabulary"),
    pytest.param(read_index(hf_tokenizer=True, vocab_size=50),
                 "{d}/t.tokenizer.json has a vocabulary of 3, but the index of {d}/t records 50",
                 id="index-tokenizer-vocabulary-differs"),
    pytest.param(read_index_text(b"[1, 2]"), "{d}/t.json is not an npmegatron dataset index", id="index-not-object"),
    pytest.param(read_index_text(b"\xff\xfe{}"), "{d}/t.json is not an npmegatron dataset index", id="index-not-utf8"),
    pytest.param(read_index_text(DEEP.encode()), "{d}/t.json is not an npmegatron dataset index",
                 id="index-deeply-nested"),
    # JSONL input
    pytest.param(read_jsonl('{"text": "a"}\n{"text": \n'), "{d}/in.jsonl line 2 is not JSON (", id="jsonl-not-json"),
    pytest.param(read_jsonl('{"text": "a"}\n', keys=("body",)), "{d}/in.jsonl line 1 has no 'body' key",
                 id="jsonl-missing-key"),
    pytest.param(read_jsonl('{"text": ["a"]}\n'), "{d}/in.jsonl line 1 has a list under the 'text' key",
                 id="jsonl-key-not-text"),
    pytest.param(read_jsonl('{"text": "a"}\n\n' + DEEP + "\n"), "{d}/in.jsonl line 3 is not JSON (",
                 id="jsonl-deeply-nested"),
    # --data-path blends
    pytest.param(read_blend("0.5 {d}/t -0.5 {d}/t"), "--data-path blend weight '-0.5' is not a positive number",
                 id="blend-negative"),
    pytest.param(read_blend("0 {d}/t 0 {d}/t"), "--data-path blend weight '0' is not a positive number",
                 id="blend-zero-sum"),
    pytest.param(read_blend("half {d}/t 0.5 {d}/t"), "--data-path blend weight 'half' is not a positive number",
                 id="blend-not-a-number"),
    pytest.param(read_blend("nan {d}/t 1 {d}/t"), "--data-path blend weight 'nan' is not a positive number",
                 id="blend-nan"),
    pytest.param(read_blend("inf {d}/t 1 {d}/t"), "--data-path blend weight 'inf' is not a positive number",
                 id="blend-inf"),
    pytest.param(read_blend("0.5 {d}/t 0.5"), "--data-path '0.5 {d}/t 0.5' has 3 words", id="blend-missing-prefix"),
    pytest.param(read_blend("0.5 {d}/t 0.5 {d}/none"), "--data-path {d}/none: {d}/none.bin and {d}/none.json not found",
                 id="blend-prefix-not-found"),
    pytest.param(read_blend("1e308 {d}/t 1e-308 {d}/t"), "--data-path blend weight '1e-308' is too small beside "
                 "'1e308' to be drawn", id="blend-weights-too-far-apart"),
    # --split
    pytest.param(read_split("a,b,c"), "--split 'a,b,c' must be up to three proportions", id="split-not-numbers"),
    pytest.param(read_split("1,2,3,4"), "--split '1,2,3,4' must be up to three proportions", id="split-four-numbers"),
    pytest.param(read_split("98,-1,3"), "--split '98,-1,3' must be up to three proportions", id="split-negative"),
    pytest.param(read_split("nan,1,1"), "--split 'nan,1,1' must be up to three proportions", id="split-nan"),
    pytest.param(read_split("0,0,0"), "--split '0,0,0' must be up to three proportions", id="split-all-zero"),
    pytest.param(read_split("0,50,50"), "--split '0,50,50' leaves nothing to train on", id="split-no-training"),
    pytest.param(read_split("1e-320,1e308,0"), "--split '1e-320,1e308,0' leaves nothing to train on",
                 id="split-training-underflows"),
]


@pytest.mark.parametrize("read,message", LIES)
def test_each_lie_is_one_sentence(tmp_path, read, message):
    with pytest.raises(InputError) as error:
        read(tmp_path)
    assert message.format(d=tmp_path) in one_sentence(error.value)


def test_huge_weights_and_proportions_are_shares_not_zeros(tmp_path):
    a = tokens_dataset(tmp_path)
    assert parse_blend(f"1e308 {a} 1e308 {a}") == [(0.5, a), (0.5, a)]
    assert parse_split("1e308,1e308,0") == [0.5, 0.5, 0.0]


def test_the_untouched_files_read(tmp_path):
    for name in ("m", "t", "hf", "j"):
        os.makedirs(tmp_path / name)
    assert len(read_idx()(tmp_path / "m").train) > 0
    assert read_index()(tmp_path / "t").vocab_size == 256
    assert read_index(hf_tokenizer=True)(tmp_path / "hf").vocab_size == 3
    assert read_jsonl('{"text": "a"}\n\n{"text": "bc"}\n')(tmp_path / "j")[0]["num_documents"] == 2


# ---- mutations of valid files, generated --------------------------------------------------------

def loaded_consistently(prefix):
    """Open PREFIX as training does; when it opens, every token read is inside the file and the
    vocabulary, and the tokenizer is the one the index records."""
    try:
        data = TrainingData(prefix)
    except InputError as error:
        one_sentence(error)
        return
    tokens = np.concatenate([np.asarray(data.train), np.asarray(data.valid)])
    assert tokens.size and ((tokens >= 0) & (tokens < data.vocab_size)).all()
    assert data.tokenizer.vocab_size == data.vocab_size


HOSTILE_SCALARS = (
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.integers(-3, 300)
    | st.sampled_from([0, 1, 6, 11, 12, 255, 256, 257, 2 ** 31, 2 ** 63])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["uint8", "uint16", "uint32", "float32", "bytes", "huggingface", "npmegatron-tokens-1", ""])
    | st.text(max_size=6))
# Mostly scalars: they pass the type checks and reach the range checks behind them.
HOSTILE_VALUES = st.one_of(HOSTILE_SCALARS, HOSTILE_SCALARS, st.recursive(
    HOSTILE_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["type", "x"]) | st.text(max_size=4),
                                                                 inner, max_size=3),
    max_leaves=6))


IDX_DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float32, np.uint16]
UINT64 = st.integers(0, 2 ** 64 - 1) | st.sampled_from([0, 1, 2, 3, 4, 5, 2 ** 63, 2 ** 64 - 1])
IDX_MUTATIONS = st.one_of(
    st.tuples(st.just("idx-bytes"), st.integers(0, 2 ** 16), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("idx-cut"), st.floats(0, 1), st.none()),
    st.tuples(st.just("header"), st.sampled_from(HEADER_FIELDS[1:]), UINT64),
    st.tuples(st.just("bin-bytes"), st.integers(0, 2 ** 16), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("bin-cut"), st.floats(0, 1), st.none()),
    st.tuples(st.just("arrays"), st.lists(st.integers(-3, 9), max_size=6), st.lists(st.integers(-1, 6), max_size=6)),
    st.tuples(st.just("sidecar"), st.sampled_from(sorted(SIDECAR)), HOSTILE_VALUES))


def mutated_idx(raw_idx, raw_bin, itemsize, case):
    """(.idx bytes, .bin bytes) of a valid pair after one generated mutation."""
    kind, where, what = case
    idx, data = bytearray(raw_idx), bytearray(raw_bin)
    if kind in ("idx-bytes", "bin-bytes"):
        target = idx if kind == "idx-bytes" else data
        if target:
            target[where % len(target):where % len(target) + len(what)] = what
    elif kind in ("idx-cut", "bin-cut"):
        target = idx if kind == "idx-cut" else data
        del target[int(len(target) * where):]
    elif kind == "header":             # the dtype code is one byte
        idx = bytearray(header(**{where: what % 256 if where == "code" else what})(bytes(idx)))
    else:                      # lengths and documents made up; pointers back to back, as a writer would
        lengths = np.asarray(where, np.int64)
        pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * itemsize if where else []
        idx = bytearray(idx_arrays(lengths, pointers, what, code=idx[17]))
    return bytes(idx), bytes(data)


@pytest.mark.parametrize("examples", BUDGETS)
def test_mutated_megatron_datasets_load_consistently_or_are_refused(tmp_path, examples):
    bases = {}
    for dtype in IDX_DTYPES:
        prefix = megatron(tempfile.mkdtemp(dir=tmp_path), dtype=dtype)
        bases[dtype] = tuple(open(prefix + suffix, "rb").read() for suffix in (".idx", ".bin"))

    def check(case):
        dtype, mutation = case
        folder = tempfile.mkdtemp(dir=tmp_path)
        kind, field, value = mutation
        if kind == "sidecar":
            prefix = megatron(folder, dtype=dtype, sidecar=dict(SIDECAR, **{field: value}))
        else:
            prefix = megatron(folder, dtype=dtype)
            for suffix, raw in zip((".idx", ".bin"), mutated_idx(*bases[dtype], np.dtype(dtype).itemsize, mutation)):
                with open(prefix + suffix, "wb") as f:
                    f.write(raw)
        try:
            dataset = IndexedDataset(prefix)
        except InputError as error:
            one_sentence(error)
        else:
            offsets, starts = dataset.document_offsets, dataset.sequence_starts
            assert starts[-1] == dataset.tokens.size and (np.diff(starts) >= 0).all()
            assert offsets[0] == 0 and offsets[-1] == dataset.tokens.size and (np.diff(offsets) >= 0).all()
            assert [len(dataset[i]) for i in range(len(dataset))] == dataset.lengths.tolist()
            del dataset
        loaded_consistently(prefix)
        shutil.rmtree(folder)

    check_property(st.tuples(st.sampled_from(IDX_DTYPES), IDX_MUTATIONS), check, examples)


def index_paths(value, prefix=()):
    """Every key path in a JSON value (dict keys and list indices), the value's own () first."""
    yield prefix
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from index_paths(inner, prefix + (key,))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from index_paths(inner, prefix + (i,))


def mutated_index(index, path, how, value):
    """`index` with the entry at `path` replaced by `value` or deleted; the whole of it for ()."""
    if not path:
        return value
    result = json.loads(json.dumps(index))
    parent = result
    for key in path[:-1]:
        parent = parent[key]
    if how == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return result


@pytest.mark.parametrize("examples", BUDGETS)
def test_mutated_dataset_indexes_load_consistently_or_are_refused(tmp_path, examples):
    base = tokens_dataset(tempfile.mkdtemp(dir=tmp_path))
    index, raw_bin = json.loads(open(base + ".json").read()), open(base + ".bin", "rb").read()
    paths = list(index_paths(index))
    edits = st.one_of(
        st.tuples(st.just("field"), st.tuples(st.sampled_from(paths), st.sampled_from(["replace", "delete"]),
                                              HOSTILE_VALUES)),
        st.tuples(st.just("text"), st.tuples(st.integers(0, 2 ** 12), st.binary(min_size=1, max_size=6))),
        st.tuples(st.just("bin"), st.tuples(st.floats(0, 2), st.binary(max_size=4))))

    def check(case):
        kind, (a, b, *c) = case
        prefix = os.path.join(tempfile.mkdtemp(dir=tmp_path), "t")
        text, data = json.dumps(index).encode(), raw_bin
        if kind == "field":
            text = json.dumps(mutated_index(index, a, b, c[0])).encode()
        elif kind == "text":
            text = text[:a % len(text)] + b + text[a % len(text) + len(b):]
        else:
            data = (raw_bin * 2)[:int(len(raw_bin) * a)] + b
        for suffix, raw in ((".json", text), (".bin", data)):
            with open(prefix + suffix, "wb") as f:
                f.write(raw)
        loaded_consistently(prefix)
        try:
            offsets = open_dataset(prefix).document_offsets
        except InputError:
            offsets = []
        assert all(type(o) is int for o in offsets), offsets          # a JSON true is not an offset
        shutil.rmtree(os.path.dirname(prefix))

    check_property(edits, check, examples)


JSONL_LINES = st.lists(
    st.builds(lambda t: json.dumps({"text": t}), st.text(max_size=8))
    | st.builds(json.dumps, HOSTILE_VALUES)
    | st.builds(lambda v: json.dumps({"text": v}), HOSTILE_VALUES)
    | st.text(alphabet=st.characters(blacklist_characters="\r\n"), max_size=10)
    | st.sampled_from(["", "   ", "[" * 5000, '{"text": "a"', '{"text": "\\ud800"}', "\ufeff{}"]),
    max_size=5)


@pytest.mark.parametrize("examples", BUDGETS)
def test_generated_jsonl_is_read_as_written_or_refused(tmp_path, examples):
    def check(lines):
        folder = tempfile.mkdtemp(dir=tmp_path)
        path = os.path.join(folder, "in.jsonl")
        with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write("".join(line + "\n" for line in lines))
        try:
            preprocess_megatron([path], os.path.join(folder, "out"))
        except InputError as error:
            one_sentence(error)
        else:
            texts = [json.loads(line)["text"] for line in lines if line.strip()]
            written = IndexedDataset(os.path.join(folder, "out_text_document"))
            assert [written[i].tolist() for i in range(len(written))] == [list(t.encode()) for t in texts if t]
            del written
        shutil.rmtree(folder)

    check_property(JSONL_LINES, check, examples)


def test_nan_and_inf_weights_are_refused_however_spelled(tmp_path):
    a = tokens_dataset(tmp_path)
    for word in ("NaN", "-inf", "Infinity", "1e999"):
        with pytest.raises(InputError) as error:
            parse_blend(f"{word} {a} 1 {a}")
        assert f"weight {word!r} is not a positive number" in one_sentence(error.value)
