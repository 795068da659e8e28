"""A safetensors file from elsewhere is input (issue 26): its 8-byte header length, JSON header,
dtypes, shapes and data offsets are checked here against the file's real size before the
safetensors library is handed the file, so a file that lies is one sentence naming the file and
the lie, never a library exception or an allocation the file cannot back.

Layout (huggingface/safetensors): an unsigned little-endian 64-bit header length N, N bytes of
JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then
the data area, which the tensors' byte ranges cover end to end without gap or overlap.
"""
import json
import os

import numpy
from safetensors import SafetensorError, safe_open

from .autograd import InputError

MAX_HEADER = 100_000_000     # the library's own limit: no real header comes near it
ITEM_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
              "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def read_header(path, fix):
    """{tensor name: (dtype, shape, (begin, end))} of the safetensors file `path`, every entry
    checked against the file's size (the metadata entry left out). Each refusal reads "PATH
    cannot be read as safetensors: WHAT; FIX"."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            length = int.from_bytes(file.read(8), "little") if size >= 8 else None
            if length is not None and length <= min(size - 8, MAX_HEADER):
                text = file.read(length)
    except OSError as error:
        raise _lie(path, error.strerror, fix) from None
    if length is None:
        raise _lie(path, f"it holds {size} bytes, fewer than the 8-byte header length that opens the format", fix)
    if length > min(size - 8, MAX_HEADER):
        raise _lie(path, f"its header length is {length} bytes, but {size - 8} bytes follow and headers "
                         f"over {MAX_HEADER} bytes are refused", fix)
    header = _parse(text, path, fix)
    entries = {name: _entry(name, value, path, fix) for name, value in header.items() if name != "__metadata__"}
    metadata = header.get("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise _lie(path, f"its __metadata__ is {shown(metadata)}, but it must be an object of strings", fix)
    _check_coverage(entries, size - 8 - length, path, fix)
    return entries


def _parse(text, path, fix):
    """The header's JSON object; a name given twice is refused (json would keep the last)."""
    def no_repeats(pairs):
        seen = set()
        for name, _ in pairs:
            if name in seen:
                raise _lie(path, f"its header names {shown(name)} twice", fix)
            seen.add(name)
        return dict(pairs)
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=no_repeats)
    except InputError:                                # a name given twice: already one sentence
        raise
    except (ValueError, RecursionError) as error:     # UnicodeDecodeError is a ValueError
        raise _lie(path, f"its header is not valid JSON ({one_line(error)})", fix) from None
    if not isinstance(header, dict):
        raise _lie(path, f"its header is a JSON {type(header).__name__}, not an object", fix)
    return header


def _entry(name, value, path, fix):
    """(dtype, shape, (begin, end)) of one header entry, its byte range the size its shape needs."""
    tensor = f"tensor {shown(name)}"
    if not (isinstance(value, dict) and set(value) == {"dtype", "shape", "data_offsets"}):
        raise _lie(path, f"{tensor} has header entry {shown(value)}, but it must be an object of dtype, "
                         "shape and data_offsets", fix)
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not (isinstance(dtype, str) and dtype in ITEM_SIZES):
        raise _lie(path, f"{tensor} has dtype {shown(dtype)}, which is not a safetensors dtype", fix)
    if not (isinstance(shape, list) and all(_count(n) for n in shape)):
        raise _lie(path, f"{tensor} has shape {shown(shape)}, but a shape is a list of non-negative integers", fix)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))
            and offsets[0] <= offsets[1]):
        raise _lie(path, f"{tensor} has data_offsets {shown(offsets)}, but they must be [begin, end] with "
                         "0 <= begin <= end", fix)
    have = offsets[1] - offsets[0]
    needed = _bytes_needed(shape, ITEM_SIZES[dtype], have)
    if needed != have:
        raise _lie(path, f"{tensor} has data_offsets {offsets} ({have} bytes), but {dtype} of shape "
                         f"{shown(shape)} needs {needed if needed is not None else f'more than {have}'} bytes", fix)
    return dtype, tuple(shape), tuple(offsets)


def _check_coverage(entries, data_size, path, fix):
    """The byte ranges tile the data area: no overlap (two tensors sharing bytes), no gap, nothing
    past the end, nothing left over."""
    end = 0
    for name, (_, _, (begin, stop)) in sorted(entries.items(), key=lambda item: item[1][2]):
        if begin != end:
            lie = "overlaps the tensor before it" if begin < end else f"leaves bytes {end} to {begin} unused"
            raise _lie(path, f"tensor {shown(name)} has data_offsets [{begin}, {stop}], which {lie}", fix)
        end = stop
    if end != data_size:
        raise _lie(path, f"its tensors end at byte {end} of the data, but {data_size} data bytes follow the "
                         "header (truncated, or bytes appended)", fix)


def load(path, fix, entries):
    """{name: numpy array} of a safetensors file whose header read_header checked (`entries`).
    BF16 tensors, which NumPy has no dtype for, are widened to float32 exactly (a bfloat16 is the
    top half of a float32); the library's own refusal of anything else becomes one sentence."""
    try:
        with safe_open(path, framework="numpy") as file:
            return {name: (_bf16_as_float32(path, *entries[name][1:]) if entries[name][0] == "BF16"
                           else file.get_tensor(name)) for name in file.keys()}
    except (SafetensorError, OSError, ValueError, TypeError) as error:
        raise _lie(path, one_line(error), fix) from None


def _bf16_as_float32(path, shape, offsets):
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        file.seek(8 + length + offsets[0])
        raw = numpy.frombuffer(file.read(offsets[1] - offsets[0]), "<u2")
    return (raw.astype(numpy.uint32) << 16).view(numpy.float32).reshape(shape)


def _lie(path, what, fix):
    return InputError(f"{path} cannot be read as safetensors: {what}; {fix}")


def _bytes_needed(shape, item_size, limit):
    """The bytes a shape holds, or None once past `limit`: a long list of large sizes in a lying
    header would otherwise build an ever larger integer."""
    if 0 in shape:
        return 0
    total = item_size
    for n in shape:
        total *= n
        if total > limit:
            return None
    return total


def _count(value):
    """A JSON integer >= 0 (not a boolean, which Python counts as an int)."""
    return type(value) is int and value >= 0


def shown(value):
    """A value from a file, short and on one line, for a sentence."""
    return one_line(repr(value), 60)


def one_line(text, limit=120):
    """An error or a value from the file, on one line and short enough for a sentence."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
