"""cupy.cuda.Stream / Event stand-ins, after CuPy's cupy/cuda/stream.pyx.

Array ops run when they are called, so for them streams and events only record: which stream
was current, which event was recorded on which stream, which stream waited on which event.
Tests read that from cupy._strict.events() ("stream.*", "event.*"). The exception is NCCL's
point-to-point on a stream other than the null stream: as on a GPU, a send or receive only
starts there (non-blocking MPI), and finishes when something waits for it: an event recorded
after it that is synchronized, queried or waited on by another stream, or the stream's own
synchronize (`pending`, below). A receive's data must be waited for before it is read, as on a
GPU; and a neighbour that blocks is not taken for a deadlock that a GPU would not have.

CuPy facts kept: the null stream has ptr 0 and device_id -1 (`Stream.null`); a new stream belongs
to the device current at its creation and `use()`/`with` on another device raise RuntimeError;
the current stream is per thread and per device; `Event.record(None)` records on the current
stream; `Event(interprocess=True)` needs `disable_timing=True`."""
import itertools
import weakref

from .. import _strict
from . import runtime

_next_ptr = itertools.count(0x7F00_0000_1000, 0x100)
#: ptr -> Stream, for the NCCL stand-in to learn a stream's device from the ptr it is given.
live_streams = weakref.WeakValueDictionary()
#: stream ptr -> the transfers started on it and not finished: [Transfer] (nccl.py adds them)
pending = {}


def finish(transfers, wait=True):
    """Finish the given transfers (wait for them, or only test them when wait=False); True when
    all are finished. Finished ones leave `pending`."""
    open_ = [t for t in transfers if not t.finished]
    if not open_:
        return True
    if not wait and not all(t.test() for t in open_):
        return False
    for t in open_:
        t.wait()
    for stream_transfers in pending.values():
        stream_transfers[:] = [t for t in stream_transfers if not t.finished]
    return True


class Stream:
    """A CUDA stream; `ptr` is a distinct fake handle (0 for the null stream)."""

    null = None
    ptds = None

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        if null:
            ptr, device_id = 0, -1
        elif ptds:
            ptr, device_id = 2, -1      # cudaStreamPerThread
        else:
            ptr, device_id = next(_next_ptr), runtime.getDevice()
        self.ptr, self.device_id, self.non_blocking = ptr, device_id, bool(non_blocking)
        live_streams[ptr] = self
        if not (null or ptds):
            _strict.log_event("stream.create", stream=ptr, device=device_id,
                              non_blocking=self.non_blocking)

    def __eq__(self, other):
        return isinstance(other, Stream) and self.ptr == other.ptr

    def __hash__(self):
        return self.ptr

    def __repr__(self):
        return f"<{type(self).__name__} {self.ptr} (device {self.device_id})>"

    def _check_device(self):
        current = runtime.getDevice()
        if self.device_id not in (-1, current):
            raise RuntimeError(f"The device that the stream is created on ({self.device_id}) "
                               f"does not match with the current device ({current})")
        return current

    def use(self):
        device = self._check_device()
        _current_streams()[device] = self
        _strict.log_event("stream.use", stream=self.ptr, device=device)
        return self

    def __enter__(self):
        device = self._check_device()
        streams = _current_streams()
        _stream_stack().append((device, streams.get(device, Stream.null)))
        streams[device] = self
        _strict.log_event("stream.enter", stream=self.ptr, device=device)
        return self

    def __exit__(self, *exc):
        device, previous = _stream_stack().pop()
        _current_streams()[device] = previous
        _strict.log_event("stream.exit", stream=self.ptr, device=device)

    @property
    def done(self):
        _strict.log_event("stream.query", stream=self.ptr)
        _strict.note("query", "stream.done")
        return finish(list(pending.get(self.ptr, ())), wait=False)

    def synchronize(self):
        _strict.log_event("stream.synchronize", stream=self.ptr)
        _strict.note("sync", "stream.synchronize")
        finish(list(pending.get(self.ptr, ())))

    def begin_capture(self, mode=None):
        """Capture the work launched on this stream (it must be current while it runs) into a
        graph instead of running it (cupy._strict: what capture refuses, how replay works)."""
        if self.ptr in (0, 2):
            raise RuntimeError("the null stream and the per-thread stream cannot capture")
        _strict.log_event("stream.begin_capture", stream=self.ptr)
        _strict.begin_capture(self.ptr, lambda: get_current_stream().ptr)

    def end_capture(self):
        from .graph import Graph
        work, launches, memory = _strict.end_capture()
        _strict.log_event("stream.end_capture", stream=self.ptr, launches=len(launches))
        return Graph(work, launches, memory, self)

    def is_capturing(self):
        return _strict.capturing()

    def record(self, event=None):
        if event is None:
            event = Event()
        event._recorded(self)
        return event

    def wait_event(self, event):
        if not isinstance(event, Event):
            raise TypeError(f"wait_event needs a cupy.cuda.Event, got {type(event).__name__}")
        _strict.log_event("stream.wait_event", stream=self.ptr, event=event.ptr,
                          recorded_on=event.recorded_on)
        _strict.stream_waited(self.ptr, event.recorded_on, event.recorded_in_capture)
        finish(event.after)     # array ops run now, so what they wait for must be done now


Stream.null = Stream(null=True)
Stream.ptds = Stream(ptds=True)


class Event:
    """A CUDA event; `recorded_on` is the ptr of the stream it was last recorded on (None
    before any record), which is what "stream S waited on E recorded on T" checks read."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        if interprocess and not disable_timing:
            raise ValueError("Timing must be disabled for interprocess events")
        runtime.getDeviceCount()
        self.ptr = next(_next_ptr)
        self.block, self.disable_timing = bool(block), bool(disable_timing)
        self.recorded_on = None
        self.recorded_in_capture = None
        self.after = []         # the transfers started on its stream before it was recorded
        _strict.log_event("event.create", event=self.ptr, disable_timing=self.disable_timing)

    def _recorded(self, stream):
        self.recorded_on = stream.ptr
        self.recorded_in_capture = _strict.capture_position()     # None outside a capture
        self.after = list(pending.get(stream.ptr, ()))
        _strict.log_event("event.record", event=self.ptr, stream=stream.ptr)

    def record(self, stream=None):
        self._recorded(get_current_stream() if stream is None else stream)

    @property
    def done(self):
        _strict.log_event("event.query", event=self.ptr)
        _strict.note("query", "event.done")
        return finish(self.after, wait=False)

    def synchronize(self):
        _strict.log_event("event.synchronize", event=self.ptr)
        _strict.note("sync", "event.synchronize")
        finish(self.after)


def get_elapsed_time(start_event, end_event):
    """0.0 ms; refused (as CUDA does) for events made with disable_timing=True or never recorded."""
    for event in (start_event, end_event):
        if event.disable_timing or event.recorded_on is None:
            raise runtime.CUDARuntimeError(400)
    _strict.note("query", "get_elapsed_time")
    return 0.0


def _current_streams():
    """{device: current stream} of the calling thread."""
    return _strict.thread_state().__dict__.setdefault("streams", {})


def _stream_stack():
    return _strict.thread_state().__dict__.setdefault("stream_stack", [])


def get_current_stream(device_id=-1):
    device = runtime.getDevice() if device_id == -1 else device_id
    return _current_streams().get(device, Stream.null)
