"""Megatron-LM's memory-mapped indexed dataset: PREFIX.bin (every sequence's tokens back to back)
and PREFIX.idx (what Megatron core's `indexed_dataset.py` writes with `_IndexWriter` and reads with
`_IndexReader`), so data made by Megatron's `preprocess_data.py` trains here and the other way round.

The .idx layout, little-endian: the magic b"MMIDIDX\\x00\\x00"; version, uint64 = 1; the token dtype's
code, uint8 (DTYPE_CODES); the sequence count n and the document count m, uint64 each; then the
sequence lengths int32[n], the sequence pointers (byte offsets into .bin) int64[n], and the document
indices int64[m], sequence numbers where documents start, from 0 to n (GPT data: one sequence per
document, so 0, 1, ..., n).
"""
import os
import struct

import numpy

from ..autograd import InputError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")      # magic, version, dtype code, sequence count, document count
DTYPE_CODES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
               6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}
CODE_OF_DTYPE = {numpy.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}
REWRITE = ("write it again with Megatron's preprocess_data.py or `npmegatron preprocess "
           "--output-format megatron`")


def megatron_token_dtype(vocab_size):
    """Megatron's choice of token type: uint16 below a vocabulary of 65,500, else int32 (its
    `DType.optimal_dtype`), so files written here are the ones Megatron would write."""
    return numpy.dtype(numpy.uint16 if vocab_size < 65500 else numpy.int32)


# ---- writing ------------------------------------------------------------------------------------

