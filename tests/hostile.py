"""What the tests of hostile files share (issue 26): each reader is fuzzed by hypothesis with
mutations of a valid file, in a quick profile for `pytest -m "not slow"` and a thorough one for
the slow suite, and every file a reader opens is recorded so a test can prove that nothing
outside the folder it was given was touched."""
import contextlib
import os
import sys

import pytest
import safetensors
from hypothesis import HealthCheck, given, settings

# Examples per reader: the quick profile keeps each reader to a few seconds.
BUDGETS = [pytest.param(30, id="quick"), pytest.param(300, id="thorough", marks=pytest.mark.slow)]


def check_property(strategy, check, examples):
    """Run `check(value)` on `examples` values drawn from `strategy` (no example database, no
    deadline: a reader's first call may compile or import)."""
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def holds(value):
        check(value)
    holds()


class OpenedPaths:
    """The absolute paths opened since `recording()` began: Python's open() and os.open() (the
    'open' audit event) and safetensors' safe_open, whose file is opened by Rust code."""

    def __init__(self):
        self.paths, self.active = [], False
        sys.addaudithook(self._audit)       # hooks cannot be removed; inactive ones cost nothing

    def _audit(self, event, args):
        if self.active and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            self.paths.append(os.path.realpath(os.fsdecode(args[0])))

    def note(self, path):
        if self.active:
            self.paths.append(os.path.realpath(os.fsdecode(path)))

    @contextlib.contextmanager
    def recording(self):
        self.paths, self.active = [], True
        try:
            yield self
        finally:
            self.active = False

    def outside(self, folder):
        """The recorded paths that are not inside `folder`."""
        root = os.path.realpath(folder) + os.sep
        return [p for p in self.paths if not p.startswith(root)]


_opened = None


def opened_paths(monkeypatch, *modules_with_safe_open):
    """The process's OpenedPaths, with safe_open recorded too: the library's own (for code that
    imports it when called) and the name in each of `modules_with_safe_open`."""
    global _opened
    if _opened is None:
        _opened = OpenedPaths()
    for module in (safetensors,) + modules_with_safe_open:
        original = getattr(module, "safe_open", None)
        if original is None:
            continue

        def recorded(path, *args, _original=original, **kwargs):
            _opened.note(path)
            return _original(path, *args, **kwargs)
        monkeypatch.setattr(module, "safe_open", recorded)
    return _opened


def one_sentence(error):
    """An InputError's message is one sentence on one line."""
    text = str(error)
    assert text and "\n" not in text and "Traceback" not in text, text
    return text
