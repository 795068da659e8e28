"""Signals under mpirun: Ctrl-C on any rank ends every rank, SIGTERM too (what a scheduler sends
before it pre-empts a job), and with --exit-signal-handler SIGTERM asks for a clean stop instead.

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
from .ending import end_on_purpose, every_rank_interrupted, resume_hint
from .launch import launch_rank, tell_launcher_finalized

INTERRUPTED_EXIT_CODE = 130     # 128 + SIGINT, what a shell reports for Ctrl-C
TERMINATED_EXIT_CODE = 143      # 128 + SIGTERM
# mpiexec forwards Ctrl-C to every rank within milliseconds; a rank whose main thread holds the
# interpreter in a long computation answers later. Past this, only some ranks were interrupted.
AGREE_WITHIN_S = 2.0
# Before MPI is up, ranks other than 0 wait this long before reporting, so an interrupt that
# reached every rank is reported once, by rank 0, whose exit ends the others first.
REPORT_GRACE_S = 1.0

_installed = {}


def install_interrupt_watchdog():
    """Make SIGINT and SIGTERM end this rank at once, wherever the main thread is, each rank saying
    so once (SIGTERM's default would kill the rank, and the job would read as a rank that died).
    Call from the main thread."""
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    wake_reader, wake_writer = socket.socketpair()
    wake_writer.setblocking(False)
    signal.signal(signal.SIGINT, _note_only)          # the watchdog acts, not KeyboardInterrupt
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:     # not ExitSignal's (--exit-signal-handler)
        signal.signal(signal.SIGTERM, _note_only)
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
            _end_this_rank(signal.SIGINT)
        # SIGTERM ends the rank unless --exit-signal-handler took it (ExitSignal's handler)
        if signal.SIGTERM in woken_by and signal.getsignal(signal.SIGTERM) is _note_only:
            _end_this_rank(signal.SIGTERM)


def _end_this_rank(signum):
    """On the watchdog thread of a rank that got SIGINT or SIGTERM (see the module docstring)."""
    code = INTERRUPTED_EXIT_CODE if signum == signal.SIGINT else TERMINATED_EXIT_CODE
    rank = launch_rank()
    end_on_purpose()
    together = every_rank_interrupted(AGREE_WITHIN_S)
    if not together:                    # this rank alone (or MPI is not up): mpiexec ends the others
        if together is None and rank != 0:
            time.sleep(REPORT_GRACE_S)
        _say_ended(rank, signum)
        os._exit(code)
    tell_launcher_finalized()
    if rank == 0:
        _say_ended(rank, signum)
    # Exit together: a rank whose main thread still reads a peer's memory (MPICH's single-copy
    # path for large messages) when that peer has gone meets a fatal MPI error.
    every_rank_interrupted(AGREE_WITHIN_S)
    os._exit(code)


def _say_ended(rank, signum):
    """The one line: the signal, and (from the training loop, once it runs) where to resume."""
    hint = resume_hint()
    if signum == signal.SIGINT:
        line = "interrupted (SIGINT): ending every rank" + (f"; {hint}" if hint else "")
    else:
        line = ("terminated (SIGTERM): ending every rank" + (f"; {hint}" if hint else "")
                + "; with --exit-signal-handler a SIGTERM saves a checkpoint (with --save) and stops cleanly")
    sys.stderr.write(f"[rank {rank}] {line}\n")
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
        """The handler before, or the watchdog's where it was installed after this (a SIGTERM then
        ends every rank, as without the flag)."""
        watched = _installed and self.signum == signal.SIGTERM and self.previous == signal.SIG_DFL
        signal.signal(self.signum, _note_only if watched else self.previous)
