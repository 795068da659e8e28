"""How a multi-rank job ends when it must: which rank's process stopped (and the sentinel that
says so, sentinel.py), the resume hint that sentence carries, a rank ending the job on purpose,
and the ranks' agreement on Ctrl-C (signals.py). runtime.init() fills it in under mpirun.
"""
import atexit
import os
import socket
import subprocess
import sys
import time
import uuid

from .sentinel import stopped_sentence

_job = {}


def watch_processes(world, local):
    """Collective over the world (mpi4py communicators; `local`: this node's ranks). Every rank
    learns its node's ranks' process ids (to name a rank that stopped); where the whole job is on
    this node, rank 0 starts the sentinel, which reports a rank whose process dies (sentinel.py
    says why no rank can), and every rank keeps a connection to it for life."""
    alone, listener = local.Get_size() == world.Get_size(), None
    if alone and world.Get_rank() == 0 and _pidfd_works():
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(f"\0npmegatron-{uuid.uuid4().hex}")      # abstract: nothing left on disk
        listener.listen(local.Get_size())
    peers = local.allgather((world.Get_rank(), os.getpid(), listener and listener.getsockname()))
    _job.update(local_pids={rank: pid for rank, pid, _ in peers}, one_node=alone,
                interrupts=world.Dup())     # a communicator of its own: never matches a model collective
    if listener is not None:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sentinel.py")
        _job["sentinel"] = subprocess.Popen(
            [sys.executable, "-I", "-S", script, str(listener.fileno())]
            + [f"{rank}:{pid}" for rank, pid, _ in peers], pass_fds=[listener.fileno()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        listener.close()
    if peers[0][2] is not None:
        lifeline = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lifeline.connect(peers[0][2])
            _job["lifeline"] = lifeline
            _tell(f"rank {world.Get_rank()}")
        except OSError:         # no sentinel after all: the job runs without it
            lifeline.close()
        set_resume_hint(resume_hint())
    atexit.register(end_on_purpose)      # registered after mpi4py's: runs before MPI_Finalize


def _pidfd_works():
    """Linux 5.3 and Python 3.9 or later: the sentinel waits on process file descriptors."""
    try:
        os.close(os.pidfd_open(os.getpid()))
        return True
    except (AttributeError, OSError):
        return False


def _tell(line):
    """One line to the sentinel, if this rank has one (lost if it has gone: nothing to tell)."""
    lifeline = _job.get("lifeline")
    if lifeline is None:
        return
    try:
        lifeline.sendall(line.replace("\n", " ").encode() + b"\n")
    except OSError:
        _job.pop("lifeline").close()


def set_resume_hint(text):
    """What to say about resuming if a rank stops (the trainer's `resume with --load DIR (latest:
    iter_N)`, updated after each save): no MPI, one short line from rank 0 to the sentinel."""
    _job["resume_hint"] = text
    if "sentinel" in _job:
        _tell(f"hint {text}")


def resume_hint():
    return _job.get("resume_hint", "")


def set_checkpoint_folder(path):
    """The folder the run saves into, told to the sentinel once with the time the run started:
    when it reports a rank that stopped, it reads the folder's `latest` itself if this run wrote
    it (not older than that time: another run's checkpoints, kept under --overwrite until the
    first save, or the later ones of a run resumed from an earlier iteration, are not this run's),
    so the sentence names the checkpoint on disk at that moment, not the last hint it read."""
    if path and "sentinel" in _job:
        _tell(f"folder {time.time():.6f} {path}")


def end_on_purpose():
    """This rank ends the job on purpose (its normal exit, a reported error, Ctrl-C): the sentinel
    must not report a rank that stopped. Rank 0 also ends the sentinel, which holds rank 0's
    stderr open: mpiexec would count the job running until it closes."""
    _tell("end")
    sentinel = _job.pop("sentinel", None)
    if sentinel is not None:
        sentinel.kill()
        sentinel.wait()


def process_gone(pid):
    """True once process `pid` has exited (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:         # no /proc: signal 0 tells whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False


def stopped_rank_sentence(error):
    """The one sentence for an MPI error that a stopped rank caused, else None: the rank of this
    node whose process is gone, or "a rank" for a communication failure when the job spans nodes;
    "" under the sentinel, which says it (end quietly: mpiexec ends the others)."""
    from mpi4py import MPI
    if not isinstance(error, MPI.Exception) or not _job:
        return None
    gone = sorted(rank for rank, pid in _job["local_pids"].items() if process_gone(pid))
    failed = getattr(MPI, "ERR_PROC_FAILED", MPI.ERR_OTHER)
    if not gone and (_job["one_node"] or error.Get_error_class() not in (MPI.ERR_OTHER, failed)):
        return None
    return "" if "lifeline" in _job else stopped_sentence(gone, resume_hint())


def every_rank_interrupted(within_s):
    """Called by each rank's interrupt watchdog (signals.py): True when every rank calls it within
    `within_s` (mpiexec forwarded Ctrl-C to all), False when not, None before MPI is up or after
    it has finished."""
    from mpi4py import MPI
    if "interrupts" not in _job or MPI.Is_finalized():
        return None
    return all_arrive(_job["interrupts"], within_s)


def all_arrive(mpi_comm, within_s):
    """A barrier over mpi_comm that gives up after within_s: True when every rank arrived."""
    request = mpi_comm.Ibarrier()
    deadline = time.monotonic() + within_s
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
