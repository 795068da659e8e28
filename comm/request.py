"""A posted transfer: a point-to-point send or receive, or an asynchronous collective. Below both
p2p.py and collectives.py, which return it; its wait() records the call in the statistics."""
import time

from .stats import record


class Request:
    """A posted send or receive; wait() returns the received array (None for a send)."""

    def __init__(self, inner, op, group, nbytes, started_s=0.0, clock=None):
        self.inner, self.op, self.group, self.nbytes = inner, op, group, nbytes
        self.started_s = started_s          # seconds the call took to start, recorded with the wait
        self.clock = clock                  # NCCL: its events time the call instead (EventClock)
        self.done, self.value = False, None

    def test(self):
        """Give the transfer a chance to progress without blocking."""
        return self.done or bool(self.inner.test())

    def wait(self):
        if not self.done:
            start = time.perf_counter()
            self.value = self.inner.wait()
            seconds = self.started_s + time.perf_counter() - start
            record(self.op, self.group.name, self.nbytes, seconds if self.clock is None else self.clock)
            self.done = True
        return self.value
