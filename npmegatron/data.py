"""Data: the embedded default corpus, `npmegatron preprocess` token files, tokenizers, Megatron's
indexed datasets and weighted blends, and the deterministic window samplers.

A preprocessed dataset is two files, as Megatron's indexed datasets and nanoGPT's train.bin:
PREFIX.bin, every document's tokens back to back in the narrowest unsigned type that holds the
vocabulary (uint8 for bytes, uint16, else uint32), read through a memory map; and PREFIX.json,
the index (token dtype, document boundaries, vocabulary size, tokenizer). A Hugging Face
tokenizer is copied beside them as PREFIX.tokenizer.json, so the dataset (and a checkpoint
trained on it) can decode text without the original file.

Megatron's own format (indexed_dataset.py: PREFIX.bin + PREFIX.idx) is written for JSONL input and
`--output-format megatron`. Its .idx says nothing of the vocabulary, so a small sidecar
PREFIX.npmegatron.json records it (and the tokenizer); data made by Megatron's preprocess_data.py
trains once its tokenizer.json is put beside it as PREFIX.tokenizer.json.
"""
import contextlib
import json
import math
import os
import re
import shutil
import sysconfig

import numpy

from . import indexed_dataset
from .autograd import InputError

BYTE_VOCAB_SIZE = 256
INDEX_FORMAT = "npmegatron-tokens-1"
SIDECAR_FORMAT = "npmegatron-megatron-sidecar-1"
END_OF_DOCUMENT = "<|endoftext|>"        # GPT-2's, and Megatron's GPT tokenizers' end-of-document token
JSONL_SUFFIXES = (".jsonl", ".json")
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
    eod_id = None                  # every byte is text: there is no id left for an end of document

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
        self.eod_id = self.tokenizer.token_to_id(END_OF_DOCUMENT)    # None when it has no such token

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


def _check_output(output_prefix):
    """The output PREFIX names a file in a folder that exists, so writing fails before any work."""
    folder = os.path.dirname(os.path.abspath(output_prefix))
    if output_prefix.endswith(os.sep) or os.path.isdir(output_prefix):
        raise InputError(f"--output {output_prefix} is a folder; give a file prefix inside it, e.g. "
                         f"{os.path.join(output_prefix, 'data')}")
    if not os.path.isdir(folder):
        raise InputError(f"output folder {folder} does not exist; create it or choose another --output")


def end_of_document_id(tokenizer, tokenizer_file):
    """The id --append-eod appends: the tokenizer's <|endoftext|>, GPT-2's and Megatron's choice."""
    if tokenizer.eod_id is not None:
        return tokenizer.eod_id
    if tokenizer_file is None:
        raise InputError(f"--append-eod needs an end-of-document token, which the byte-level tokenizer "
                         f"lacks (its 256 ids are all bytes); pass --tokenizer with a tokenizer.json that "
                         f"has {END_OF_DOCUMENT}, or drop --append-eod")
    raise InputError(f"--append-eod needs an end-of-document token, but tokenizer file {tokenizer_file} "
                     f"has no {END_OF_DOCUMENT}; use a tokenizer that has one, or drop --append-eod")


def encode_document(tokenizer, text, eod=None):
    """A document's token ids, with `eod` after a non-empty one as Megatron's preprocess_data.py
    does. Under the byte tokenizer, a file's bytes are its ids as they are (nothing decoded)."""
    if isinstance(tokenizer, ByteTokenizer):
        ids = numpy.frombuffer(text if isinstance(text, bytes) else utf8_bytes(text), numpy.uint8)
    else:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        ids = numpy.asarray(tokenizer.encode(text), numpy.int64)
    return numpy.append(ids, eod) if ids.size and eod is not None else ids


def is_jsonl(path):
    """Megatron's --input: a .jsonl (or .json) file of one JSON object per line."""
    return os.path.isfile(path) and path.lower().endswith(JSONL_SUFFIXES)


