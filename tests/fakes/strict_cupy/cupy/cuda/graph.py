"""cupy.cuda.graph.Graph stand-in: what Stream.end_capture returns; `launch(stream)` replays the
captured work (cupy._strict.replay) as one launch from the host's view."""
from .. import _strict


class Graph:
    def __init__(self, work, launches, memory, stream):
        # memory: the allocations made during the capture, which the graph owns (kept alive)
        self.work, self.launches, self.memory, self.stream = work, launches, memory, stream

    def launch(self, stream=None):
        """Run the captured work: every call again, on the buffers it used at capture."""
        _strict.log_event("graph.launch", stream=(stream or self.stream).ptr, calls=len(self.work))
        _strict.replay(self.work)

    def upload(self, stream=None):
        pass
