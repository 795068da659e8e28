"""Dropout randomness: the streams of paper Appendix B.2, stateless.

Dropout outside tensor-parallel regions (embeddings, residual branches) draws from a stream
seeded the same on every TP rank, so replicated activations get identical masks; dropout inside
TP regions (attention probabilities of this rank's heads, and sequence shards under sequence
parallelism) draws from a stream seeded per TP rank (Megatron: seed + 2718 + tp_rank).

Every mask is a pure function of (stream seed, iteration, micro-batch, dropout site, element
index): number j of a draw is splitmix64 of (draw key + j * golden), and the draw key hashes the
stream's key with the iteration, the micro-batch and the site in turn. Integer array arithmetic
wraps the same way on NumPy and CuPy, so both draw bitwise the same masks; nothing depends on the
order of calls, so a resumed run or a recomputed layer replays its masks exactly, and what a
checkpoint needs is the iteration, which it already holds."""
import contextlib
import math

import numpy

from ..autograd import InputError
from ..autograd.fusion import fused

DEFAULT = "default"
MODEL_PARALLEL = "model-parallel"
MODEL_PARALLEL_SEED_OFFSET = 2718

_GOLDEN = 0x9E3779B97F4A7C15        # splitmix64's increment and finaliser (Steele et al., 2014)
_MIX_1, _MIX_2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK = 2 ** 64 - 1


def mix64(z, xp):
    """splitmix64's finaliser, in place on a uint64 array (wrapping arithmetic): a bijection that
    spreads every input bit over the output."""
    for shift, multiplier in ((30, _MIX_1), (27, _MIX_2)):
        z ^= z >> xp.uint64(shift)
        z *= xp.uint64(multiplier)
    z ^= z >> xp.uint64(31)
    return z


def mix64_int(z):
    """mix64 on one Python integer (keys are made on the host; under --cuda-graph, where the
    iteration is on the device, by device_draw_key)."""
    z = ((z ^ (z >> 30)) * _MIX_1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX_2) & _MASK
    return z ^ (z >> 31)


def draw_key(key, *words):
    """The key of one draw: each word (iteration, micro-batch, site; non-negative) hashed in."""
    for word in words:
        key = mix64_int((key + (word + 1) * _GOLDEN) & _MASK)
    return key


def uniform(key, shape, dtype, xp, block=None, lead=None):
    """Numbers j = 0 .. prod(shape)-1 of the draw `key`: uniform in [0, 1), the top 24 (float32)
    or 53 (float64) bits of mix64(key + j * golden) scaled exactly, so the same on any device.

    block=(row_start, row_stop, col_stop) gives only `uniform(key, shape)[..., row_start:row_stop,
    :col_stop]`, drawn at the cost of the block (blockwise attention draws its masks this way);
    lead=((start, stop), ...) narrows the leading axes too (a thread's share of the heads)."""
    dtype, mantissa, starts, width, out_shape = _layout(shape, dtype, block, lead)
    if _compiled(xp, starts, width):
        return _fill_compiled(key, numpy.empty((starts.size, width), dtype), starts, mantissa, out_shape)
    bits = xp.asarray(starts)[:, None] + xp.arange(width, dtype=xp.uint64)[None, :]
    bits *= xp.uint64(_GOLDEN)
    bits += xp.uint64(key) if isinstance(key, int) else key
    mix64(bits, xp)
    bits >>= xp.uint64(64 - mantissa)
    numbers = bits.astype(dtype).reshape(out_shape)
    numbers *= dtype.type(2.0 ** -mantissa)
    return numbers