def _jsonl_records(path, keys):
    """(line number, object) of each line of a JSONL file that holds a string under every key;
    blank lines are skipped."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise InputError(f"{path} line {number} is not JSON ({error}); give one JSON object "
                                 "per line") from None
            if not isinstance(record, dict):
                raise InputError(f"{path} line {number} is a JSON {type(record).__name__}, not an "
                                 "object; give one JSON object per line")
            for key in keys:
                if not isinstance(record.get(key), str):
                    found = "no" if key not in record else f"a {type(record[key]).__name__} under the"
                    raise InputError(f"{path} line {number} has {found} {key!r} key, not text; pass "
                                     "--json-keys naming its text fields")
            yield number, record


def _documents(files, keys):
    """(source, key, text) of every document: each text file is one (key None), each JSONL
    line one per key."""
    for path in files:
        if keys == [None]:
            with open(path, "rb") as f:
                yield path, None, f.read()
        else:
            for number, record in _jsonl_records(path, keys):
                for key in keys:
                    yield f"{path} line {number}", key, record[key]


def _tokenized(files, keys, tokenizer, eod):
    """(source, key, ids) of every non-empty document; text that cannot be encoded names its place."""
    for source, key, text in _documents(files, keys):
        try:
            ids = encode_document(tokenizer, text, eod)
        except InputError as error:
            raise InputError(f"{source}: {error}") from None
        if ids.size:
            yield source, key, ids


def choose_output_format(inputs, output_format=None, json_keys=()):
    """'megatron' for JSONL input (Megatron's preprocess_data.py writes nothing else) or when
    asked; else 'npmegatron', the default for text. Mixed or contradictory asks are refused."""
    jsonl = [item for item in inputs if is_jsonl(item)]
    text = [item for item in inputs if item not in jsonl]
    if jsonl and text:
        raise InputError(f"inputs mix JSONL ({jsonl[0]}) and text ({text[0]}); preprocess them separately")
    if jsonl and output_format == "npmegatron":
        raise InputError("JSONL input is written in Megatron's format (PREFIX_KEY_document.bin/.idx); "
                         "drop --output-format npmegatron")
    if json_keys and not jsonl:
        raise InputError(f"--json-keys {' '.join(json_keys)} picks fields of JSONL input, but the inputs "
                         "are text files; pass .jsonl files or drop --json-keys")
    return "megatron" if jsonl or output_format == "megatron" else "npmegatron"


def preprocess(inputs, output_prefix, tokenizer_file=None, append_eod=False):
    """Tokenize text files (folders are walked in sorted order; each file is a document) into
    PREFIX.bin and PREFIX.json. Returns the index. Nothing is left half-written on failure."""
    tokenizer = HFTokenizer(tokenizer_file) if tokenizer_file else ByteTokenizer()
    eod = end_of_document_id(tokenizer, tokenizer_file) if append_eod else None
    files = _input_files(inputs)
    _check_output(output_prefix)
    try:
        index = _write_dataset(_tokenized(files, [None], tokenizer, eod), output_prefix, tokenizer,
                               tokenizer_file)
    except OSError as e:
        raise _unwritable(e, output_prefix) from None
    finally:
        for leftover in (output_prefix + ".bin.partial", output_prefix + ".json.partial"):
            if os.path.exists(leftover):
                os.remove(leftover)
    if index is None:
        raise InputError(f"no text found in {', '.join(inputs)}; pass non-empty text files")
    return index


def _unwritable(error, output_prefix):
    return InputError(f"{error.filename}: {error.strerror}; check that the inputs can be read and that "
                      f"--output {output_prefix} can be written")


def _remove_other_format(prefix, suffixes):
    """A dataset rewritten in one format drops the other format's index under the same PREFIX,
    which would otherwise describe the old PREFIX.bin."""
    for suffix in suffixes:
        if os.path.exists(prefix + suffix):
            os.remove(prefix + suffix)


def _write_dataset(documents, output_prefix, tokenizer, tokenizer_file):
    """Write the .partial files, then rename both into place; the index, or None if no text."""
    dtype = token_dtype(tokenizer.vocab_size)
    offsets, sources = [0], []
    with open(output_prefix + ".bin.partial", "wb") as out:
        for path, _, ids in documents:
            out.write(ids.astype(dtype).tobytes())
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
    _remove_other_format(output_prefix, (".idx", ".npmegatron.json"))
    return index


def preprocess_megatron(inputs, output_prefix, tokenizer_file=None, json_keys=(), append_eod=False):
    """Tokenize into Megatron's PREFIX.bin + PREFIX.idx, with the sidecar PREFIX.npmegatron.json.
    JSONL inputs give one dataset per JSON key (default 'text'), named PREFIX_KEY_document as
    Megatron's preprocess_data.py names them; text files and folders give PREFIX, a file per
    document. Returns a summary per dataset; nothing is left half-written on failure."""
    tokenizer = HFTokenizer(tokenizer_file) if tokenizer_file else ByteTokenizer()
    eod = end_of_document_id(tokenizer, tokenizer_file) if append_eod else None
    files = _input_files(inputs)
    _check_output(output_prefix)
    choose_output_format(inputs, "megatron", json_keys)     # refuses mixed inputs, keys for text
    keys = list(json_keys or ["text"]) if is_jsonl(inputs[0]) else [None]
    prefixes = {key: f"{output_prefix}_{key}_document" if key else output_prefix for key in keys}
    dtype = indexed_dataset.megatron_token_dtype(tokenizer.vocab_size)
    try:
        with contextlib.ExitStack() as stack:
            writers = {key: stack.enter_context(indexed_dataset.IndexedDatasetWriter(prefix, dtype))
                       for key, prefix in prefixes.items()}
            for _, key, ids in _tokenized(files, keys, tokenizer, eod):
                writers[key].add_document(ids)
            _commit_megatron(writers, inputs, tokenizer, tokenizer_file, eod)
    except OSError as e:
        raise _unwritable(e, output_prefix) from None
    return [{"prefix": w.prefix, "num_tokens": w.num_tokens, "num_documents": len(w.lengths),
             "dtype": dtype.name, "vocab_size": tokenizer.vocab_size} for w in writers.values()]


def _commit_megatron(writers, inputs, tokenizer, tokenizer_file, eod):
    """Once every dataset has text: the sidecar and tokenizer copy of each, then its .bin and .idx."""
    for key, writer in writers.items():
        if writer.num_tokens == 0:
            where = f" under key {key!r}" if key else ""
            raise InputError(f"no text found{where} in {', '.join(inputs)}; pass non-empty "
                             f"{'JSONL records' if key else 'text files'}")
    for writer in writers.values():
        if tokenizer_file:
            shutil.copyfile(tokenizer_file, writer.prefix + ".tokenizer.json")
        sidecar = {"format": SIDECAR_FORMAT, "vocab_size": tokenizer.vocab_size,
                   "tokenizer": tokenizer.spec, "eod_id": eod}
        with open(writer.prefix + ".npmegatron.json.partial", "w") as f:
            json.dump(sidecar, f)
        os.replace(writer.prefix + ".npmegatron.json.partial", writer.prefix + ".npmegatron.json")
        writer.commit()
        _remove_other_format(writer.prefix, (".json",))


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


class DocumentSplits:
    """The cuts of a dataset into training and validation tokens, the same for both formats;
    needs `tokens` and `document_offsets` (where each document starts, then the total)."""

    def split(self, validation_fraction=0.05):
        """(train, validation) views: the last documents, about `validation_fraction` of the
        tokens (at least one document), are held out; one document alone is split at 95%."""
        offsets, total = self.document_offsets, int(self.document_offsets[-1])
        cut = int(total * (1 - validation_fraction))
        if len(offsets) > 2:     # cut at the last document boundary at or before 95%
            cut = max([int(o) for o in offsets[1:-1] if o <= cut], default=int(offsets[1]))
        return self.tokens[:cut], self.tokens[cut:]

    def split_documents(self, proportions):
        """(train, validation, test) views by --split: whole documents, in order, in the given
        proportions (Megatron's rule, split_boundaries)."""
        bounds = split_boundaries(proportions, len(self.document_offsets) - 1)
        cuts = [int(self.document_offsets[b]) for b in bounds]
        return tuple(self.tokens[a:b] for a, b in zip(cuts, cuts[1:]))

    def tokenizer(self):
        return tokenizer_from_spec(self.spec, self.tokenizer_file)


def split_boundaries(proportions, count):
    """The 4 document numbers that start and end the train, validation and test parts of `count`
    documents, as Megatron's --split: each part gets round(proportion x count) documents, and the
    rounding's excess or shortfall is taken from the first part."""
    bounds = [0]
    for proportion in proportions:
        bounds.append(bounds[-1] + int(round(proportion * count)))
    excess = bounds[-1] - count
    return [0] + [min(count, max(0, b - excess)) for b in bounds[1:]]


class TokenDataset(DocumentSplits):
    """A preprocessed dataset: `tokens` is a read-only memory map of PREFIX.bin."""

    def __init__(self, prefix):
        for suffix in (".bin", ".json"):
            if prefix.endswith(suffix):
                prefix = prefix[:-len(suffix)]
        self.prefix = prefix
        bin_path, index_path = prefix + ".bin", prefix + ".json"
        missing = [p for p in (bin_path, index_path) if not os.path.isfile(p)]
        if missing:
            raise InputError(f"--data-path {prefix}: {' and '.join(missing)} not found (nor Megatron's "
                             f"{prefix}.idx); create the dataset with `npmegatron preprocess FILES "
                             f"--output {prefix}`")
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
        self.index, self.spec = index, index["tokenizer"]
        self.document_offsets = index["document_offsets"]
        self.tokens = numpy.memmap(bin_path, dtype=dtype, mode="r")
        self.vocab_size = index["vocab_size"]
        self.tokenizer_file = prefix + ".tokenizer.json" if index["tokenizer"]["type"] != "bytes" else None


class MegatronDataset(DocumentSplits):
    """A Megatron PREFIX.bin + PREFIX.idx (indexed_dataset.py) with its vocabulary and tokenizer:
    from the sidecar PREFIX.npmegatron.json written here, or from a PREFIX.tokenizer.json."""

    def __init__(self, prefix):
        data = indexed_dataset.IndexedDataset(prefix)
        if not numpy.issubdtype(data.dtype, numpy.integer):
            raise InputError(f"{prefix}.idx stores {data.dtype.name} values, but token ids are "
                             "integers; preprocess the text again")
        if data.tokens.size == 0:
            raise InputError(f"--data-path {prefix}: {prefix}.bin is empty; preprocess some text into it")
        self.prefix, self.tokens, self.document_offsets = prefix, data.tokens, data.document_offsets
        self.vocab_size, self.spec, self.tokenizer_file = self._vocabulary()

    def _vocabulary(self):
        """(vocabulary size, tokenizer spec, tokenizer file), since the .idx records none of them."""
        sidecar, tokenizer_file = self.prefix + ".npmegatron.json", self.prefix + ".tokenizer.json"
        if not os.path.isfile(sidecar):
            if not os.path.isfile(tokenizer_file):
                raise InputError(f"{self.prefix}.idx does not record its vocabulary, and neither {sidecar} "
                                 f"nor {tokenizer_file} is beside it; copy the tokenizer.json the data was "
                                 f"made with to {tokenizer_file}")
            vocab_size = HFTokenizer(tokenizer_file).vocab_size
            low, high = int(self.tokens.min()), int(self.tokens.max())
            if low < 0 or high >= vocab_size:
                raise InputError(f"{self.prefix}.bin holds token ids {low}..{high}, outside the vocabulary "
                                 f"of {tokenizer_file} ({vocab_size}); put the tokenizer the data was made "
                                 "with there")
            return vocab_size, {"type": "huggingface"}, tokenizer_file
        try:
            with open(sidecar) as f:
                info = json.load(f)
        except ValueError:
            info = None
        if not (isinstance(info, dict) and info.get("format") == SIDECAR_FORMAT
                and type(info.get("vocab_size")) is int and info["vocab_size"] >= 1
                and isinstance(info.get("tokenizer"), dict)
                and info["tokenizer"].get("type") in ("bytes", "huggingface")):
            raise InputError(f"{sidecar} is not an npmegatron sidecar (format {SIDECAR_FORMAT}, a positive "
                             f"vocab_size, a bytes or huggingface tokenizer); preprocess the data again")
        huggingface = info["tokenizer"]["type"] == "huggingface"
        return info["vocab_size"], info["tokenizer"], tokenizer_file if huggingface else None


def open_dataset(prefix):
    """The dataset at PREFIX in either format: Megatron's when PREFIX.idx exists, else npmegatron's."""
    for suffix in (".bin", ".idx", ".json"):
        if prefix.endswith(suffix) and not os.path.isfile(prefix + ".bin"):
            prefix = prefix[:-len(suffix)]
    if os.path.isfile(prefix + ".idx"):
        return MegatronDataset(prefix)
    return TokenDataset(prefix)


# ---- blends and splits --------------------------------------------------------------------------

BLEND_EXAMPLE = "e.g. '0.7 data/a 0.3 data/b'"


def _dataset_files_exist(path):
    return any(os.path.isfile(path + suffix) for suffix in ("", ".bin", ".idx", ".json"))


def parse_blend(data_path):
    """[(weight, prefix)] of --data-path, weights summing to 1: one PREFIX (weight 1), or
    Megatron's blend "W1 PREFIX1 W2 PREFIX2 ...". A single prefix with spaces in its name stays one."""
    words = data_path.split()
    if len(words) <= 1 or _dataset_files_exist(data_path):
        return [(1.0, data_path)]
    if len(words) % 2:
        raise InputError(f"--data-path {data_path!r} has {len(words)} words; a blend is weight and "
                         f"PREFIX pairs, {BLEND_EXAMPLE}")
    weights = []
    for word in words[0::2]:
        try:
            weight = float(word)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise InputError(f"--data-path blend weight {word!r} is not a positive number; a blend is "
                             f"weight and PREFIX pairs, {BLEND_EXAMPLE}")
        weights.append(weight)
    return [(w / sum(weights), prefix) for w, prefix in zip(weights, words[1::2])]


def parse_split(split):
    """Megatron's --split: up to three proportions (train, validation, test) separated by commas
    or slashes, normalised to sum 1; missing ones are 0 ("99,1" has no test part)."""
    problem = (f"--split {split!r} must be up to three proportions for train, validation and test, "
               "not negative and not all 0, e.g. 949,50,1")
    try:
        values = [float(part) for part in re.split(r"[,/]", split)]
    except ValueError:
        raise InputError(problem) from None
    if len(values) > 3 or not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0:
        raise InputError(problem)
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


class Blend:
    """One split of a --data-path blend: token arrays with weights (summing to 1) and names.
    Its length is all of their tokens, for the log; BlendedSampler draws from it."""

    def __init__(self, parts, weights, names):
        self.parts, self.weights, self.names = list(parts), list(weights), list(names)

    def __len__(self):
        return sum(len(p) for p in self.parts)

    def windows_of(self, seq_length):
        """The blend of the parts that hold a window of seq_length + 1 tokens, weights renormalised;
        None when no part does."""
        kept = [i for i, p in enumerate(self.parts) if len(p) > seq_length]
        if not kept:
            return None
        total = sum(self.weights[i] for i in kept)
        return Blend([self.parts[i] for i in kept], [self.weights[i] / total for i in kept],
                     [self.names[i] for i in kept])


def _same_tokenizer(datasets):
    """A blend's datasets share one vocabulary, or one model could not train on all of them."""
    first = datasets[0]
    for other in datasets[1:]:
        if (other.vocab_size, other.spec.get("type")) != (first.vocab_size, first.spec.get("type")):
            raise InputError(f"--data-path blends {first.prefix} ({first.spec['type']} tokenizer, vocabulary "
                             f"{first.vocab_size}) with {other.prefix} ({other.spec['type']} tokenizer, "
                             f"vocabulary {other.vocab_size}); preprocess them with the same --tokenizer")


class TrainingData:
    """What a training run reads: training and validation tokens (arrays, or Blends for a
    weighted --data-path), the vocabulary and the tokenizer, from --data-path or the embedded corpus.
    `split` is Megatron's --split; without it the last documents (about 5 %) are held out."""

    def __init__(self, data_path=None, split=None):
        if data_path is None:
            self.train, self.valid = load_default_corpus()
            self.tokenizer, self.tokenizer_file = ByteTokenizer(), None
            self.description = "the embedded corpus"
            self.vocab_size = self.tokenizer.vocab_size
            return
        blend = parse_blend(data_path)
        datasets = [open_dataset(prefix) for _, prefix in blend]
        _same_tokenizer(datasets)
        proportions = parse_split(split) if split else None
        parts = [d.split_documents(proportions)[:2] if proportions else d.split() for d in datasets]
        if len(datasets) == 1:
            (self.train, self.valid), self.description = parts[0], datasets[0].prefix
        else:
            weights, names = [w for w, _ in blend], [d.prefix for d in datasets]
            self.train = Blend([p[0] for p in parts], weights, names)
            self.valid = Blend([p[1] for p in parts], weights, names)
            self.description = "blend " + " + ".join(f"{w:.3g} x {n}" for w, n in zip(weights, names))
        if split:
            self.description += f" (--split {split})"
        self.tokenizer, self.tokenizer_file = datasets[0].tokenizer(), datasets[0].tokenizer_file
        self.vocab_size = datasets[0].vocab_size

    def validation_or_train(self, seq_length):
        """The held-out tokens, or the training tokens when too few are held out for a window."""
        valid = self.valid.windows_of(seq_length) if isinstance(self.valid, Blend) else (
            self.valid if len(self.valid) > seq_length else None)
        if valid is not None:
            return valid
        self.description += " (too little held out for one window: validating on training data)"
        return self.train

    def sampler(self, split, seq_length, seed):
        """The sampler of split 'train' or 'valid' (validation_or_train): a WindowSampler, or a
        BlendedSampler for a weighted --data-path."""
        tokens = self.train if split == "train" else self.validation_or_train(seq_length)
        return make_sampler(tokens, seq_length, seed)


# ---- sampling -----------------------------------------------------------------------------------

def make_sampler(tokens, seq_length, seed):
    """A BlendedSampler for a Blend, else a WindowSampler."""
    if isinstance(tokens, Blend):
        return BlendedSampler(tokens, seq_length, seed)
    return WindowSampler(tokens, seq_length, seed)


class WindowSampler:
    """Training samples are the corpus cut into windows of seq_length + 1 tokens (neighbours
    share one token), visited in a fresh seeded permutation each epoch. Sample k of the run is a
    pure function of (seed, k), so the number of samples consumed is the whole sampler state
    that a checkpoint must keep, and any data-parallel rank can draw its own share. `stream`
    gives each dataset of a blend its own permutations."""

    def __init__(self, tokens, seq_length, seed, stream=None):
        self.num_windows = (len(tokens) - 1) // seq_length
        if self.num_windows < 1:
            raise InputError(f"the data has {len(tokens)} tokens, too few for --seq-length "
                             f"{seq_length}; use a shorter sequence or more data")
        self.tokens, self.seq_length, self.seed = tokens, seq_length, seed
        self._key = [seed] if stream is None else [seed, stream]
        self._epoch, self._order = None, None

    def _window(self, sample):
        epoch, position = divmod(sample, self.num_windows)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = numpy.random.default_rng(self._key + [epoch]).permutation(self.num_windows)
        return int(self._order[position])

    def row(self, sample):
        """Sample `sample`'s seq_length + 1 tokens."""
        start = self._window(sample) * self.seq_length
        return self.tokens[start:start + self.seq_length + 1]

    def batch(self, first_sample, count):
        """Samples first_sample .. first_sample + count - 1 as (inputs, targets), int64."""
        rows = numpy.empty((count, self.seq_length + 1), numpy.int64)
        for i in range(count):
            rows[i] = self.row(first_sample + i)
        return rows[:, :-1], rows[:, 1:]


class BlendedSampler:
    """Samples of a weighted blend, as Megatron's BlendedDataset: sample i goes to the dataset
    furthest below its share, argmax over d of weight[d] * (i + 1) - count[d] (the first on ties),
    and is that dataset's count[d]-th sample of its own WindowSampler. Both are pure functions of
    (seed, i), as WindowSampler's samples are; the assignment is computed once, in growing blocks."""

    def __init__(self, blend, seq_length, seed):
        self.parts = []
        for d, (tokens, name) in enumerate(zip(blend.parts, blend.names)):
            try:
                self.parts.append(WindowSampler(tokens, seq_length, seed, stream=d))
            except InputError as error:
                raise InputError(f"{name}: {error}") from None
        self.weights, self.names, self.seq_length = blend.weights, blend.names, seq_length
        self.tokens = blend.parts[0]          # what a prompt is taken from (Trainer.sample)
        self.datasets = numpy.empty(0, numpy.int64)       # sample i's dataset ...
        self.positions = numpy.empty(0, numpy.int64)      # ... and its sample number there
        self._counts = [0] * len(self.parts)

    def assign(self, end):
        """Make sure samples 0 .. end - 1 are assigned (doubling, so a run costs O(samples))."""
        done = len(self.datasets)
        if end <= done:
            return
        end = max(end, 2 * done, 1024)
        datasets, positions = [], []
        counts, weights = self._counts, list(enumerate(self.weights))
        for i in range(done, end):         # plain Python lists: 4x faster than max(key=) or NumPy here
            chosen, furthest = 0, -math.inf
            for d, weight in weights:
                if weight * (i + 1) - counts[d] > furthest:
                    chosen, furthest = d, weight * (i + 1) - counts[d]
            datasets.append(chosen)
            positions.append(counts[chosen])
            counts[chosen] += 1
        self.datasets = numpy.concatenate([self.datasets, numpy.array(datasets, numpy.int64)])
        self.positions = numpy.concatenate([self.positions, numpy.array(positions, numpy.int64)])

    def batch(self, first_sample, count):
        """Samples first_sample .. first_sample + count - 1 as (inputs, targets), int64."""
        self.assign(first_sample + count)
        rows = numpy.empty((count, self.seq_length + 1), numpy.int64)
        for i in range(count):
            k = first_sample + i
            rows[i] = self.parts[self.datasets[k]].row(int(self.positions[k]))
        return rows[:, :-1], rows[:, 1:]