class IndexedDatasetWriter:
    """Builds PREFIX.bin.partial and PREFIX.idx.partial one document at a time; `commit()` renames
    both into place. Leaving the `with` block without committing removes the partial files, so a
    failure never leaves a half-written dataset under the real names."""

    def __init__(self, prefix, dtype):
        self.prefix, self.dtype = prefix, numpy.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise InputError(f"token dtype {self.dtype} has no Megatron dtype code; use one of "
                             f"{', '.join(numpy.dtype(d).name for d in DTYPE_CODES.values())}")
        self.lengths, self.document_indices = [], [0]
        self._bin = None

    def __enter__(self):
        self._bin = open(self.prefix + ".bin.partial", "wb")
        return self

    def __exit__(self, *exc):
        self._bin.close()
        for leftover in (self.prefix + ".bin.partial", self.prefix + ".idx.partial"):
            if os.path.exists(leftover):
                os.remove(leftover)
        return None

    def add_document(self, ids):
        """One document as one sequence (GPT data); ids must fit the token dtype unchanged."""
        ids = numpy.asarray(ids)
        if ids.size and numpy.issubdtype(self.dtype, numpy.integer):
            info = numpy.iinfo(self.dtype)
            if ids.min() < info.min or ids.max() > info.max:
                raise InputError(f"token ids {ids.min()}..{ids.max()} do not fit {self.dtype.name} in "
                                 f"{self.prefix}.bin; write it with a wider dtype")
        self._bin.write(ids.astype(self.dtype).tobytes())
        self.lengths.append(int(ids.size))
        self.document_indices.append(len(self.lengths))

    @property
    def num_tokens(self):
        return sum(self.lengths)

    def commit(self):
        """Write the index, then rename .bin and .idx into place (the .idx last: a reader that
        finds the .idx finds the .bin that goes with it)."""
        self._bin.close()
        write_index(self.prefix + ".idx.partial", self.dtype, self.lengths, self.document_indices)
        os.replace(self.prefix + ".bin.partial", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.partial", self.prefix + ".idx")


def write_index(path, dtype, lengths, document_indices):
    """The .idx file for sequences of `lengths` tokens stored back to back in `dtype`."""
    lengths = numpy.asarray(lengths, numpy.int64)
    if lengths.size and lengths.max() > numpy.iinfo(numpy.int32).max:
        raise InputError(f"a sequence of {lengths.max()} tokens is longer than Megatron's int32 "
                         f"sequence lengths allow; split the document before writing {path}")
    pointers = numpy.concatenate([[0], numpy.cumsum(lengths)[:-1]]) * numpy.dtype(dtype).itemsize
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[numpy.dtype(dtype)], len(lengths),
                            len(document_indices)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(numpy.asarray(document_indices, "<i8").tobytes())


# ---- reading ------------------------------------------------------------------------------------

def read_index(path):
    """(dtype, sequence lengths, sequence pointers, document indices) of a .idx file, once its
    magic, version, dtype code and size agree with the format, each failure one sentence."""
    size = os.path.getsize(path)
    if size < HEADER.size:
        raise InputError(f"{path} holds {size} bytes, fewer than the {HEADER.size}-byte header of a "
                         f"Megatron index; it is truncated, so {REWRITE}")
    with open(path, "rb") as f:
        magic, version, code, count, documents = HEADER.unpack(f.read(HEADER.size))
    if magic != MAGIC:
        raise InputError(f"{path} starts with {magic!r}, not Megatron's magic {MAGIC!r}, so it is not "
                         f"a Megatron indexed-dataset index; {REWRITE}")
    if version != VERSION:
        raise InputError(f"{path} is index version {version}, but only version {VERSION} is "
                         f"supported; {REWRITE}")
    if code not in DTYPE_CODES:
        raise InputError(f"{path} has dtype code {code}, not one of Megatron's codes 1-8; {REWRITE}")
    expected = HEADER.size + 12 * count + 8 * documents
    if size != expected:
        raise InputError(f"{path} holds {size} bytes but its header promises {expected} ({count} "
                         f"sequences, {documents} documents); it is truncated or corrupt, so {REWRITE}")
    read = lambda dtype, n, offset: numpy.fromfile(path, dtype, n, offset=offset)
    lengths = read("<i4", count, HEADER.size)
    pointers = read("<i8", count, HEADER.size + 4 * count)
    document_indices = read("<i8", documents, HEADER.size + 12 * count)
    dtype = numpy.dtype(DTYPE_CODES[code])
    _check_index_arrays(path, dtype, lengths, pointers, document_indices)
    return dtype, lengths, pointers, document_indices


def _check_index_arrays(path, dtype, lengths, pointers, document_indices):
    """Sequences back to back from byte 0 and document indices rising from 0 to the sequence
    count: what lets the .bin be read as one token stream cut at document boundaries."""
    if (lengths < 0).any():
        raise InputError(f"{path} has negative sequence lengths; it is corrupt, so {REWRITE}")
    back_to_back = numpy.concatenate([[0], numpy.cumsum(lengths, dtype=numpy.int64)[:-1]]) * dtype.itemsize
    if not numpy.array_equal(pointers, back_to_back[:len(pointers)]):
        raise InputError(f"{path}: the sequence pointers are not the sequences back to back from byte "
                         f"0; it is corrupt or not a GPT dataset, so {REWRITE}")
    indices = document_indices
    if not (len(indices) and indices[0] == 0 and indices[-1] == len(lengths)
            and (numpy.diff(indices) >= 0).all()):
        raise InputError(f"{path}: the document indices must rise from 0 to the sequence count "
                         f"{len(lengths)}; it is corrupt, so {REWRITE}")


class IndexedDataset:
    """A Megatron PREFIX.bin + PREFIX.idx pair: `tokens` is a read-only memory map of the .bin,
    `dataset[i]` its i-th sequence, `document_offsets` the token offsets where documents start
    (and the total at the end)."""

    def __init__(self, prefix):
        self.prefix = prefix
        bin_path, idx_path = prefix + ".bin", prefix + ".idx"
        missing = [p for p in (bin_path, idx_path) if not os.path.isfile(p)]
        if missing:
            raise InputError(f"{' and '.join(missing)} not found; a Megatron dataset is a PREFIX.bin "
                             f"and PREFIX.idx pair, so {REWRITE}")
        self.dtype, self.lengths, self.pointers, self.document_indices = read_index(idx_path)
        starts = numpy.concatenate([[0], numpy.cumsum(self.lengths, dtype=numpy.int64)])
        expected, size = int(starts[-1]) * self.dtype.itemsize, os.path.getsize(bin_path)
        if size != expected:
            raise InputError(f"{bin_path} holds {size} bytes but {idx_path} expects {expected}; it is "
                             f"truncated or corrupt, so {REWRITE}")
        self.tokens = (numpy.memmap(bin_path, dtype=self.dtype, mode="r") if size
                       else numpy.empty(0, self.dtype))      # a zero-length file cannot be mapped
        self.sequence_starts = starts
        self.document_offsets = starts[self.document_indices]

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return self.tokens[self.sequence_starts[i]:self.sequence_starts[i + 1]]
