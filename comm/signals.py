"""Signals under mpirun: Ctrl-C on any rank ends every rank, and SIGTERM can ask for a clean stop.

Why a watchdog thread: mpiexec forwards Ctrl-C to every rank as SIGINT, but Python only runs a
signal handler between bytecodes, so a rank blocked in a collective never sees KeyboardInterrupt,
and a rank that does see it exits through MPI_Finalize, which waits for the blocked ones: the job
hangs. Here the C-level handler wakes a thread through a socket (signal.set_wakeup_fd, which works
while the main thread sits in MPI), and the thread exits the process without MPI_Finalize, which
makes mpiexec end every other rank at once.
"""
import os
import signal
import socket
import sys
import threading
import time

import numpy

from .collectives import all_reduce
from .launch import launch_rank

INTERRUPTED_EXIT_CODE = 130     # 128 + SIGINT, what a shell reports for Ctrl-C
# Ranks other than 0 wait this long before reporting, so an interrupt that reached every rank is
# reported once, by rank 0, whose exit ends the others first.
REPORT_GRACE_S = 1.0

_installed = {}


def install_interrupt_watchdog():
    """Make SIGINT end this rank at once, wherever the main thread is. Call from the main thread."""
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    wake_reader, wake_writer = socket.socketpair()
    wake_writer.setblocking(False)
    signal.signal(signal.SIGINT, _note_only)          # the watchdog acts, not KeyboardInterrupt
    signal.set_wakeup_fd(wake_writer.fileno(), warn_on_full_buffer=False)
    _installed.update(reader=wake_reader, writer=wake_writer)
    threading.Thread(target=_watch, args=(wake_reader,), name="npmegatron-interrupt-watchdog",
                     daemon=True).start()


def _note_only(signum, frame):
    """A Python-level handler must exist for the wakeup fd to be written; the work is _watch's."""


def _watch(reader):
    while True:
        woken_by = reader.recv(64)
        if not woken_by:
            return
        if signal.SIGINT in woken_by:       # other signals with Python handlers pass through here too
            _end_this_rank()


def _end_this_rank():
    rank = launch_rank()
    if rank != 0:
        time.sleep(REPORT_GRACE_S)
    sys.stderr.write(f"[rank {rank}] interrupted (SIGINT): ending every rank\n")
    sys.stderr.flush()
    os._exit(INTERRUPTED_EXIT_CODE)     # no MPI_Finalize: mpiexec then ends the other ranks


class ExitSignal:
    """Megatron's --exit-signal-handler: a signal (SIGTERM, what Slurm and Kubernetes send before
    a kill) is noted, not acted on; the training loop asks `received(group)` after each iteration
    and every rank learns that some rank got it, so all stop at the same iteration."""

    def __init__(self, signum=signal.SIGTERM):
        self.signum, self.seen = signum, False
        self.previous = signal.signal(signum, self._note)

    def _note(self, signum, frame):
        self.seen = True

    def received(self, group):
        """Collective over `group`: True on every rank when any rank has seen the signal."""
        return bool(all_reduce(numpy.array([int(self.seen)]), group, op="max")[0])

    @property
    def name(self):
        return signal.Signals(self.signum).name

    def restore(self):
        signal.signal(self.signum, self.previous)
