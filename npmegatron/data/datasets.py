"""Token datasets as training reads them: npmegatron's PREFIX.bin + PREFIX.json (TokenDataset) and
Megatron's PREFIX.bin + PREFIX.idx (MegatronDataset), cut into train/validation/test by documents
as Megatron's --split; weighted --data-path blends; and TrainingData, what a run trains on."""
import json
import math
import os
import re

import numpy

from ..autograd import InputError
from . import indexed
from .corpus import load_default_corpus
from .sampling import Blend, make_sampler
from .tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer, HFTokenizer, tokenizer_from_spec

INDEX_FORMAT = "npmegatron-tokens-1"
SIDECAR_FORMAT = "npmegatron-megatron-sidecar-1"
TOKEN_DTYPES = ("uint8", "uint16", "uint32")


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
    _check_byte_vocabulary(path, index["vocab_size"], index["tokenizer"], fix)
    offsets = index["document_offsets"]
    if not (offsets and all(type(o) is int for o in offsets)      # not isinstance: a JSON true is an int there
            and offsets[0] == 0 and offsets[-1] == index["num_tokens"]
            and all(a <= b for a, b in zip(offsets, offsets[1:]))):
        raise InputError(f"{path}: document_offsets must be integers from 0, never decreasing, to "
                         f"num_tokens {index['num_tokens']}; {fix}")
    return numpy.dtype(index["dtype"])


def _check_byte_vocabulary(path, vocab_size, spec, fix):
    """Byte-level data has the byte tokenizer's 256 ids; another count would size the model's
    embedding to a vocabulary the data was not made with."""
    if spec["type"] == "bytes" and vocab_size != BYTE_VOCAB_SIZE:
        raise InputError(f"{path}: vocab_size {vocab_size} is not the byte tokenizer's {BYTE_VOCAB_SIZE}; {fix}")


def _check_token_ids(tokens, vocab_size, bin_path, source, fix):
    """Every token id names a row of the embedding: one past vocab_size would index out of it and a
    negative one would wrap round to another row silently. One vectorised pass at open, skipped
    when the token type cannot hold an id that large (bytes in uint8)."""
    unsigned = tokens.dtype.kind == "u"
    if tokens.size == 0 or (unsigned and numpy.iinfo(tokens.dtype).max < vocab_size):
        return
    high = int(tokens.max())
    low = 0 if unsigned and high < vocab_size else int(tokens.min())    # unsigned: min() only for the message
    if low < 0 or high >= vocab_size:
        raise InputError(f"{bin_path} holds token ids {low}..{high}, outside the vocabulary of {source} "
                         f"({vocab_size}); {fix}")


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
        """The tokenizer the data was made with, once it has the vocabulary the index records (the
        model's embedding is sized by the index, the text by the tokenizer)."""
        tokenizer = tokenizer_from_spec(self.spec, self.tokenizer_file)
        if tokenizer.vocab_size != self.vocab_size:
            raise InputError(f"{self.tokenizer_file} has a vocabulary of {tokenizer.vocab_size}, but the index "
                             f"of {self.prefix} records {self.vocab_size}; put the tokenizer the data was made "
                             "with there")
        return tokenizer


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
        except (ValueError, RecursionError):     # deep nesting exhausts the parser: as unreadable as bad JSON
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
        _check_token_ids(self.tokens, self.vocab_size, bin_path, index_path, "preprocess the data again")


