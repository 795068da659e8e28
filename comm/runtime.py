"""init(): MPI once, BLAS threads pinned, each rank bound to its GPU (where CuPy sees one), Ctrl-C
that ends every rank, and the ways a job ends on an error: when every rank hit it (a bad flag, a
bad checkpoint) rank 0 prints it and all exit 1 normally; when one rank hit it, that rank reports
and aborts the job instead of leaving a hang; when a rank's process died (SIGKILL, out of memory),
one sentence names it and the checkpoint to resume from (ending.py, sentinel.py).

Why pin: on a 2-core machine two ranks with default BLAS threading ran a matmul + all-reduce loop
80x slower than with one thread each (BLAS threads and MPI busy-polling fight for the cores).
"""
import os
import sys
import time
import traceback

from npmegatron.autograd.errors import InputError
from npmegatron.autograd.threads import set_cpu_threads

from . import backends, ending
from .group import Group
from .launch import launch_size
from .signals import install_interrupt_watchdog

# An error that every rank raises reaches every rank's handler within this window (ranks are at
# most seconds apart, even 8 ranks on 2 cores); past it, the ranks that did not raise are waiting
# in a collective that will never complete, so the job is aborted.
AGREE_WITHIN_S = 10.0
# Ranks other than 0 wait this long before reporting, so an error every rank shares (a bad flag)
# is printed once, by rank 0, whose abort ends the others first.
REPORT_GRACE_S = 2.0
# mpiexec forwards each rank's output asynchronously; aborting at once can lose the report.
OUTPUT_DRAIN_S = 0.5

_state = {}


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _throttle_polling_when_oversubscribed():
    """MPICH busy-polls; with more local ranks than cores it must yield (set before MPI starts)."""
    local = int(os.environ.get("MPI_LOCALNRANKS", "1"))
    if local > _cores():
        os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "true")


def init():
    """Initialise MPI (once), pin BLAS threads to cores / local ranks, bind this rank's GPU,
    install the abort hook; returns the world group."""
    if "world" in _state:
        return _state["world"]
    _throttle_polling_when_oversubscribed()
    # A rank reading a peer's memory (MPICH's single-copy path for large messages) just as that
    # peer is killed meets an error MPICH treats as fatal whatever the error handler: it prints
    # its error stack (15 lines) and aborts before Python runs again. Its last line alone says what
    # failed; the sentence naming the stopped rank is the sentinel's (ending.py).
    os.environ.setdefault("MPIR_CVAR_PRINT_ERROR_STACK", "0")
    if launch_size() > 1:
        install_interrupt_watchdog()
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    _state["local_size"], _state["local_rank"] = local.Get_size(), local.Get_rank()
    threads = max(1, _cores() // _state["local_size"])
    asked = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if asked and asked.isdigit() and 0 < int(asked) < threads:
        threads = int(asked)        # a smaller budget the launcher gave (bench scaling's baseline)
    _state["blas_limits"] = threadpool_limits(limits=threads, user_api="blas")
    _state["blas_threads"] = threads
    set_cpu_threads(threads)        # the CPU engine's threads follow the same per-rank budget
    _state["device"] = bind_device(_state["local_rank"])
    # Gathered here, where every local rank is present: gathered lazily at a rank's first GPU
    # call, it would hang whenever another local rank's next call is not on the GPU.
    _state["local_bus_ids"] = local.allgather(_bus_id(_state["device"]))
    backends.use_local_bus_ids(_state["local_bus_ids"])     # whether NCCL can serve these ranks
    if world.Get_size() > 1:
        sys.excepthook = _end_on_uncaught
        ending.watch_processes(world, local)
    # Only for agreeing on errors: a communicator of its own never matches a model collective.
    _state["errors"] = world.Dup()
    _state["world"] = Group("world", world, range(world.Get_size()))
    return _state["world"]


def bind_device(local_rank, cupy_module=None):
    """Make GPU local_rank % device_count this process's current device and return its index;
    None without CuPy or a visible CUDA device. Counting visible devices respects
    CUDA_VISIBLE_DEVICES and launchers that show each rank a single GPU (it is then device 0).
    Without this every rank of a node would run on device 0."""
    cupy = cupy_module
    if cupy is None:
        try:
            import cupy
        except ImportError:
            return None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        if count < 1:
            return None
        index = local_rank % count
        cupy.cuda.Device(index).use()
    except cupy.cuda.runtime.CUDARuntimeError:     # no driver, or no device
        return None
    return index


def _bus_id(device):
    """The PCI bus id of this rank's GPU (None without one): it names the physical GPU."""
    if device is None:
        return None
    import cupy
    return cupy.cuda.Device(device).pci_bus_id










def local_size():
    init()
    return _state["local_size"]


def local_rank():
    init()
    return _state["local_rank"]


def device_index():
    """The CUDA device this rank is bound to (an index among its visible ones), or None."""
    init()
    return _state["device"]


def local_bus_ids():
    """The PCI bus id of each local rank's GPU (None for a rank without one), in local-rank order."""
    init()
    return _state["local_bus_ids"]


def blas_threads():
    init()
    return _state["blas_threads"]






class RankStopped(InputError):
    """Another rank's process died: a sentence, not this rank's traceback."""


def _end_on_uncaught(exc_type, exc, tb):
    """sys.excepthook under mpirun; Python exits with status 1 after it returns."""
    stopped = ending.stopped_rank_sentence(exc)
    if stopped == "":
        os._exit(1)             # the sentinel names the rank; mpiexec ends the others
    if stopped:
        report_and_abort(RankStopped(stopped))
    if not isinstance(exc, InputError):
        report_and_abort(exc, tb)
    if reports_input_error(exc):
        sys.stderr.write(f"error: {exc}\n")


def every_rank_failed(within_s=AGREE_WITHIN_S):
    """Called by a rank that hit an error: True when every rank calls it within `within_s` (they
    all hit it, and can exit normally); otherwise False, and the caller should abort the job."""
    init()
    return ending.all_arrive(_state["errors"], within_s)


def reports_input_error(error):
    """Under mpirun, for a rank that raised `error` (bad input): when every rank raised it, True on
    rank 0 alone (it prints the sentence; then every rank exits 1 normally); when the others did
    not, this rank reports and aborts the job, since they wait in a collective."""
    if not every_rank_failed():
        report_and_abort(error)
    return _state["world"].rank == 0


def report_and_abort(exc, tb=None):
    """Print this rank's error once, each line prefixed by its rank, and abort the whole job.
    Bad input (InputError) is its one sentence; anything else its traceback."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    if rank != 0:
        time.sleep(REPORT_GRACE_S)
    if isinstance(exc, InputError):
        text = f"error: {exc}"
    else:
        text = "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.rstrip().splitlines()))
    sys.stderr.flush()
    time.sleep(OUTPUT_DRAIN_S)
    _abort()


def _abort():
    from mpi4py import MPI
    ending.end_on_purpose()
    MPI.COMM_WORLD.Abort(1)
    os._exit(1)     # Abort may return while the job is already being torn down: never fall through