def keep_mask(key, shape, dtype, p, xp, block=None, lead=None, device_rows=None):
    """uniform(key, shape, dtype, ...) >= p: dropout's keep mask of the draw, as booleans. On
    NumPy a large draw is hashed and compared in one compiled pass that writes 1 byte a number
    instead of 4 or 8 and a comparison pass; on a GPU in one fused kernel (hashed_keep), from
    each row's first index and the column indices, kept on the device in `device_rows` (a dict:
    the same shapes and blocks recur every step, so no draw uploads anything); elsewhere it is
    exactly that comparison."""
    dtype, mantissa, starts, width, out_shape = _layout(shape, dtype, block, lead)
    if _compiled(xp, starts, width) and 0.0 <= p:
        # p as the numbers' dtype holds it: NumPy compares float32 numbers with float32(p).
        return _fill_compiled(key, numpy.empty((starts.size, width), numpy.bool_), starts, mantissa,
                              out_shape, float(dtype.type(p)))
    if xp is not numpy:
        where = (shape, block, None if lead is None else tuple(map(tuple, lead)))
        rows, columns = _on_device(xp, starts, width, device_rows, where)
        # number >= p  <=>  top bits >= ceil(p * 2**mantissa): the numbers are those integers
        # times 2**-mantissa exactly, and p as the numbers' dtype times a power of 2 is exact
        threshold = max(0, math.ceil(float(dtype.type(p)) * 2.0 ** mantissa))
        keep = hashed_keep(rows, columns, numpy.uint64(key) if isinstance(key, int) else key, *_HASH_CONSTANTS,
                           numpy.uint64(64 - mantissa), numpy.uint64(threshold))
        return keep.reshape(out_shape)
    return uniform(key, shape, dtype, xp, block, lead) >= p


#: golden, the two multipliers and the three shifts of mix64, as uint64 kernel arguments
_HASH_CONSTANTS = tuple(numpy.uint64(c) for c in (_GOLDEN, _MIX_1, _MIX_2, 30, 27, 31))


@fused
def hashed_keep(xp, row_starts, columns, key, golden, mix_1, mix_2, shift_1, shift_2, shift_3,
                drop_bits, threshold):
    """The keep mask of a draw in one kernel: z = mix64(key + (row start + column) * golden), kept
    where its top bits reach the threshold; row_starts (rows, 1) and columns (1, width) broadcast
    inside the kernel, so no index or hash array is ever stored. Exactly uniform() >= p."""
    z = row_starts + columns
    z *= golden
    z += key
    _mix64_in_place(xp, z, mix_1, mix_2, shift_1, shift_2, shift_3)
    return xp.right_shift(z, drop_bits) >= threshold


def _mix64_in_place(xp, z, mix_1, mix_2, shift_1, shift_2, shift_3):
    """mix64 inside a fused body, its constants passed as kernel arguments (uint64)."""
    for shift, multiplier in ((shift_1, mix_1), (shift_2, mix_2)):
        xp.bitwise_xor(z, xp.right_shift(z, shift), out=z)
        z *= multiplier
    xp.bitwise_xor(z, xp.right_shift(z, shift_3), out=z)


@fused
def device_draw_key(xp, iteration, key, golden, mix_1, mix_2, shift_1, shift_2, shift_3, micro_batch_word,
                    site_word):
    """draw_key(key, iteration, micro_batch, site) with the iteration read from device memory (a
    0-d uint64 array: --cuda-graph replays a step whose iteration only the device knows), the
    micro-batch's and the site's words, (n + 1) * golden, computed on the host. Integer arithmetic
    wraps as on the host, so the key is draw_key's bit for bit."""
    constants = (mix_1, mix_2, shift_1, shift_2, shift_3)
    z = iteration + 1
    z *= golden
    z += key
    _mix64_in_place(xp, z, *constants)
    z += micro_batch_word
    _mix64_in_place(xp, z, *constants)
    z += site_word
    _mix64_in_place(xp, z, *constants)
    return z


def _word(n):
    """(n + 1) * golden as draw_key adds it, a uint64 kernel argument."""
    return numpy.uint64(((n + 1) * _GOLDEN) & _MASK)


