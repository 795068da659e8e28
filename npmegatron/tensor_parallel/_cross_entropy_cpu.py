"""The vocabulary-parallel cross-entropy's passes over the logits on the CPU: each row's maximum,
then exp(z - max) written and summed while the row is still in cache, all in one read of the
logits; in backward the kept exponentials turned into scale * (softmax - one-hot) in place.

float32 logits take a numba kernel, rows shared among the CPU budget's threads: the maximum in
vector lanes, the exponentials by _vector_math's exp, their sum in float32 vector lanes. At GPT-2
124M's shape (1,024 tokens x 50,304 words, 2 cores) the forward takes 39 ms (35 ms of it the
kernel, the rest the new array's pages), where NumPy on blocks of rows in threads took 54 ms: a
max reduction over the logits, then for each row a subtraction, an exp and a sum as passes of
their own. The logits are 206 MB and the machine streams about 15 GB/s, so each read of them
costs about 13 ms. float64 (the equivalence tests' dtype) keeps NumPy's passes on blocks of rows
in threads (autograd/cpu_blocks.py). Backward's pass is NumPy's for both: it is bound by memory,
not arithmetic.

The formulas are those of cross_entropy.py's NumPy path; tests hold the two to round-off."""
import numba
import numpy

from ..autograd._vector_math import FAST, MAX_LANES, exp32, lane_max
from ..autograd.cpu_blocks import for_row_blocks
from ..autograd.threads import use_numba_threads

# "reassoc": a row's maximum and sum run in vector lanes (the sum's order is the compiler's).
_ROW = dict(FAST, fastmath={"contract", "reassoc"})


@numba.njit(**_ROW)
def _row_exponentials(row, kept_row):
    """kept_row = exp(row - max(row)); returns (max, sum of kept_row). A row of -inf (a shard
    without a likely word) is shifted by 0 instead: its exponentials and sum are 0, not NaN. A
    serial kernel for one row: called from the prange below, where numba's parallel lowering
    would leave its loops scalar if they were written there."""
    lanes = numpy.empty(MAX_LANES, row.dtype)
    m = lane_max(row, row.size, lanes)
    shift = m if m != -numpy.inf else numpy.float32(0.0)
    total = numpy.float32(0.0)
    for j in range(row.size):
        e = exp32(row[j] - shift)
        kept_row[j] = e
        total += e
    return m, total


@numba.njit(parallel=True, **FAST)
def _exponentials32(flat, real, kept, row_max, sums):
    for r in numba.prange(flat.shape[0]):
        row_max[r], sums[r] = _row_exponentials(flat[r, :real], kept[r])


def shifted_exponentials(flat, real):
    """(each row's maximum, exp(flat[:, :real] - that maximum) as a new array, each row's sum of
    it): one read of the logits, each row's second pass finding it in cache. A row whose maximum
    is -inf is shifted by 0 (exponentials and sum 0)."""
    rows = flat.shape[0]
    kept = numpy.empty((rows, real), flat.dtype)
    row_max, sums = numpy.empty(rows, flat.dtype), numpy.empty(rows, flat.dtype)
    if flat.dtype == numpy.float32:
        use_numba_threads()
        _exponentials32(flat, real, kept, row_max, sums)
        return row_max, kept, sums

    def work(start, stop):
        block = kept[start:stop]
        flat[start:stop, :real].max(axis=1, out=row_max[start:stop])
        shift = numpy.where(row_max[start:stop] == -numpy.inf, 0, row_max[start:stop])
        numpy.subtract(flat[start:stop, :real], shift[:, None], out=block)
        numpy.exp(block, out=block)
        block.sum(axis=1, out=sums[start:stop])

    for_row_blocks(rows, real, work)
    return row_max, kept, sums


def softmax_minus_one_hot_(kept, normaliser, target, mine, scale):
    """kept (exponentials) becomes scale * (kept * normaliser - one-hot(target)) in place, where
    kept * normaliser is the softmax; rows where `mine` is false have their target on another
    rank."""
    factor = scale * normaliser

    def work(start, stop):
        kept[start:stop] *= factor[start:stop, None]
        rows = numpy.arange(start, stop)[mine[start:stop]]
        kept[rows, target[rows]] -= scale[rows]

    for_row_blocks(kept.shape[0], kept.shape[1], work)
