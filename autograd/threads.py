"""How many threads CPU kernels may use: the same per-rank budget as BLAS.

`mpirun` ranks are given their share of the cores through the BLAS thread variables
(`comm.runtime.blas_thread_environment`), and `bench step --threads N` sets it with threadpoolctl;
the fused chains, the row-wise ops and the dropout hash follow that budget so that ranks never
oversubscribe the machine. The count is read from threadpoolctl once and can be set explicitly."""
import os

_threads = None


def blas_threads():
    """The BLAS library's thread count right now (threadpoolctl), or the visible cores."""
    from threadpoolctl import threadpool_info
    counts = [lib["num_threads"] for lib in threadpool_info() if lib.get("user_api") == "blas"]
    return max(counts) if counts else len(os.sched_getaffinity(0))


def cpu_threads():
    """Threads for this process's CPU kernels (read once from BLAS, unless set)."""
    global _threads
    if _threads is None:
        _threads = max(1, blas_threads())
    return _threads


def set_cpu_threads(count):
    """Set the budget (None: read it again from BLAS at next use); returns the previous value."""
    global _threads
    previous, _threads = _threads, (None if count is None else max(1, int(count)))
    return previous


def use_numba_threads():
    """Give numba's parallel kernels this budget (numba is imported by the caller's kernels)."""
    import numba
    numba.set_num_threads(min(cpu_threads(), numba.config.NUMBA_NUM_THREADS))
