"""Data: the embedded default corpus (the Python standard library's own .py files, byte-level)
and a deterministic sampler of fixed-length training windows."""
import os
import sysconfig

import numpy

BYTE_VOCAB_SIZE = 256
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


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


class WindowSampler:
    """Batches of (input, target) windows drawn at random starts; batch i depends only on
    (seed, i), so a run resumed at step i sees exactly what the uninterrupted run saw."""

    def __init__(self, tokens, seq_length, batch_size, seed):
        if len(tokens) <= seq_length + 1:
            from .autograd import InputError
            raise InputError(f"the corpus has {len(tokens)} tokens, too few for --seq-length "
                             f"{seq_length}; use a shorter sequence or more data")
        self.tokens, self.seq_length, self.batch_size, self.seed = tokens, seq_length, batch_size, seed

    def batch(self, index):
        rng = numpy.random.default_rng([self.seed, index])
        starts = rng.integers(0, len(self.tokens) - self.seq_length - 1, self.batch_size)
        window = numpy.arange(self.seq_length + 1)
        chunk = self.tokens[starts[:, None] + window].astype(numpy.int64)
        return chunk[:, :-1], chunk[:, 1:]
