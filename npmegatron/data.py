"""Data: the embedded default corpus, `npmegatron preprocess` token files, tokenizers, and the
deterministic window sampler.

A preprocessed dataset is two files, as Megatron's indexed datasets and nanoGPT's train.bin:
PREFIX.bin, every document's tokens back to back in the narrowest unsigned type that holds the
vocabulary (uint8 for bytes, uint16, else uint32), read through a memory map; and PREFIX.json,
the index (token dtype, document boundaries, vocabulary size, tokenizer). A Hugging Face
tokenizer is copied beside them as PREFIX.tokenizer.json, so the dataset (and a checkpoint
trained on it) can decode text without the original file.
"""
import json
import os
import shutil
import sysconfig

import numpy

from .autograd import InputError

BYTE_VOCAB_SIZE = 256
INDEX_FORMAT = "npmegatron-tokens-1"
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


# ---- the embedded corpus ------------------------------------------------------------------------

def stdlib_python_files():
    """Sorted paths of the standard library's .py files (no third-party packages): the same
    machine always yields the same corpus, and nothing is downloaded or shipped."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]
        found.extend(os.path.join(folder, f) for f in files if f.endswith(".py"))
    return sorted(found, key=lambda p: os.path.relpath(p, root))


def load_default_corpus(validation_every=20):
    """(train, validation) byte arrays; every `validation_every`-th file goes to validation,
    so both splits cover the whole library and never share a file."""
    train, valid = [], []
    for i, path in enumerate(stdlib_python_files()):
        with open(path, "rb") as f:
            (valid if i % validation_every == validation_every - 1 else train).append(f.read())
    as_tokens = lambda parts: numpy.frombuffer(b"".join(parts), dtype=numpy.uint8)
    return as_tokens(train), as_tokens(valid)


# ---- tokenizers ---------------------------------------------------------------------------------

def utf8_bytes(text, what="the text"):
    """`text` as UTF-8. Python carries bytes that are not UTF-8 (in argv, or read with
    surrogateescape) as lone surrogates, which UTF-8 cannot encode."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InputError(f"{what} is not UTF-8 text ({text[error.start:error.end]!r} at character "
                         f"{error.start}); pass it as UTF-8") from None


