"""npmegatron.comm: the communication layer, over mpi4py (host arrays) and NCCL through CuPy
(GPU arrays), with one process grid, accounting of every call and a debug mode.

    from npmegatron import comm
    world = comm.init()
    grid = comm.ProcessGrid(tp=2, pp=1, dp=2)
    y = comm.all_reduce(x, grid.tp_group)
"""
from .collectives import (all_gather, all_reduce, all_reduce_async, all_to_all, all_to_all_v, barrier,
                          broadcast, reduce_scatter, reduce_scatter_async)
from .debug import CommMismatchError
from .ending import set_checkpoint_folder, set_resume_hint
from .grid import ProcessGrid, grid_coordinates, grid_ranks
from .group import Group
from .launch import blas_thread_environment, launch_rank, launch_size, launched_by_mpi, mpiexec_path
from .p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send, sendrecv, wait_all
from .request import Request
from .runtime import (blas_threads, device_index, init, local_rank, local_size, report_and_abort,
                      reports_input_error)
from .signals import ExitSignal
from .stats import Stats, Watch, reset_stats, stats, watch

__all__ = [
    "init", "launched_by_mpi", "launch_rank", "launch_size", "local_rank", "local_size",
    "blas_threads", "blas_thread_environment", "mpiexec_path", "device_index", "report_and_abort", "reports_input_error", "set_resume_hint", "set_checkpoint_folder",
    "ExitSignal",
    "Group", "ProcessGrid", "grid_ranks", "grid_coordinates",
    "all_reduce", "all_reduce_async", "all_gather", "reduce_scatter", "reduce_scatter_async", "broadcast",
    "all_to_all", "all_to_all_v", "barrier",
    "send", "recv", "isend", "irecv", "sendrecv", "batch_isend_irecv", "P2POp", "Request", "wait_all",
    "stats", "reset_stats", "Stats", "watch", "Watch", "CommMismatchError",
]
