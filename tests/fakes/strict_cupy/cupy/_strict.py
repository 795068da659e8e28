"""The strict stand-in's bookkeeping: what the host waited for, what it uploaded, which CUDA and
NCCL calls were made, and the calling thread's current device.

Counted kinds (``counters()``):

* ``sync``: the host waits for the device: ``.get()``, ``.item()``, ``.tolist()``, ``float()``,
  ``int()``, ``bool()``, ``complex()``, ``repr``/``str``/``format``, ``in``, pickling,
  ``cupy.asnumpy``, boolean-mask indexing (CuPy sizes the output on the host), ``nonzero`` and
  the functions built on it, ``Stream/Device/Event.synchronize()``.
* ``upload``: host memory copied to the device: ``cupy.asarray``/``cupy.array`` of host data,
  NumPy arrays or lists used as indices, ``ndarray.set``.
* ``query``: non-blocking polls: ``Event.done``, ``Stream.done``, ``cupy.cuda.get_elapsed_time``.
* ``download``: ``.get(blocking=False)`` (a copy the host does not wait for).

Each counted occurrence is also kept as a ``Record(kind, reason, where)``, ``where`` being
"file:line in function" of the first frame outside the stand-in, so a failing test can say where
its syncs come from (``report()``).

The CUDA/NCCL/fusion log (``events()``) holds one dict per call, in call order: ``{"what":
"nccl.allReduce", "stream": ptr, ...}``; see the modules that append to it for the fields.

The work the device would be asked to do (``launches()``, ``memory()``):

* a ``Launch(kind, name, where, op, fields)`` per kernel CuPy would launch: ``elementwise`` (an
  operator, a ufunc, a fill, a cast, a gather or scatter), ``reduction``, ``copy`` (an explicit
  copy, and ``hidden`` ones CuPy makes inside a call: ``fields["hidden"]`` says which),
  ``fused`` (one per ``cupy.fuse`` call), ``gemm`` (one per cuBLAS call, fields: routine, input
  and output dtypes, compute type, transposes, m/n/k, leading dimensions, batch), ``random``,
  ``memcpy`` (host to device), ``nccl`` (a collective or point-to-point call); views, reshapes
  that need no copy and ``empty`` launch nothing. ``op`` is the autograd Function whose
  ``forward`` or ``backward`` made the launch ("Linear.backward"), else ``where``'s function;
* allocations: how many, their bytes, and the peak of bytes live (``reset()`` starts the peak
  from what is live then).
"""
import collections
import contextlib
import os
import sys
import threading

#: The folder holding the stand-in's `cupy` and `cupyx` packages: frames under it are "inside".
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("sync", "upload", "query", "download")

Record = collections.namedtuple("Record", "kind reason where")
Launch = collections.namedtuple("Launch", "kind name where op fields")


class HostSyncError(AssertionError):
    """A counted host interaction inside `forbid(...)`: raised at the very call that made it."""


_counts = collections.Counter()
_records = collections.deque(maxlen=100_000)
_events = []
_launches = []
_memory = {"allocations": 0, "allocated_bytes": 0, "live_bytes": 0, "peak_bytes": 0}
_forbidden = collections.Counter()
_local = threading.local()


# --- where a call came from ----------------------------------------------------------------

def caller(skip=1):
    """'file:line in function' of the first frame outside the stand-in (the code under test)."""
    frame = sys._getframe(skip)
    inside = ROOT + os.sep
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame = frame.f_back
    if frame is None:
        return "<stand-in>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


# --- counting ------------------------------------------------------------------------------

def note(kind, reason):
    """Count one host interaction of `kind` ("sync", "upload", "query", "download")."""
    record = Record(kind, reason, caller(2))
    _counts[kind] += 1
    _records.append(record)
    if _forbidden[kind]:
        raise HostSyncError(f"host {kind} ({reason}) at {record.where}, inside "
                            f"cupy._strict.forbid({kind!r})")


def counters():
    """{"sync": n, "upload": n, "query": n, "download": n} since the last reset()."""
    return {kind: _counts[kind] for kind in KINDS}


def reasons(kind="sync"):
    """Counter of reasons ("get", "float", "mask_index", ...) for one kind."""
    return collections.Counter(r.reason for r in _records if r.kind == kind)


