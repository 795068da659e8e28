"""What the launcher (mpiexec, mpirun) tells a process through its environment, read without
starting MPI: whether it was launched, its rank and the number of ranks; telling it this process
ends on purpose; and what a process to be launched needs (the mpiexec to use, its BLAS threads)."""
import os
import select
import shutil
import sys

from npmegatron.autograd.errors import InputError


def launched_by_mpi():
    """True inside an mpiexec/mpirun launch (MPICH's PMI or Open MPI's variables are set) or a
    Slurm job step started by srun (which MPI joins through Slurm's PMI)."""
    return (any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))
            or _srun_step())


def launch_rank():
    """This process's rank from the launcher's environment (0 outside mpirun), without MPI."""
    return _launch_variable(("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"), "SLURM_PROCID", 0)


def launch_size():
    """The number of ranks the launcher started (1 outside mpirun), without MPI."""
    return _launch_variable(("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"), "SLURM_STEP_NUM_TASKS", 1)


def _srun_step():
    """Inside a task srun started: SLURM_STEP_ID is set by srun only, not in the batch script
    itself (whose SLURM_PROCID is 0 and SLURM_NTASKS the allocation's, with no ranks started)."""
    return "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ


def _launch_variable(names, slurm_name, default):
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    if _srun_step() and slurm_name in os.environ:
        return int(os.environ[slurm_name])
    return default


def tell_launcher_finalized(timeout_s=1.0):
    """Tell MPICH's mpiexec (hydra) that this process ends on purpose, as MPI_Finalize does, for a
    process that exits without MPI_Finalize (its main thread may be blocked in MPI): hydra then
    lets the other ranks end by themselves instead of SIGKILLing them, which it reports as "BAD
    TERMINATION ... Killed (signal 9)". The simple PMI wire protocol on the socket hydra passes in
    PMI_FD: `cmd=finalize`, answered `cmd=finalize_ack`. True when acknowledged."""
    fd = os.environ.get("PMI_FD")
    if fd is None or not fd.isdigit():
        return False
    try:
        os.write(int(fd), b"cmd=finalize\n")
        ready, _, _ = select.select([int(fd)], [], [], timeout_s)
        return bool(ready) and os.read(int(fd), 1024).startswith(b"cmd=finalize_ack")
    except OSError:
        return False


def blas_thread_environment(threads):
    """The variables that give a process to be started `threads` BLAS threads."""
    return {name: str(threads) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def mpiexec_path():
    """The mpiexec beside this Python (the mpich wheel's), else the one on PATH."""
    path = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = path if os.path.exists(path) else shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise InputError("no mpiexec found; install the MPI extra (pip install 'npmegatron[mpi]') "
                         "or launch this command with your MPI's mpirun")
    return found
