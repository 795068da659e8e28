"""A watcher beside a job whose ranks share one node: when a rank's process dies without the job
ending on purpose (SIGKILL, the out-of-memory killer, a crash), it says once which rank stopped and
the checkpoint a resume would start from, then makes sure every rank ends.

Why a process of its own: mpiexec (hydra) answers a rank's death by SIGKILLing every other rank's
process group within milliseconds (measured: 10-50 ms), so no rank lives to say anything. Rank 0
starts this watcher in a session of its own, outside those groups (ending.watch_processes):

    python -I -S sentinel.py LISTENER_FD RANK:PID ...

Each rank connects to the listening Unix socket once, says b"rank N\\n" and keeps the connection
for the life of its process. Its end is the first sign of the rank's death, at the moment mpiexec
sees it too: a process's files close before its last thread is gone, and a process id reports the
end only then, measured after ranks mpiexec had killed meanwhile. Other lines: b"hint TEXT\\n" (the
resume hint, ending.set_resume_hint), b"folder TIME PATH\\n" (the run's --save folder, whose
`latest`, once this run has written it after TIME, names the checkpoint,
ending.set_checkpoint_folder) and b"end\\n" (the rank ends the job on purpose: say nothing).
Process ids serve to know when every rank is gone (one that died before connecting included) and to
end ranks a launcher leaves running. Standard library only: it starts in milliseconds.
"""
import os
import select
import signal
import socket
import sys
import time

# A launcher that does not end the other ranks itself (hydra does, in milliseconds) leaves them
# waiting in a collective forever; after this long the watcher ends them.
END_SURVIVORS_AFTER_S = 5.0


def stopped_sentence(ranks, hint):
    """The one sentence for a rank whose process died; `ranks`: the ranks it may be (empty: not
    known, several: they had all ended before anyone could see which was first)."""
    ranks = sorted(ranks)
    who = ("a rank" if not ranks else f"rank {ranks[0]}" if len(ranks) == 1 else
           f"one of ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}")
    return (f"{who} stopped (its process died: killed, out of memory or crashed), so the job is "
            f"ending" + (f"; {hint}" if hint else ""))


class Watch:
    def __init__(self, listener, ranks):
        """listener: the listening socket; ranks: {pid: rank}."""
        self.poller, self.listener = select.poll(), listener
        self.poller.register(listener, select.POLLIN)
        self.connections = {}           # file descriptor -> [socket, rank or None, bytes not yet read]
        self.processes = {}             # pidfd -> rank
        for pid, rank in ranks.items():
            try:
                handle = os.pidfd_open(pid)
            except ProcessLookupError:
                handle = os.open(os.devnull, os.O_RDONLY)    # already gone: reads as ended at once
            self.processes[handle] = rank
            self.poller.register(handle, select.POLLIN)
        self.connected = set()          # ranks that said who they are
        self.hint, self.on_purpose, self.reported, self.deadline = "", False, False, None
        self.folder, self.since = None, None    # the run's --save folder and its start, once told

    def run(self):
        """Until every rank's process is gone."""
        while self.processes:
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic()) * 1000
            ready = [fd for fd, _ in self.poller.poll(timeout)]
            if not ready:               # past the deadline: the launcher leaves the others running
                for handle in self.processes:
                    _kill(handle)
                self.deadline = None
                continue
            ended = set()
            for fd in ready:            # every line first: an "end" decides how the ends read
                ended |= self._read(fd)
            if ended and not self.reported:
                self.reported = True
                if not self.on_purpose:
                    sys.stderr.write(f"error: {stopped_sentence(ended, self.resume_hint())}\n")
                    sys.stderr.flush()
                    self.deadline = time.monotonic() + END_SURVIVORS_AFTER_S

    def resume_hint(self):
        """The checkpoint a resume would start from: the save folder's `latest` where it names
        one, else the last hint line."""
        try:
            with open(os.path.join(self.folder, "latest")) as pointer:
                latest = pointer.read(64).strip()       # the saver writes "iter_NNNNNNN"
                if os.fstat(pointer.fileno()).st_mtime < self.since:
                    latest = ""                         # written before this run started
        except (OSError, TypeError, UnicodeDecodeError):
            latest = ""
        if not (latest.startswith("iter_") and latest[5:].isdigit()):
            latest = ""
        return f"resume with --load {self.folder} (latest: {latest})" if latest else self.hint

    def _read(self, fd):
        """Handle one ready descriptor; the ranks whose end it shows."""
        if fd == self.listener.fileno():
            connection, _ = self.listener.accept()
            self.connections[connection.fileno()] = [connection, None, b""]
            self.poller.register(connection, select.POLLIN)
            return set()
        if fd in self.processes:
            rank = self.processes.pop(fd)
            self.poller.unregister(fd)
            os.close(fd)
            return {rank} if rank not in self.connected else set()     # its connection tells
        entry = self.connections[fd]
        data = entry[0].recv(4096)
        lines = (entry[2] + data).split(b"\n")
        entry[2] = lines.pop()
        for line in lines:
            word, _, rest = line.decode(errors="replace").partition(" ")
            if word == "rank":
                entry[1] = int(rest)
                self.connected.add(entry[1])
            elif word == "hint":
                self.hint = rest
            elif word == "folder":
                since, _, self.folder = rest.partition(" ")
                self.since = float(since)
            elif word == "end":
                self.on_purpose = True
        if data:
            return set()
        self.poller.unregister(fd)
        del self.connections[fd]
        entry[0].close()
        return {entry[1]} if entry[1] is not None else set()


def _kill(handle):
    try:
        signal.pidfd_send_signal(handle, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv):
    listener = socket.socket(fileno=int(argv[0]))
    ranks = {}
    for pair in argv[1:]:
        rank, pid = pair.split(":")
        ranks[int(pid)] = int(rank)
    Watch(listener, ranks).run()


if __name__ == "__main__":
    main(sys.argv[1:])