#: device row starts and column indices kept per (shape, block, lead): blockwise attention's
#: blocks and the layers' shapes are the same every step; more than this many is not expected
_DEVICE_ROWS_KEPT = 512


def _on_device(xp, starts, width, kept, key):
    """(row starts as a (rows, 1) device array, column indices as (1, width)), uploaded once."""
    kept = {} if kept is None else kept
    if key not in kept:
        if len(kept) >= _DEVICE_ROWS_KEPT:
            kept.clear()
        kept[key] = (xp.asarray(starts)[:, None], xp.arange(width, dtype=xp.uint64)[None, :])
    return kept[key]


def _layout(shape, dtype, block, lead):
    """(dtype, mantissa bits, each output row's first number, row width, output shape)."""
    dtype = numpy.dtype(dtype)
    shape = tuple(int(n) for n in numpy.atleast_1d(shape)) if not isinstance(shape, tuple) else shape
    starts, width, out_shape = _row_starts(shape, block, lead)
    return dtype, 24 if dtype == numpy.float32 else 53, starts, width, out_shape


def _compiled(xp, starts, width):
    return xp is numpy and starts.size * width >= _COMPILED_MIN_SIZE


def _fill_compiled(key, out, starts, mantissa, out_shape, p=-1.0):
    """The numbers (p < 0) or keep mask (p >= 0) of the rows, by the numba kernel."""
    from . import _uniform_kernel
    _uniform_kernel.fill(out, numpy.uint64(key), starts, mantissa, p)
    return out.reshape(out_shape)


#: Draws at least this large are hashed by the compiled kernel on NumPy (smaller ones are not
#: worth importing numba for); both give bitwise the same numbers.
_COMPILED_MIN_SIZE = 1 << 15


def _row_starts(shape, block, lead=None):
    """(index of each output row's first number, row width, output shape) as host uint64."""
    if not shape:
        return numpy.zeros(1, numpy.uint64), 1, shape
    if block is None and lead is None:
        rows = int(numpy.prod(shape[:-1], dtype=numpy.int64))
        return numpy.arange(rows, dtype=numpy.uint64) * numpy.uint64(shape[-1]), shape[-1], shape
    if len(shape) < 2:
        raise ValueError(f"a block of a draw needs at least 2 dimensions, got shape {shape}")
    rows, cols = shape[-2:]
    row_start, row_stop, col_stop = (0, rows, cols) if block is None else block
    lead = [(0, n) for n in shape[:-2]] if lead is None else list(lead)
    if not (0 <= row_start <= row_stop <= rows and 0 <= col_stop <= cols) or len(lead) != len(shape) - 2 \
            or any(not 0 <= a <= b <= n for (a, b), n in zip(lead, shape[:-2])):
        raise ValueError(f"block {block} (leading axes {lead}) is outside the draw of shape {shape}")
    index = numpy.zeros(1, numpy.uint64)        # flat index of each leading position, then rows
    for (a, b), n in zip(lead + [(row_start, row_stop)], shape[:-2] + (rows,)):
        index = (index[:, None] * numpy.uint64(n) + numpy.arange(a, b, dtype=numpy.uint64)[None, :]).reshape(-1)
    out_shape = tuple(b - a for a, b in lead) + (row_stop - row_start, col_stop)
    return index * numpy.uint64(cols), col_stop, out_shape


def site_number(layer=None, kind=0):
    """A dropout site's number: 0 for the embedding, then three per transformer layer (attention
    probabilities, attention output, MLP output) by the layer's global number, so every pipeline
    split and virtual stage gives a layer the same masks."""
    return 0 if layer is None else 1 + 3 * layer + kind


