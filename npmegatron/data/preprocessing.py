"""`npmegatron preprocess`: text files, folders and JSONL into token files, in npmegatron's format
(PREFIX.bin + PREFIX.json) or Megatron's (PREFIX.bin + PREFIX.idx, indexed.py, with the sidecar
PREFIX.npmegatron.json), as Megatron's tools/preprocess_data.py does; the documents are tokenized
on --workers processes by tokenizing.py. Named preprocessing.py so that `npmegatron.data.preprocess`
stays the function."""
import contextlib
import json
import os
import shutil

import numpy

from ..autograd import InputError
from . import indexed
from .datasets import INDEX_FORMAT, SIDECAR_FORMAT
from .tokenizer import ByteTokenizer, HFTokenizer, end_of_document_id
from .tokenizing import tokenized

JSONL_SUFFIXES = (".jsonl", ".json")


def input_files(inputs):
    """The files of `inputs`: files as given, folders walked in sorted order (hidden names skipped)."""
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
    """The output PREFIX names a file in a folder that exists (made here), so writing fails before
    any work."""
    folder = os.path.dirname(os.path.abspath(output_prefix))
    if output_prefix.endswith(os.sep) or os.path.isdir(output_prefix):
        raise InputError(f"--output {output_prefix} is a folder; give a file prefix inside it, e.g. "
                         f"{os.path.join(output_prefix, 'data')}")
    try:
        os.makedirs(folder, exist_ok=True)      # `--output data/x` makes data/, as a user expects
    except OSError as e:
        raise InputError(f"output folder {folder} cannot be created ({e.strerror}); choose another --output") from None


def is_jsonl(path):
    """Megatron's --input: a .jsonl (or .json) file of one JSON object per line."""
    return os.path.isfile(path) and path.lower().endswith(JSONL_SUFFIXES)


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


def preprocess(inputs, output_prefix, tokenizer_file=None, append_eod=False, workers=1):
    """Tokenize text files (folders are walked in sorted order; each file is a document) into
    PREFIX.bin and PREFIX.json, on `workers` processes (the files are the same for any number).
    Returns the index. Nothing is left half-written on failure."""
    tokenizer = HFTokenizer(tokenizer_file) if tokenizer_file else ByteTokenizer()
    eod = end_of_document_id(tokenizer, tokenizer_file) if append_eod else None
    files = input_files(inputs)
    _check_output(output_prefix)
    try:
        with tokenized(files, [None], tokenizer, tokenizer_file, eod, workers) as documents:
            index = _write_dataset(documents, output_prefix, tokenizer, tokenizer_file)
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


def preprocess_megatron(inputs, output_prefix, tokenizer_file=None, json_keys=(), append_eod=False, workers=1):
    """Tokenize into Megatron's PREFIX.bin + PREFIX.idx, with the sidecar PREFIX.npmegatron.json.
    JSONL inputs give one dataset per JSON key (default 'text'), named PREFIX_KEY_document as
    Megatron's preprocess_data.py names them; text files and folders give PREFIX, a file per
    document. `workers` processes tokenize (the files are the same for any number). Returns a
    summary per dataset; nothing is left half-written on failure."""
    tokenizer = HFTokenizer(tokenizer_file) if tokenizer_file else ByteTokenizer()
    eod = end_of_document_id(tokenizer, tokenizer_file) if append_eod else None
    files = input_files(inputs)
    _check_output(output_prefix)
    choose_output_format(inputs, "megatron", json_keys)     # refuses mixed inputs, keys for text
    keys = list(json_keys or ["text"]) if is_jsonl(inputs[0]) else [None]
    prefixes = {key: f"{output_prefix}_{key}_document" if key else output_prefix for key in keys}
    dtype = indexed.megatron_token_dtype(tokenizer.vocab_size)
    try:
        with contextlib.ExitStack() as stack:
            documents = stack.enter_context(tokenized(files, keys, tokenizer, tokenizer_file, eod, workers))
            writers = {key: stack.enter_context(indexed.IndexedDatasetWriter(prefix, dtype))
                       for key, prefix in prefixes.items()}
            for _, key, ids in documents:
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
