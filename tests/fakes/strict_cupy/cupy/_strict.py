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
  ``forward`` or ``backward`` made the launch ("Linear.backward"), else ``where``'s function.
  Every launch's fields hold ``read_bytes`` and ``written_bytes``, the device memory it reads and
  writes, from its operands' sizes (``traffic``): itemsize x elements of each distinct array read
  (or written), a view counting its own elements, not its base's, a broadcast operand (a stride
  of 0) its elements once, scalars nothing. Each launch site names what it reads and writes:
  an elementwise kernel its array operands and its outputs (an in-place operator reads and writes
  its left operand); a reduction its input and its result; a gather (``take``) the elements it
  gathers and the indices, a scatter or fill the elements it writes (a scatter-add also reads
  them) and the indices and values; a cast or copy its source and its result; a ``cupy.fuse``
  call the arguments its body reads and the arguments it writes (in-place operators, ``out=``,
  ``x[...] = v``) and the arrays it returns; a raw kernel (``_raw``) its ``const`` pointer
  arguments as read, the others as written, and those also as read when its twin's results
  depend on what they held before; a GEMM A and B (and C when beta is not 0) read, C written; a
  cuDNN graph its inputs read and outputs written (not its workspace); NCCL its send buffer read
  and its receive buffer written (a broadcast's root reads, the others write); a host-to-device
  copy the bytes it writes. A CUDA graph's launch (kind ``graph``) holds no bytes: its captured
  launches held them. An approximation of the traffic a GPU's kernels make: caches, an operand
  read twice in one kernel, or partial reads of a strided view are not modelled;
* allocations: how many, their bytes, and the peak of bytes live (``reset()`` starts the peak
  from what is live then).
"""
import collections
import contextlib
import cProfile
import ctypes
import functools
import os
import sys
import threading
import weakref

import numpy

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
    if _capture is not None:
        raise StreamCaptureError(f"host {kind} ({reason}) at {record.where} while stream {_capture.stream:#x} "
                                 "is capturing: CUDA refuses it (cudaErrorStreamCaptureUnsupported)")
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

def launch(kind, name, read=(), written=(), **fields):
    """Record one kernel launch (or cuBLAS / NCCL call, or host-to-device copy) that reads the
    arrays (or byte counts) in `read` and writes those in `written`; while a stream is capturing,
    into its graph (it must be the current stream); while a graph replays, nothing."""
    if getattr(_local, "replaying", False):
        return
    fields["read_bytes"], fields["written_bytes"] = traffic(read), traffic(written)
    where = caller(2)
    record = Launch(kind, name, where, operation(sys._getframe(1)) or where.rsplit(" in ", 1)[-1], fields)
    if _capture is not None:
        stream = fields["stream"] if fields.get("stream") is not None else _capture.current_stream()
        if stream not in _capture.members:
            raise StreamCaptureError(f"{kind} {name} at {where} runs on stream {stream:#x} while stream "
                                     f"{_capture.stream:#x} captures, and that stream has not joined the "
                                     "capture (by waiting on an event recorded in it): it would run outside "
                                     "the graph")
        _capture.launches.append(record)
        _capture.last_work[stream] = len(_capture.launches)
        return
    _launches.append(record)


def traffic(operands):
    """Device bytes of `operands`: cupy or NumPy arrays (each distinct one once: the same memory,
    shape, strides and dtype count once; an axis of stride 0 once, as a broadcast operand's
    elements are read once), byte counts given as ints; scalars and None count 0."""
    seen, total = set(), 0
    for x in operands:
        if isinstance(x, int) and not isinstance(x, bool):
            total += x
            continue
        a = getattr(x, "_a", x)
        if not isinstance(a, numpy.ndarray):
            continue
        key = (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)
        if key in seen:
            continue
        seen.add(key)
        elements = 1
        for n, stride in zip(a.shape, a.strides):
            if stride or n == 0:
                elements *= n
        total += elements * a.itemsize
    return total


@contextlib.contextmanager
def emulating():
    """Around the Python the stand-in runs in place of a kernel (a raw kernel's NumPy twin, a
    cupy.fuse body, which CuPy traces once and then serves from its cache): hidden from a cProfile
    profiler running, so that its counts are the host's calls a GPU run makes. Disabling cProfile
    counts the calls active then, once; they are not counted again when they return."""
    profiler = sys.getprofile()
    if not isinstance(profiler, cProfile.Profile):
        yield
        return
    profiler.disable()
    try:
        yield
    finally:
        profiler.enable()


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


def allocated(nbytes, root=None):
    """`nbytes` allocated from the pool set_allocator names. While a stream captures, CuPy's
    relaxed capture mode lets any pool allocate; but the default pool would give the graph's
    memory to other arrays once the capture ends while replays still write it, so a capture
    allocates from a stream-ordered pool or a pool of the graph's own (as PyTorch's graphs do),
    and that private pool, once it has served a capture, serves nothing outside one."""
    kind, pool = _allocator["kind"], _allocator["pool"]
    if _capture is not None and kind != "default":
        _capture.keep.append(root)      # memory allocated in a capture belongs to the graph
        if kind == "private":
            _capture.pools.add(pool)
    elif _capture is not None:
        raise StreamCaptureError(f"an allocation of {nbytes} bytes at {caller(2)} while a stream captures, from "
                                 "the default memory pool, which would hand the graph's memory to other arrays "
                                 "after the capture: capture with a pool of the graph's own, "
                                 "cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)")
    elif kind == "private" and pool in _graph_pools:
        raise StreamCaptureError(f"an allocation of {nbytes} bytes at {caller(2)} outside a capture from the pool "
                                 "a captured graph took its memory from: replays would write over it; once the capture "
                                 "ends, set back the allocator before it (cupy.cuda.get_allocator())")
    _memory["allocations"] += 1
    _memory["allocated_bytes"] += nbytes
    _memory["live_bytes"] += nbytes
    _memory["peak_bytes"] = max(_memory["peak_bytes"], _memory["live_bytes"])


def freed(nbytes, allocation=False):
    """`nbytes` of device memory freed; `allocation`: a whole allocation whose array died. While a
    stream captures with a stream-ordered pool, that free is cudaFreeAsync, which CUDA takes only
    for memory the capture allocated: the capture keeps those alive, so any other is refused."""
    _memory["live_bytes"] -= nbytes
    if allocation and _capture is not None and _allocator["kind"] == "stream_ordered":
        _capture.outside_frees.append(f"{nbytes} bytes at {caller(2)}")


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


# --- CUDA graphs: capture and replay (cupy.cuda.Stream.begin_capture / end_capture) ---------

class StreamCaptureError(RuntimeError):
    """What CUDA refuses while a stream captures: a host synchronisation, upload or read, an
    allocation outside a stream-ordered pool, or work on another stream."""


#: which pool allocations come from (cupy.cuda.set_allocator): kind "default", "stream_ordered"
#: (MemoryAsyncPool) or "private" (a MemoryPool of its own), and that pool's id
_allocator = {"kind": "default", "pool": None}
#: the private pools captures allocated from
_graph_pools = weakref.WeakSet()
_capture = None


class Capture:
    """A capture in progress: the device work each call did (to run again at replay) and the
    launches it made. Device memory is as it was before the capture once it ends (nothing ran)."""

    def __init__(self, stream, current_stream):
        self.stream, self.current_stream = stream, current_stream
        self.work, self.launches, self.keep = [], [], []
        self.outside_frees = []     # memory allocated before the capture and freed during it
        self.pools = set()          # the private pools it allocated from
        self.members = {stream}     # the capturing stream and those that joined it (fork)
        self.last_work = {}         # stream -> launches captured when its last work was
        self.joined = {}            # stream -> launches captured when the capturing stream last
                                    # waited on an event recorded on it (join)
        self.snapshot = _snapshot()

    def waited(self, stream, event_stream, recorded_at):
        """`stream` waited on an event recorded on `event_stream` when `recorded_at` launches were
        captured (None: before the capture): a fork brings `stream` into the capture, a wait of
        the capturing stream joins `event_stream` back."""
        if recorded_at is None or event_stream not in self.members:
            return
        self.members.add(stream)
        if stream == self.stream:
            self.joined[event_stream] = max(self.joined.get(event_stream, 0), recorded_at)

    def unjoined(self):
        return [s for s in self.members - {self.stream} if self.last_work.get(s, 0) > self.joined.get(s, 0)]


def begin_capture(stream, current_stream):
    global _capture
    if _capture is not None:
        raise StreamCaptureError("a stream is capturing already")
    _capture = Capture(stream, current_stream)


def end_capture():
    """The captured (work, launches, allocations kept alive); device memory as before the capture,
    the allocations made during it unset (0xA5 bytes), as a graph that has not run yet leaves them."""
    global _capture
    capture, _capture = _capture, None
    unjoined = capture.unjoined()
    if unjoined:
        last = [capture.launches[capture.last_work[s] - 1] for s in unjoined]
        raise StreamCaptureError(f"streams {[hex(s) for s in unjoined]} did work in the capture that the "
                                 f"capturing stream {capture.stream:#x} never waited for, the last of it "
                                 f"{[f'{r.kind} {r.name} at {r.where}' for r in last]} "
                                 "(cudaErrorStreamCaptureUnjoined)")
    if capture.outside_frees:
        raise StreamCaptureError(f"{len(capture.outside_frees)} allocations made before the capture were freed "
                                 f"during it, the first {capture.outside_frees[0]}: cudaFreeAsync in a capture "
                                 "takes only memory the capture allocated (cudaErrorInvalidValue); keep them "
                                 "alive until the capture ends")
    _graph_pools.update(capture.pools)
    for start, (root, saved) in capture.snapshot.items():
        if root() is not None:
            _bytes_at(start, saved.size)[...] = saved
    for start, entry in _live_buffers().items():
        if start not in capture.snapshot:
            _bytes_at(start, entry.nbytes)[...] = 0xA5
    return capture.work, capture.launches, capture.keep


def capturing():
    return _capture is not None


def refuse_cublas_in_capture():
    """What CuPy's cuBLAS bindings (and cupy.matmul / dot through them) do while a stream captures:
    its setStream raises."""
    if _capture is not None:
        raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")


def replaying():
    return getattr(_local, "replaying", False)


def capture_position():
    """How many launches the capture in progress holds, or None: what an event recorded now marks."""
    return None if _capture is None else len(_capture.launches)


def stream_waited(stream, event_stream, recorded_at):
    if _capture is not None:
        _capture.waited(stream, event_stream, recorded_at)


def replay(work):
    """Run a graph's captured work again: each call with the arguments it had (scalars as they were,
    arrays as they hold now), its results written into the arrays it returned at capture."""
    _launches.append(Launch("graph", "cudaGraphLaunch", caller(2), "graph.launch", {"calls": len(work)}))
    _local.replaying = True
    try:
        for fn, args, kwargs, result in work:
            _into(result, fn(*args, **kwargs))
    finally:
        _local.replaying = False


def _into(old, new):
    if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)):
        for o, n in zip(old, new):
            _into(o, n)
    elif old is not new and hasattr(old, "_a") and hasattr(new, "_a"):
        old._a[...] = new._a


def device_work(fn):
    """Mark a stand-in entry point that does device work: while a stream captures, the outermost
    such call that launched something is kept, to run again when the graph replays."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _capture is None or getattr(_local, "in_work", False):
            return fn(*args, **kwargs)
        before = len(_capture.launches)
        _local.in_work = True
        try:
            result = fn(*args, **kwargs)
        finally:
            _local.in_work = False
        if len(_capture.launches) > before:
            _capture.work.append((fn, args, kwargs, result))
        return result
    return call


def _live_buffers():
    from . import _core
    return {start: entry for start, entry in _core.buffers.items() if entry.root() is not None}


def _bytes_at(start, nbytes):
    return numpy.frombuffer((ctypes.c_ubyte * nbytes).from_address(start), numpy.uint8)


def _snapshot():
    return {start: (entry.root, _bytes_at(start, entry.nbytes).copy()) for start, entry in _live_buffers().items()}
