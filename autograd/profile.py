"""Time per op: which Functions a step spends its time in (`npmegatron bench step --profile`).

Inside `with op_profile() as table:` every Function's forward (in Function.apply) and backward
(in the engine) is timed by its name: table[name] = [forward seconds, backward seconds, calls].
Off (the default) it costs one test of a module global per op. Host clock only: on a GPU the
times would be launch times, so bench step profiles on the CPU."""
import contextlib
import time

_table = None       # the active table, or None


@contextlib.contextmanager
def op_profile():
    global _table
    previous, _table = _table, {}
    try:
        yield _table
    finally:
        _table = previous


def active():
    return _table is not None


def timed(name, phase, call):
    """call() timed into the active table under `name` (phase 0: forward, 1: backward)."""
    table = _table
    start = time.perf_counter()
    try:
        return call()
    finally:
        entry = table.setdefault(name, [0.0, 0.0, 0])
        entry[phase] += time.perf_counter() - start
        entry[2] += phase == 0
