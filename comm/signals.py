"""Signals under mpirun: Ctrl-C on any rank ends every rank, and SIGTERM can ask for a clean stop.

Why a watchdog thread: mpiexec forwards Ctrl-C to every rank as SIGINT, but Python only runs a
signal handler between bytecodes, so a rank blocked in a collective never sees KeyboardInterrupt,
and a rank that does see it exits through MPI_Finalize, which waits for the blocked ones: the job
hangs. Here the C-level handler wakes a thread through a socket (signal.set_wakeup_fd, which works
while the main thread sits in MPI), and the thread exits the process without MPI_Finalize.

Why each rank tells mpiexec it finalized before it exits: mpiexec (hydra) SIGKILLs the ranks
still running when one exits without finalizing, and reports a rank it killed as "BAD TERMINATION
... Killed (signal 9)", the job's status becoming 9 (measured: most Ctrl-Cs of 4 ranks). When every
rank got the SIGINT (mpiexec forwards Ctrl-C to all; the ranks agree on it within 2 s), each tells
hydra it ends on purpose (launch.tell_launcher_finalized), rank 0 prints the one line, and every
rank exits 130 by itself: the job's status is 130, nothing more. An interrupt that reached only
some ranks ends them as before, and mpiexec ends the others.
"""
import os
import signal
import socket
import sys
import threading
import time

import numpy

from .collectives import all_reduce
from .ending import end_on_purpose, every_rank_interrupted
from .launch import launch_rank, tell_launcher_finalized

INTERRUPTED_EXIT_CODE = 130     # 128 + SIGINT, what a shell reports for Ctrl-C
# mpiexec forwards Ctrl-C to every rank within milliseconds; a rank whose main thread holds the
# interpreter in a long computation answers later. Past this, only some ranks were interrupted.
AGREE_WITHIN_S = 2.0
# Before MPI is up, ranks other than 0 wait this long before reporting, so an interrupt that
# reached every rank is reported once, by rank 0, whose exit ends the others first.
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
    """On the watchdog thread of a rank that got SIGINT (see the module docstring)."""
    rank = launch_rank()
    end_on_purpose()
    together = every_rank_interrupted(AGREE_WITHIN_S)
    if not together:                    # this rank alone (or MPI is not up): mpiexec ends the others
        if together is None and rank != 0:
            time.sleep(REPORT_GRACE_S)
        _say_interrupted(rank)
        os._exit(INTERRUPTED_EXIT_CODE)
    tell_launcher_finalized()
    if rank == 0:
        _say_interrupted(rank)
    # Exit together: a rank whose main thread still reads a peer's memory (MPICH's single-copy
    # path for large messages) when that peer has gone meets a fatal MPI error.
    every_rank_interrupted(AGREE_WITHIN_S)
    os._exit(INTERRUPTED_EXIT_CODE)


def _say_interrupted(rank):
    sys.stderr.write(f"[rank {rank}] interrupted (SIGINT): ending every rank\n")
    sys.stderr.flush()


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
