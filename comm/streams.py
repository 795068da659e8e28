"""What NCCL work queued on a CUDA stream leaves the host: a request that an event recorded after
the work completes (no stream or host waits until the result is used), and a clock of two events
around a call, since on a GPU the host only enqueues it."""


class StreamRequest:
    """NCCL work queued on a communication stream; `event`, recorded right after it, tells when
    it is done without synchronising any stream."""

    def __init__(self, result=None, keep=None, event=None, cuda=None):
        self.result, self.keep, self.event, self.cuda = result, keep, event, cuda

    def test(self):
        """True once the transfer finished (a query, not a wait): a send's buffer can then be
        freed (pipeline sends). False, without asking, while the compute stream captures a CUDA
        graph: an event recorded in a capture cannot be queried."""
        if (self.cuda is not None and self.cuda.get_current_stream().is_capturing()) or not self.event.done:
            return False
        self.keep = None
        return True

    def wait(self):
        """The result, usable by later work on the compute stream: that stream waits for the
        event; the host does not. A kept send buffer can go then: memory it frees is reused
        only by work queued on the compute stream, which now runs after the transfer."""
        self.cuda.get_current_stream().wait_event(self.event)
        self.keep = None
        return self.result


class EventClock:
    """A call's seconds on its stream, between timing events recorded around it: on a GPU the
    host only enqueues the call, so the host's clock would time the enqueueing. Read when the
    statistics are (comm/stats.py), which waits for this call's end event only, never for the
    whole device while other NCCL calls may still be waiting for their peers."""

    def __init__(self, cuda):
        self.cuda, self.begin, self.end, self.value = cuda, None, None, None
        self.ended = False      # known from a query: reading then waits for nothing

    def start(self, stream):
        self.begin = self.cuda.Event()
        self.begin.record(stream)

    def stop(self, stream):
        self.end = self.cuda.Event()
        self.end.record(stream)

    def ready(self):
        """True once the call ended (a query, no wait)."""
        self.ended = self.ended or self.value is not None or self.end.done
        return self.ended

    def seconds(self):
        if self.value is None:
            if not self.ended:
                self.end.synchronize()
            self.value = self.cuda.get_elapsed_time(self.begin, self.end) / 1000
            self.begin = self.end = None
        return self.value
