"""The embedded default corpus: the standard library's own .py files as byte tokens, what training
reads without --data-path; nothing is downloaded or shipped, and the same machine always gives the
same tokens."""
import os
import sysconfig

import numpy

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