class DropoutSite:
    """What ag.dropout draws from at one site: `random(shape, dtype)` at the tracker's current
    (iteration, micro-batch)."""

    def __init__(self, tracker, stream, site):
        self.tracker, self.stream, self.site = tracker, stream, site

    def random(self, shape, dtype=numpy.float64, block=None):
        """The site's uniforms of `shape`; block=(row_start, row_stop, col_stop): only
        `random(shape)[..., row_start:row_stop, :col_stop]`, at the cost of the block."""
        return self.frozen().random(shape, dtype, block)

    def keep(self, shape, dtype, p, block=None):
        """random(shape, dtype, block) >= p, made without the numbers where it can (keep_mask)."""
        return self.frozen().keep(shape, dtype, p, block)

    def frozen(self):
        """This site's draw at the tracker's position now, kept: an op that draws again in its
        backward (blockwise attention) holds it, so its masks stay the forward's even if the
        tracker has moved on."""
        t = self.tracker
        if t.device_iteration is not None:      # --cuda-graph: the iteration is on the device
            key = device_draw_key(t.device_iteration, numpy.uint64(t.keys[self.stream]), *_HASH_CONSTANTS,
                                  _word(t.micro_batch), _word(self.site))
        else:
            key = draw_key(t.keys[self.stream], t.iteration, t.micro_batch, self.site)
        return FrozenDraw(key, t.xp, t.device_rows)


class FrozenDraw:
    """One draw's key: `random(shape, dtype, block)` as DropoutSite's, at a fixed position."""

    def __init__(self, key, xp, device_rows=None):
        self.key, self.xp, self.device_rows = key, xp, device_rows

    def random(self, shape, dtype=numpy.float64, block=None, lead=None):
        return uniform(self.key, shape, dtype, self.xp, block, lead)

    def keep(self, shape, dtype, p, block=None, lead=None):
        return keep_mask(self.key, shape, dtype, p, self.xp, block, lead, self.device_rows)


class RNGTracker:
    """The two streams' keys and the position every draw is made at. The training loop sets
    `iteration`; the pipeline schedule sets `micro_batch` (numbered over the data-parallel
    replicas, so a micro-batch gets the same masks at any DP size)."""

    def __init__(self, seed, tp_rank, xp):
        self.xp, self.iteration, self.micro_batch = xp, 0, 0
        self.device_rows = {}           # keep_mask's device row starts and columns, by draw shape
        self.device_iteration = None    # the iteration in device memory (iteration_on_device)
        mp_seed = seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank
        self.keys = {DEFAULT: draw_key(0, seed), MODEL_PARALLEL: draw_key(0, mp_seed)}

    def iteration_on_device(self):
        """Key the draws by a copy of the iteration in device memory from now on (--cuda-graph: a
        captured step reads it there, so its replays draw each iteration's masks); set_iteration
        writes it."""
        if self.device_iteration is None:
            self.device_iteration = self.xp.zeros((), numpy.uint64)

    def set_iteration(self, iteration):
        """The iteration draws are keyed by, also written to device memory where it is kept there."""
        self.iteration = iteration
        if self.device_iteration is not None:
            self.device_iteration.set(numpy.asarray(iteration, numpy.uint64))

    def site(self, stream, site):
        return DropoutSite(self, stream, site)

    def replay(self):
        """The position now, as a context-manager factory that puts it back for a while and then
        restores whatever it is by then: activation recomputation runs a layer again in backward,
        after the pipeline schedule has moved on to other micro-batches."""
        saved = (self.iteration, self.micro_batch)

        @contextlib.contextmanager
        def restored():
            now = (self.iteration, self.micro_batch)
            self.iteration, self.micro_batch = saved
            try:
                yield
            finally:
                self.iteration, self.micro_batch = now
        return restored

    def get_states(self):
        """The position, to save in a checkpoint (JSON integers)."""
        return {"iteration": self.iteration, "micro_batch": self.micro_batch}

    def set_states(self, states):
        if set(states) != {"iteration", "micro_batch"}:
            raise InputError("the checkpoint holds dropout generator states of an older npmegatron "
                             "(not the stateless position); resume it with the version that saved it")
        self.iteration, self.micro_batch = int(states["iteration"]), int(states["micro_batch"])
