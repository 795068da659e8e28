"""The CPU engine for elementwise chains: NumPy on blocks of rows, the blocks
shared among the budget's threads (autograd/threads.py).

NumPy releases the GIL inside its ufunc loops and reductions and vectorises tanh and exp with
SIMD, so running the very same NumPy code on row blocks from a few threads both uses every core
and keeps a chain's temporaries in cache (a block is about BLOCK_ELEMENTS numbers). Measured on
the GeLU chain (2048 x 2048 float32, 2 cores): NumPy on the whole array 25-31 ms; this engine
15-16 ms; numexpr 62 ms and a numba `prange` kernel 48 ms, both slower because they evaluate tanh
one element at a time through libm. (Where a chain has no transcendental function and a row
reduction, numba wins instead: LayerNorm, in ops/_layer_norm_cpu.py.)

`each_share` runs a few tasks at once with BLAS held to one thread each: blockwise attention,
whose many small GEMMs scale better split by heads than threaded inside BLAS."""
import concurrent.futures
import threading

import numpy

from .threads import cpu_threads

#: Numbers per block for each array of a chain: ~256 KiB in float32, so a chain's inputs,
#: outputs and temporaries fit a core's L2 cache together.
BLOCK_ELEMENTS = 1 << 16
#: Below this many numbers one call on the whole array is as fast (no threads, no blocks).
MIN_BLOCKED_ELEMENTS = 1 << 18

#: What run_chain returns when a chain is better run once on the whole arrays.
WHOLE = object()

_pool, _pool_workers = None, 0
_inside = threading.local()


def _executor(workers):
    global _pool, _pool_workers
    if _pool is None or _pool_workers != workers:
        if _pool is not None:
            _pool.shutdown(wait=True)
        _pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="npmegatron-cpu")
        _pool_workers = workers
    return _pool


def row_blocks(rows, row_elements):
    """[(start, stop)] blocks of about BLOCK_ELEMENTS numbers covering rows [0, rows)."""
    step = max(1, BLOCK_ELEMENTS // max(1, row_elements))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def for_row_blocks(rows, row_elements, work):
    """work(start, stop) for blocks of rows covering [0, rows): on the calling thread for small
    work, else shared among cpu_threads() threads (the caller's included). work must only touch
    its own rows. The first exception raised by any block is raised here."""
    if rows * row_elements < MIN_BLOCKED_ELEMENTS or getattr(_inside, "busy", False):
        work(0, rows)
        return
    blocks = row_blocks(rows, row_elements)
    threads = min(cpu_threads(), len(blocks))

    def run_share(first):
        _inside.busy = True
        try:
            for start, stop in blocks[first::threads]:
                work(start, stop)
        finally:
            _inside.busy = False

    others = [_executor(threads - 1).submit(run_share, k) for k in range(1, threads)] if threads > 1 else []
    try:
        run_share(0)
    finally:
        for future in others:
            future.result()


def share_ranges(count, shares):
    """[(start, stop)]: [0, count) in at most `shares` nearly equal, non-empty parts."""
    shares = max(1, min(shares, count))
    bounds = [count * i // shares for i in range(shares + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


_blas = None


def each_share(tasks):
    """Run the callables at once, one per thread (the caller's included), with BLAS held to one
    thread for the duration: for work made of many small GEMMs that each thread does its share of
    (blockwise attention). One task runs on the caller with BLAS as it is."""
    global _blas
    if len(tasks) == 1:
        tasks[0]()
        return
    if _blas is None:
        from threadpoolctl import ThreadpoolController
        _blas = ThreadpoolController().select(user_api="blas")
    with _blas.limit(limits=1):
        others = [_executor(len(tasks) - 1).submit(_as_busy, task) for task in tasks[1:]]
        try:
            _as_busy(tasks[0])
        finally:
            for future in others:
                future.result()


def _as_busy(task):
    """A share runs its chains whole: the threads are already all in use."""
    _inside.busy = True
    try:
        task()
    finally:
        _inside.busy = False


def as_rows(array, rows):
    """The same buffer seen as (rows, -1), or None when that would need a copy."""
    try:
        view = array.view()
        view.shape = (rows, -1)          # raises instead of copying
    except AttributeError:
        return None
    return view


def split_rows(args):
    """How to cut a chain's arguments into row blocks: (full shape, [slicer per argument]) or None.

    Arrays of the chain's full shape are cut by rows; arrays broadcast over the rows (a bias of
    shape (cols,)) are passed whole; arrays of one number per row (shape (..., 1)) are cut too."""
    arrays = [a for a in args if isinstance(a, numpy.ndarray)]
    if not arrays:
        return None
    full = numpy.broadcast_shapes(*(a.shape for a in arrays))
    if len(full) < 2:
        return None
    rows, cols = int(numpy.prod(full[:-1])), full[-1]
    slicers = []
    for a in args:
        if not isinstance(a, numpy.ndarray) or a.ndim <= 1 or a.shape[:-1] == (1,) * (a.ndim - 1):
            slicers.append(None)                      # scalars and row-broadcast arrays: whole
            continue
        if a.shape[:-1] != full[:-1] or a.shape[-1] not in (1, cols):
            return None
        view = as_rows(a, rows)
        if view is None:
            return None
        slicers.append(view)
    return full, slicers


def run_chain(body, xp, args):
    """body(xp, *args) evaluated block by block on the budget's threads; WHOLE when the arrays are
    small or cannot be cut by rows (the caller then runs the body once on the whole arrays)."""
    if max((a.size for a in args if isinstance(a, numpy.ndarray)), default=0) < MIN_BLOCKED_ELEMENTS:
        return WHOLE                      # the test that decides almost every small call, first
    plan = split_rows(args)
    if plan is None:
        return WHOLE
    full, slicers = plan
    rows, cols = int(numpy.prod(full[:-1])), full[-1]
    if rows * cols < MIN_BLOCKED_ELEMENTS:
        return WHOLE

    def block_args(start, stop):
        return [a if view is None else view[start:stop] for a, view in zip(args, slicers)]

    # The first block tells the outputs' number and dtypes; the rest fill them in parallel.
    first = row_blocks(rows, cols)[0]
    result = body(xp, *block_args(*first))
    single = not isinstance(result, tuple)
    results = () if result is None else ((result,) if single else result)
    # made in the full shape and filled through (rows, cols) views, so that what is returned owns its
    # memory (a pipeline stage frees its sent output, which must not be a view: exchange.deallocate)
    shaped = [numpy.empty(full, r.dtype) for r in results]
    outputs = [out.reshape(rows, cols) for out in shaped]
    for out, r in zip(outputs, results):
        out[first[0]:first[1]] = r

    def work(start, stop):
        start = max(start, first[1])
        if start >= stop:
            return
        block = body(xp, *block_args(start, stop))
        for out, r in zip(outputs, (block,) if single else (block or ())):
            out[start:stop] = r

    for_row_blocks(rows, cols, work)
    if result is None:
        return None
    return shaped[0] if single else tuple(shaped)