class ByteTokenizer:
    """UTF-8 bytes are the tokens: vocabulary 256, nothing to download."""
    spec = {"type": "bytes"}
    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text):
        return list(utf8_bytes(text))

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer.json, through the `tokenizers` package (no network)."""

    def __init__(self, path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise InputError("a tokenizer.json needs the `tokenizers` package; install it with "
                             "pip install 'npmegatron[hf]'") from None
        if not os.path.isfile(path):
            raise InputError(f"tokenizer file {path} does not exist; pass a Hugging Face tokenizer.json")
        try:
            self.tokenizer = Tokenizer.from_file(path)
        except Exception as error:
            raise InputError(f"tokenizer file {path} could not be read ({error}); pass a Hugging "
                             "Face tokenizer.json") from None
        self.path = path
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.spec = {"type": "huggingface"}

    def encode(self, text):
        utf8_bytes(text)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tokenizer.decode([int(i) for i in ids])


def tokenizer_from_spec(spec, tokenizer_file=None):
    """The tokenizer an index or checkpoint describes; Hugging Face ones read `tokenizer_file`."""
    if spec.get("type") == "huggingface":
        return HFTokenizer(tokenizer_file)
    return ByteTokenizer()


# ---- preprocessing ------------------------------------------------------------------------------

def _input_files(inputs):
    files = []
    for item in inputs:
        if os.path.isdir(item):
            for folder, dirs, names in os.walk(item):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                files.extend(os.path.join(folder, n) for n in sorted(names) if not n.startswith("."))
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise InputError(f"input {item} does not exist; pass text files or folders of them")
    return files


def token_dtype(vocab_size):
    """The narrowest unsigned type that holds ids 0 .. vocab_size - 1."""
    return numpy.dtype("uint8" if vocab_size <= 2 ** 8 else "uint16" if vocab_size <= 2 ** 16 else "uint32")


def preprocess(inputs, output_prefix, tokenizer_file=None):
    """Tokenize text files (folders are walked in sorted order; each file is a document) into
    PREFIX.bin and PREFIX.json. Returns the index. Nothing is left half-written on failure."""
    tokenizer = HFTokenizer(tokenizer_file) if tokenizer_file else ByteTokenizer()
    files = _input_files(inputs)
    folder = os.path.dirname(os.path.abspath(output_prefix))
    if output_prefix.endswith(os.sep) or os.path.isdir(output_prefix):
        raise InputError(f"--output {output_prefix} is a folder; give a file prefix inside it, e.g. "
                         f"{os.path.join(output_prefix, 'data')}")
    if not os.path.isdir(folder):
        raise InputError(f"output folder {folder} does not exist; create it or choose another --output")
    try:
        index = _write_dataset(files, output_prefix, tokenizer, tokenizer_file)
    except OSError as e:
        raise InputError(f"{e.filename}: {e.strerror}; check that the inputs can be read and that "
                         f"--output {output_prefix} can be written") from None
    finally:
        for leftover in (output_prefix + ".bin.partial", output_prefix + ".json.partial"):
            if os.path.exists(leftover):
                os.remove(leftover)
    if index is None:
        raise InputError(f"no text found in {', '.join(inputs)}; pass non-empty text files")
    return index


def _write_dataset(files, output_prefix, tokenizer, tokenizer_file):
    """Write the .partial files, then rename both into place; the index, or None if no text."""
    dtype = token_dtype(tokenizer.vocab_size)
    offsets, sources = [0], []
    with open(output_prefix + ".bin.partial", "wb") as out:
        for path in files:
            with open(path, "rb") as f:
                raw = f.read()
            if isinstance(tokenizer, ByteTokenizer):
                ids = numpy.frombuffer(raw, numpy.uint8).astype(dtype)
            else:
                ids = numpy.asarray(tokenizer.encode(raw.decode("utf-8", errors="replace")), dtype)
            if ids.size:
                out.write(ids.tobytes())
                offsets.append(offsets[-1] + int(ids.size))
                sources.append(path)
    if offsets[-1] == 0:
        return None
    index = {"format": INDEX_FORMAT, "dtype": dtype.name, "num_tokens": offsets[-1],
             "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.spec,
             "document_offsets": offsets, "sources": sources}
    if tokenizer_file:
        shutil.copyfile(tokenizer_file, output_prefix + ".tokenizer.json")
    with open(output_prefix + ".json.partial", "w") as f:
        json.dump(index, f)
    os.replace(output_prefix + ".bin.partial", output_prefix + ".bin")
    os.replace(output_prefix + ".json.partial", output_prefix + ".json")
    return index


_INDEX_TYPES = {"format": (str, "a string"), "dtype": (str, "a string"), "num_tokens": (int, "an integer"),
                "vocab_size": (int, "an integer"), "tokenizer": (dict, "an object"),
                "document_offsets": (list, "a list")}


def check_index(index, path):
    """The token dtype of a loaded index, once every entry the reader relies on is present and
    consistent, so a foreign or hand-edited .json names its bad entry instead of a KeyError."""
    fix = "recreate it with `npmegatron preprocess`"
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise InputError(f"{path} is not an npmegatron dataset index; {fix}")
    for key, (kind, name) in _INDEX_TYPES.items():
        if key not in index:
            raise InputError(f"{path} has no {key!r} entry; {fix}")
        if not isinstance(index[key], kind) or isinstance(index[key], bool):
            raise InputError(f"{path}: {key!r} is {type(index[key]).__name__}, not {name}; {fix}")
    if index["dtype"] not in TOKEN_DTYPES:
        raise InputError(f"{path}: dtype {index['dtype']!r} is not one of {', '.join(TOKEN_DTYPES)}; {fix}")
    if index["vocab_size"] < 1:
        raise InputError(f"{path}: vocab_size {index['vocab_size']} is not positive; {fix}")
    if index["tokenizer"].get("type") not in ("bytes", "huggingface"):
        raise InputError(f"{path}: tokenizer type {index['tokenizer'].get('type')!r} is not 'bytes' or "
                         f"'huggingface'; {fix}")
    offsets = index["document_offsets"]
    if not (offsets and offsets[0] == 0 and offsets[-1] == index["num_tokens"]
            and all(isinstance(o, int) for o in offsets)
            and all(a <= b for a, b in zip(offsets, offsets[1:]))):
        raise InputError(f"{path}: document_offsets must be integers from 0, never decreasing, to "
                         f"num_tokens {index['num_tokens']}; {fix}")
    return numpy.dtype(index["dtype"])


class TokenDataset:
    """A preprocessed dataset: `tokens` is a read-only memory map of PREFIX.bin."""

    def __init__(self, prefix):
        for suffix in (".bin", ".json"):
            if prefix.endswith(suffix):
                prefix = prefix[:-len(suffix)]
        self.prefix = prefix
        bin_path, index_path = prefix + ".bin", prefix + ".json"
        missing = [p for p in (bin_path, index_path) if not os.path.isfile(p)]
        if missing:
            raise InputError(f"--data-path {prefix}: {' and '.join(missing)} not found; create the "
                             f"dataset with `npmegatron preprocess FILES --output {prefix}`")
        try:
            with open(index_path) as f:
                index = json.load(f)
        except ValueError:
            index = {}
        dtype = check_index(index, index_path)
        size = os.path.getsize(bin_path)
        if size == 0 or index["num_tokens"] == 0:
            raise InputError(f"--data-path {prefix}: {bin_path} is empty; preprocess some text into it")
        if size != index["num_tokens"] * dtype.itemsize:
            raise InputError(f"{bin_path} holds {size} bytes but its index expects "
                             f"{index['num_tokens'] * dtype.itemsize}; it is truncated or corrupt, "
                             "so preprocess the data again")
        self.index = index
        self.tokens = numpy.memmap(bin_path, dtype=dtype, mode="r")
        self.vocab_size = index["vocab_size"]
        self.tokenizer_file = prefix + ".tokenizer.json" if index["tokenizer"]["type"] != "bytes" else None

    def split(self, validation_fraction=0.05):
        """(train, validation) views: the last documents, about `validation_fraction` of the
        tokens (at least one document), are held out; one document alone is split at 95%."""
        offsets, total = self.index["document_offsets"], self.index["num_tokens"]
        cut = int(total * (1 - validation_fraction))
        if len(offsets) > 2:     # cut at the last document boundary at or before 95%
            cut = max([o for o in offsets[1:-1] if o <= cut], default=offsets[1])
        return self.tokens[:cut], self.tokens[cut:]

    def tokenizer(self):
        return tokenizer_from_spec(self.index["tokenizer"], self.tokenizer_file)


class TrainingData:
    """What a training run reads: training and validation token arrays, the vocabulary and the
    tokenizer, from --data-path or the embedded corpus."""

    def __init__(self, data_path=None):
        if data_path is None:
            self.train, self.valid = load_default_corpus()
            self.tokenizer, self.tokenizer_file = ByteTokenizer(), None
            self.description = "the embedded corpus"
        else:
            dataset = TokenDataset(data_path)
            self.train, self.valid = dataset.split()
            self.tokenizer, self.tokenizer_file = dataset.tokenizer(), dataset.tokenizer_file
            self.description = dataset.prefix
        self.vocab_size = self.tokenizer.vocab_size

    def validation_or_train(self, seq_length):
        """The held-out tokens, or the training tokens when too few are held out for a window."""
        if len(self.valid) > seq_length:
            return self.valid
        self.description += " (too little held out for one window: validating on training data)"
        return self.train


# ---- sampling -----------------------------------------------------------------------------------

class WindowSampler:
    """Training samples are the corpus cut into windows of seq_length + 1 tokens (neighbours
    share one token), visited in a fresh seeded permutation each epoch. Sample k of the run is a
    pure function of (seed, k), so the number of samples consumed is the whole sampler state
    that a checkpoint must keep, and any data-parallel rank can draw its own share."""

    def __init__(self, tokens, seq_length, seed):
        self.num_windows = (len(tokens) - 1) // seq_length
        if self.num_windows < 1:
            raise InputError(f"the data has {len(tokens)} tokens, too few for --seq-length "
                             f"{seq_length}; use a shorter sequence or more data")
        self.tokens, self.seq_length, self.seed = tokens, seq_length, seed
        self._epoch, self._order = None, None

    def _window(self, sample):
        epoch, position = divmod(sample, self.num_windows)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = numpy.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        return int(self._order[position])

    def batch(self, first_sample, count):
        """Samples first_sample .. first_sample + count - 1 as (inputs, targets), int64."""
        rows = numpy.empty((count, self.seq_length + 1), numpy.int64)
        for i in range(count):
            start = self._window(first_sample + i) * self.seq_length
            rows[i] = self.tokens[start:start + self.seq_length + 1]
        return rows[:, :-1], rows[:, 1:]