class MegatronDataset(DocumentSplits):
    """A Megatron PREFIX.bin + PREFIX.idx (indexed.py) with its vocabulary and tokenizer:
    from the sidecar PREFIX.npmegatron.json written here, or from a PREFIX.tokenizer.json."""

    def __init__(self, prefix):
        data = indexed.IndexedDataset(prefix)
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
            _check_token_ids(self.tokens, vocab_size, self.prefix + ".bin", tokenizer_file,
                            "put the tokenizer the data was made with there")
            return vocab_size, {"type": "huggingface"}, tokenizer_file
        try:
            with open(sidecar) as f:
                info = json.load(f)
        except (ValueError, RecursionError):
            info = None
        if not (isinstance(info, dict) and info.get("format") == SIDECAR_FORMAT
                and type(info.get("vocab_size")) is int and info["vocab_size"] >= 1
                and isinstance(info.get("tokenizer"), dict)
                and info["tokenizer"].get("type") in ("bytes", "huggingface")):
            raise InputError(f"{sidecar} is not an npmegatron sidecar (format {SIDECAR_FORMAT}, a positive "
                             f"vocab_size, a bytes or huggingface tokenizer); preprocess the data again")
        _check_byte_vocabulary(sidecar, info["vocab_size"], info["tokenizer"], "preprocess the data again")
        _check_token_ids(self.tokens, info["vocab_size"], self.prefix + ".bin", sidecar, "preprocess the data again")
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
    shares = _shares(weights)
    if min(shares) == 0:          # so small beside the largest that its share underflows to 0
        small, large = words[2 * shares.index(0)], words[2 * weights.index(max(weights))]
        raise InputError(f"--data-path blend weight {small!r} is too small beside {large!r} to be drawn; "
                         f"give weights of similar size, {BLEND_EXAMPLE}")
    return list(zip(shares, words[1::2]))


def _shares(values):
    """`values` divided by their sum; by their largest first when that sum overflows to inf, so
    that 1e308 and 1e308 are halves, not zeros."""
    if math.isinf(sum(values)):
        values = [v / max(values) for v in values]
    return [v / sum(values) for v in values]


def parse_split(split):
    """Megatron's --split: up to three proportions (train, validation, test) separated by commas
    or slashes, normalised to sum 1; missing ones are 0 ("99,1" has no test part). The training
    part must be positive, or the run would have nothing to train on."""
    problem = (f"--split {split!r} must be up to three proportions for train, validation and test, "
               "not negative and not all 0, e.g. 949,50,1")
    try:
        values = [float(part) for part in re.split(r"[,/]", split)]
    except ValueError:
        raise InputError(problem) from None
    if len(values) > 3 or not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0:
        raise InputError(problem)
    shares = _shares(values + [0.0] * (3 - len(values)))
    if shares[0] == 0:
        raise InputError(f"--split {split!r} leaves nothing to train on; make its first (training) proportion "
                         "positive, e.g. 949,50,1")
    return shares

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
        self.test = None        # --split's third part, when it has one (npmegatron evaluate reads it)
        if data_path is None:
            self.train, self.valid = load_default_corpus()
            self.tokenizer, self.tokenizer_file = ByteTokenizer(), None
            self.description = "the embedded corpus"
            self.held_out = "every 20th file"
            self.vocab_size = self.tokenizer.vocab_size
            return
        blend = parse_blend(data_path)
        datasets = [open_dataset(prefix) for _, prefix in blend]
        _same_tokenizer(datasets)
        proportions = parse_split(split) if split else None
        parts = [d.split_documents(proportions) if proportions else d.split() + (None,) for d in datasets]
        if len(datasets) == 1:
            (self.train, self.valid, self.test), self.description = parts[0], datasets[0].prefix
        else:
            weights, names = [w for w, _ in blend], [d.prefix for d in datasets]
            self.train = Blend([p[0] for p in parts], weights, names)
            self.valid = Blend([p[1] for p in parts], weights, names)
            if proportions and proportions[2] > 0:
                self.test = Blend([p[2] for p in parts], weights, names)
            self.description = "blend " + " + ".join(f"{w:.3g} x {n}" for w, n in zip(weights, names))
        if split:
            self.description += f" (--split {split})"
        # whole documents are held out, so the share is near --split's (or 5 %), seldom equal
        self.held_out = "--split's validation documents" if split else "the last whole documents, near 5 %"
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
        """The sampler of split 'train', 'valid' (validation_or_train) or 'test' (None without a
        test part long enough for one window): a WindowSampler, or a BlendedSampler for a weighted
        --data-path."""
        if split == "test":
            test = self.test.windows_of(seq_length) if isinstance(self.test, Blend) else self.test
            if test is None or (not isinstance(test, Blend) and len(test) <= seq_length):
                return None
            return make_sampler(test, seq_length, seed)
        tokens = self.train if split == "train" else self.validation_or_train(seq_length)
        return make_sampler(tokens, seq_length, seed)