def records(kind=None):
    """The Record(kind, reason, where) list (all kinds, or one), oldest first."""
    return [r for r in _records if kind is None or r.kind == kind]


def report(kind="sync"):
    """A readable summary for assertion messages: count per (reason, where)."""
    grouped = collections.Counter((r.reason, r.where) for r in _records if r.kind == kind)
    lines = [f"{_counts[kind]} host {kind}(s):"]
    lines += [f"  {n} x {reason} at {where}" for (reason, where), n in grouped.most_common()]
    return "\n".join(lines)


@contextlib.contextmanager
def forbid(*kinds):
    """Raise HostSyncError at the first counted interaction of these kinds (default: sync)."""
    kinds = kinds or ("sync",)
    for kind in kinds:
        _forbidden[kind] += 1
    try:
        yield
    finally:
        for kind in kinds:
            _forbidden[kind] -= 1


@contextlib.contextmanager
def expect(**exact):
    """Assert exact counts inside the block, e.g. `with expect(sync=0, upload=1):`."""
    before = counters()
    start = len(_records)
    yield
    after = counters()
    for kind, n in exact.items():
        got = after[kind] - before[kind]
        if got != n:
            new = list(_records)[start:] if len(_records) >= start else list(_records)
            detail = "\n".join(f"  {r.reason} at {r.where}" for r in new if r.kind == kind)
            raise AssertionError(f"expected {n} host {kind}(s), got {got}:\n{detail}")


# --- kernel launches and allocations -------------------------------------------------------

def launch(kind, name, **fields):
    """Record one kernel launch (or cuBLAS / NCCL call, or host-to-device copy)."""
    where = caller(2)
    _launches.append(Launch(kind, name, where, operation(sys._getframe(1)) or where.rsplit(" in ", 1)[-1], fields))


def operation(frame):
    """The qualified name of the innermost Function.forward/backward on the stack, or None."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("forward", "backward") and "." in getattr(code, "co_qualname", ""):
            return code.co_qualname
        frame = frame.f_back
    return None


def launches(kind=None):
    """The Launch records since the last reset(), oldest first (all kinds, or one)."""
    return [r for r in _launches if kind is None or r.kind == kind]


def allocated(nbytes):
    _memory["allocations"] += 1
    _memory["allocated_bytes"] += nbytes
    _memory["live_bytes"] += nbytes
    _memory["peak_bytes"] = max(_memory["peak_bytes"], _memory["live_bytes"])


def freed(nbytes):
    _memory["live_bytes"] -= nbytes


def memory():
    """{"allocations", "allocated_bytes", "live_bytes", "peak_bytes"} since the last reset()."""
    return dict(_memory)


# --- the CUDA / NCCL / fusion call log -----------------------------------------------------

def log_event(what, **fields):
    """Append one call to the log (`what` is e.g. "stream.wait_event", "nccl.send")."""
    entry = {"what": what, **fields}
    _events.append(entry)
    return entry


def events(prefix=None):
    """The logged calls, oldest first; with `prefix`, only those whose "what" starts with it."""
    return [e for e in _events if prefix is None or e["what"].startswith(prefix)]


def reset():
    """Clear counters, records, launches, allocation counts and the call log (the current
    device and streams, and the bytes live, are kept)."""
    _counts.clear()
    _records.clear()
    _events.clear()
    _launches.clear()
    _memory.update(allocations=0, allocated_bytes=0, peak_bytes=_memory["live_bytes"])


# --- devices -------------------------------------------------------------------------------

def device_count():
    """Visible devices: env STRICT_CUPY_DEVICES (default 8); "0"/"none" means no driver."""
    raw = os.environ.get("STRICT_CUPY_DEVICES", "8").strip().lower()
    if raw in ("", "0", "none"):
        return 0
    return int(raw)


def current_device():
    """The calling thread's current device (CuPy keeps it per thread; a new thread starts on 0)."""
    return getattr(_local, "device", 0)


def set_current_device(index):
    _local.device = index


def thread_state():
    """Per-thread mutable state (current streams, device/stream stacks, NCCL group depth)."""
    return _local
