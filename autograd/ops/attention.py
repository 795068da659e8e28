"""Causal self-attention computed one block of queries at a time: softmax(scale q k^T, causal),
dropout, @ v, keeping O(s * block) scores instead of (s, s) and saving only q, k, v, the output
and the log-sum-exp per query for backward, which recomputes the probabilities.

FlashAttention's recomputation (Dao et al., 2022), without its online softmax: a block of
queries sees all the keys it may attend to at once, so its softmax is exact in one pass. It
replaces Megatron's FusedScaleMaskSoftmax + attention dropout + the two batched GEMMs.
"""
import math

import numpy

from .. import precision
from ..backend import get_array_module
from ..cpu_blocks import each_share, share_ranges
from ..errors import InputError
from ..function import Function
from ..fusion import fused
from ..gemm import matmul
from ..tensor import Tensor
from ..threads import cpu_threads
from .dropouts import keep_mask
from . import fused_attention
from .fused_attention import FusedCausalAttention, FusedGroupedCausalAttention, attention_path
from .nn import _causal_bias, exp_shifted_, softmax_backward
from .shape import repeat_heads

#: Query rows per block, measured forward + backward in float32 on 2 CPU cores (b=8, heads=8,
#: t=256, d=64; and t=1024 at b=1): at t=256, 64 and 128 rows tie with each other and with the
#: dense path, one block of 256 is slower (nothing skipped, scores recomputed); at t=1024, 128
#: rows is the fastest or within noise of it. Scores held at once: 128 x t per head.
BLOCK_SIZE = 128
#: Bytes of one block's scores on a GPU. There each block costs about 26 kernel launches from
#: Python whatever its size, so a block is as tall as this allows (GPT-2 124M, micro-batch 8,
#: float32: 2 blocks of 512 rows instead of 8 of 128). The keys beyond the diagonal that a taller
#: block computes and masks cost less than the launches saved where the GEMMs are fast: on an
#: H200 the --tf32 step went from 124 to 94 ms; the float32 step, bound by its CUDA-core GEMMs,
#: stayed within 2 % (docs/benchmarks.md).
GPU_BLOCK_SCORE_BYTES = 256 << 20
#: Attention with fewer scores than this runs on the calling thread (a thread hand-off costs more).
MIN_SHARED_SCORES = 1 << 16
#: Bytes of one block's scores per chunk of heads on the CPU (_by_heads); measured at the reference
#: shape on 2 cores, 1 MiB was faster than 256 or 512 KiB and tied with 2 MiB.
CHUNK_SCORE_BYTES = 1 << 20


@fused
def dropout_(xp, y, keep, scale):
    """Inverted dropout in place: y where its keep mask is set, times 1 / (1 - p)."""
    y *= keep
    y *= scale


@fused
def dropout_softmax_backward_(xp, g, y, keep, dot, dropout_scale, scale):
    """g (the gradient of the dropped probabilities) becomes the gradient of the scores in place:
    through dropout (the same masks as forward), then scale * y * (g - <g, y>) as Softmax."""
    g *= keep
    g *= dropout_scale
    g -= dot
    g *= y
    g *= scale


def query_blocks(t_q, t_k, block_size):
    """(first query row, end row, keys seen) per block: queries are the last t_q of t_k positions,
    so rows [a, e) see keys [0, t_k - t_q + e); keys after that are never touched."""
    return [(a, min(a + block_size, t_q), t_k - t_q + min(a + block_size, t_q))
            for a in range(0, t_q, block_size)]


class _Scratch:
    """One share's reused buffers on the CPU's compiled path. A block's scores written by a GEMM
    into the same memory every block are still in cache when the softmax kernel and the GEMMs
    after it read them. With the share's q, k and v copied contiguous out of the packed QKV as
    well (strided rows 9 KiB apart slow the GEMMs that read them), forward + backward of GPT-2
    124M's layer (b=1, heads=12, t=1024, d=64, float32, 2 threads) went from 53.4 to 45.9 ms:
    the summed GEMM time from 79 to 65 ms over the two threads, and no product copied or added
    into place from a temporary where it can be written there."""

    def __init__(self):
        self.buffers = {}

    def get(self, name, shape, dtype):
        """A C-contiguous array of `shape` over buffer `name`, grown when too small."""
        size = math.prod(shape)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.size < size:
            buffer = self.buffers[name] = numpy.empty(size, dtype)
        return buffer[:size].reshape(shape)


def _product(a, b, scratch, name):
    """a @ b: into the share's buffer `name` on the compiled path (scratch given), else new."""
    if scratch is None:
        return matmul(a, b)
    return numpy.matmul(a, b, out=scratch.get(name, a.shape[:-1] + b.shape[-1:], a.dtype))


def _add_product(a, b, out, scratch):
    """out += a @ b, the product in the share's buffer on the compiled path."""
    if scratch is None:
        matmul(a, b, out=out, accumulate=True)
    else:
        out += _product(a, b, scratch, "product")


def _probabilities(xp, q_blk, keys_t, lse, biases, scratch=None):
    """exp(scale q k^T - shift) of one block, the causal part masked: only the last rows x rows
    square of keys has masked entries. q_blk is pre-scaled, keys_t the seen keys transposed (d,
    seen); lse None: the shift is the row max, returned with the row sums (the forward), else lse
    (backward's recomputation). biases: the causal biases by block height, or None for the
    compiled float32 kernels, which write the scores into scratch's buffer "scores"."""
    z = _product(q_blk, keys_t, scratch, "scores")
    rows, keys = z.shape[-2:]
    if biases is None:
        from . import _attention_cpu
        scores = z.reshape(-1, rows, keys)
        if lse is not None:
            _attention_cpu.probabilities_(scores, keys - rows, lse.reshape(-1, rows))
            return z, None, None
        shift, total = xp.empty(z.shape[:-1] + (1,), z.dtype), xp.empty(z.shape[:-1] + (1,), z.dtype)
        _attention_cpu.softmax_numerators_(scores, keys - rows, shift.reshape(-1, rows), total.reshape(-1, rows))
        return z, shift, total
    if rows not in biases:
        biases[rows] = _causal_bias(xp, rows, rows, z.dtype)
    z[..., -rows:] += biases[rows]
    if lse is not None:
        exp_shifted_(z, lse)
        return z, None, None
    shift = z.max(axis=-1, keepdims=True)
    exp_shifted_(z, shift)
    return z, shift, z.sum(axis=-1, keepdims=True)


def _compiled(q):
    """Whether the softmax parts run the numba kernels (_attention_cpu.py): float32 on the CPU,
    large enough that importing numba pays (a test's tiny model never does)."""
    b, h, t_q, _ = q.shape
    return get_array_module(q).__name__ == "numpy" and q.dtype == "float32" and b * h * t_q * t_q >= MIN_SHARED_SCORES


def _forward_share(xp, q, k, v, out, lse, scale, p, draw, block_size, compiled):
    """Forward of some heads: out and lse (views of the whole op's arrays) filled in place."""
    t_q, t_k = q.shape[2], k.shape[2]
    dropout_scale, biases = 1.0 / (1.0 - p), None if compiled else {}
    scratch = _Scratch() if compiled else None
    if compiled:
        q, k, v = (xp.ascontiguousarray(x) for x in (q, k, v))
    keys_t = k.swapaxes(-1, -2)
    for a, e, seen in query_blocks(t_q, t_k, block_size):
        z, zmax, total = _probabilities(xp, q[..., a:e, :] * q.dtype.type(scale), keys_t[..., :seen], None,
                                        biases, scratch)
        lse[..., a:e] = (zmax + xp.log(total))[..., 0]
        if draw is not None and compiled:
            from . import _attention_cpu
            rows, keys = z.shape[-2:]
            _attention_cpu.dropout_(z.reshape(-1, rows, keys), draw(a, e, seen).reshape(-1, rows, keys),
                                    z.dtype.type(dropout_scale))
        elif draw is not None:
            dropout_(z, draw(a, e, seen), dropout_scale)
        y = _product(z, v[..., :seen, :], scratch, "rows")
        xp.divide(y, total, out=out[..., a:e, :])


def _backward_share(xp, g, q, k, v, out, lse, dq, dk, dv, scale, p, draw, block_size, compiled):
    """Backward of some heads: dq, dk, dv (views of the whole op's gradients) filled in place;
    on the compiled path through contiguous copies and gradients of the share's own (_Scratch)."""
    dot = (g * out).sum(axis=-1, keepdims=True)       # <dO, O> = <dP, P> per query row
    if compiled:
        q, k, v, g = (xp.ascontiguousarray(x) for x in (q, k, v, g))
    operands = (lse, dot, k.swapaxes(-1, -2), v.swapaxes(-1, -2), scale, p, draw, block_size)
    if not compiled:
        _backward_blocks(xp, g, q, k, *operands, dq, dk, dv, None)
        return
    own = xp.empty(q.shape, q.dtype), xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)
    _backward_blocks(xp, g, q, k, *operands, *own, _Scratch())
    dq[...] = own[0]        # each share's heads are its own: dk and dv written, not added to
    dk[...] = own[1]
    dv[...] = own[2]


def _backward_blocks(xp, g, q, k, lse, dot, keys_t, values_t, scale, p, draw, block_size, dq, dk, dv, scratch):
    """_backward_share's work block by block of queries; scratch given: the compiled path."""
    compiled = scratch is not None
    dropout_scale, biases = 1.0 / (1.0 - p), None if compiled else {}
    for a, e, seen in query_blocks(q.shape[2], k.shape[2], block_size):
        q_blk, g_blk = q[..., a:e, :], g[..., a:e, :]
        # Per-row values copied contiguous (tiny), so the CPU engine can cut chains by rows.
        lse_blk = xp.ascontiguousarray(lse[..., a:e, None])
        dot_blk = xp.ascontiguousarray(dot[..., a:e, :])
        probs = _probabilities(xp, q_blk * q.dtype.type(scale), keys_t[..., :seen], lse_blk, biases, scratch)[0]
        dprobs = _product(g_blk, values_t[..., :seen], scratch, "score gradients")
        if compiled:
            from . import _attention_cpu
            rows, keys = dprobs.shape[-2:]
            scores = dprobs.reshape(-1, rows, keys), probs.reshape(-1, rows, keys)
            if draw is None:
                _attention_cpu.softmax_backward_(*scores, dot_blk.reshape(-1, rows), scale)
            else:
                _attention_cpu.dropout_softmax_backward_(
                    *scores, draw(a, e, seen).reshape(-1, rows, keys), dot_blk.reshape(-1, rows),
                    probs.dtype.type(dropout_scale), probs.dtype.type(scale))
            dz = dprobs
        elif draw is None:
            dz = softmax_backward(dprobs, probs, dot_blk, scale)
        else:
            keep = draw(a, e, seen)
            dropout_softmax_backward_(dprobs, probs, keep, dot_blk, dropout_scale, scale)
            dz = dprobs
            dropout_(probs, keep, dropout_scale)
        _add_product(probs.swapaxes(-1, -2), g_blk, dv[..., :seen, :], scratch)
        matmul(dz, k[..., :seen, :], out=dq[..., a:e, :])
        _add_product(dz.swapaxes(-1, -2), q_blk, dk[..., :seen, :], scratch)


def _by_heads(xp, q, t_k, block_size, work):
    """work(batch slice, head slice) over all (batch, head) pairs: once on a GPU; on the CPU in
    chunks of one sample's heads shared among the threads of the budget, with BLAS held to one
    thread each. Attention's GEMMs are small, and its elementwise work then runs on every core
    too (measured at b=8, heads=8, t=256, d=64, float32 on 2 cores: forward + backward 88 ms with
    2 BLAS threads on all heads at once, 63 ms in 2 shares). A chunk's block of scores is kept
    under CHUNK_SCORE_BYTES, so that the GEMM writing them, the softmax kernel and the GEMMs
    reading them back find them in cache: all 64 heads of a share at once took 43 ms (median of
    16) for backward at the same shapes, one sample's 8 heads 31 ms."""
    b, h, t_q = q.shape[:3]
    if xp.__name__ != "numpy" or b * h * t_q * t_q < MIN_SHARED_SCORES:
        work(slice(None), slice(None))
        return
    per_head = min(block_size, t_q) * t_k * q.dtype.itemsize
    heads = max(1, min(h, CHUNK_SCORE_BYTES // per_head))
    chunks = [(slice(i, i + 1), slice(j, min(j + heads, h))) for i in range(b) for j in range(0, h, heads)]

    def run(start, stop):
        for bs, hs in chunks[start:stop]:
            work(bs, hs)

    each_share([(lambda s=s: run(*s)) for s in share_ranges(len(chunks), cpu_threads())])


class CausalAttention(Function):
    """softmax(scale q k^T, causal) -> dropout -> @ v, block by block of queries (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, p, generator, block_size):
        xp = get_array_module(q, k, v)
        b, h, t_q, d = q.shape
        block_size = block_rows(xp, q, k.shape[2], block_size)
        compiled = ctx.compiled = _compiled(q)      # backward's path too
        # Laid out (b, t, heads, d): the caller's transpose back and reshape to (b, t, h*d) is a
        # view, so the projection's saved input and this saved output are one buffer.
        out = xp.empty((b, t_q, h, v.shape[3]), v.dtype).transpose(0, 2, 1, 3)
        lse = xp.empty((b, h, t_q), q.dtype)

        def share(bs, hs):
            _forward_share(xp, q[bs, hs], k[bs, hs], v[bs, hs], out[bs, hs], lse[bs, hs], scale, p,
                           _draws(generator, q, k, bs, hs, p), block_size, compiled)

        _by_heads(xp, q, k.shape[2], block_size, share)
        ctx.scale, ctx.p, ctx.generator, ctx.block_size = scale, p, generator, block_size
        # out is kept as laid out, (b, t, heads, d): the projection keeps the same buffer as its
        # input, and under --fp16/--bf16 on a GPU both keep one 16-bit copy (function.py)
        ctx.save_for_backward(q, k, v, out.transpose(0, 2, 1, 3), lse)
        ctx.on_grid(0, 1, 2, 3)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved[:3]
        xp = get_array_module(g)
        zeros = xp.empty_like if ctx.compiled else xp.zeros_like   # compiled shares write dk, dv whole
        dq, dk, dv = xp.empty_like(q), zeros(k), zeros(v)
        _backward_into(ctx, g, dq, dk, dv)
        return dq, dk, dv


def _backward_into(ctx, g, dq, dk, dv):
    """CausalAttention's backward, into dq (overwritten) and dk, dv (zeros, accumulated; on the
    compiled path any array, written whole share by share)."""
    saved = ctx.saved
    if len(saved) == 3:         # PackedCausalAttention's: q, k and v as one array
        saved = ctx.split_qkv(saved[0]) + saved[1:]
    q, k, v, out, lse = saved
    out = out.transpose(0, 2, 1, 3)
    xp = get_array_module(g)

    def share(bs, hs):
        _backward_share(xp, g[bs, hs], q[bs, hs], k[bs, hs], v[bs, hs], out[bs, hs], lse[bs, hs],
                        dq[bs, hs], dk[bs, hs], dv[bs, hs], ctx.scale, ctx.p,
                        _draws(ctx.generator, q, k, bs, hs, ctx.p), ctx.block_size, ctx.compiled)

    _by_heads(xp, q, k.shape[2], ctx.block_size, share)


def block_rows(xp, q, t_k, block_size):
    """Query rows per block: `block_size` when given; else BLOCK_SIZE on the CPU and, on a GPU,
    as many multiples of BLOCK_SIZE as GPU_BLOCK_SCORE_BYTES of scores allow, split evenly."""
    if block_size is not None:
        return int(block_size)
    b, h, t_q = q.shape[:3]
    if xp.__name__ == "numpy" or q.size == 0:
        return BLOCK_SIZE
    fit = max(1, GPU_BLOCK_SCORE_BYTES // (b * h * max(t_k, 1) * q.dtype.itemsize * BLOCK_SIZE))
    blocks = -(-t_q // (fit * BLOCK_SIZE))
    return BLOCK_SIZE * -(-t_q // (blocks * BLOCK_SIZE))


def _unpack(qkv):
    """q, k, v as (b, heads, t, d) views of a QKV projection output laid out (b, t, heads, 3, d)."""
    return tuple(qkv[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))


def _heads_first(xp, batch):
    """Whether q, k, v are copied heads-first, (3, b, heads, t, d), before attention: on a GPU with
    more than one sequence. Views of the (b, t, heads, 3, d) projection walk batch and heads with
    two strides that do not merge, so each of attention's GEMMs would be one cuBLAS call per
    sequence, each too small to fill the GPU (GPT-2 124M, micro-batch 8, H200: 5,376 GEMM calls a
    step, mostly on 32 x 32 tiles). One copy each way per layer makes every GEMM one strided-batched
    call over batch x heads. The CPU works sequence by sequence anyway (_by_heads), so it reads the
    views."""
    return xp.__name__ != "numpy" and batch > 1


class PackedCausalAttention(Function):
    """CausalAttention taking the QKV projection's output (b, t, heads, 3, d) itself: backward
    writes dq, dk and dv straight into one gradient of that shape, where splitting it into q, k,
    v would concatenate three copies back (measured about 6 ms per layer at the reference shape)."""

    @staticmethod
    def forward(ctx, qkv, scale, p, generator, block_size):
        ctx.qkv_shape = qkv.shape
        xp = get_array_module(qkv)
        if _heads_first(xp, qkv.shape[0]):
            b, t, h, _, d = qkv.shape
            heads = xp.empty((3, b, h, t, d), qkv.dtype)
            heads[...] = qkv.transpose(3, 0, 2, 1, 4)
            source, ctx.split_qkv = heads, tuple
        else:
            source, ctx.split_qkv = qkv, _unpack
        out = CausalAttention.forward(ctx, *ctx.split_qkv(source), scale, p, generator, block_size)
        # q, k and v kept as the one array they are views of: one 16-bit copy under --fp16/--bf16
        ctx.save_for_backward(source, *ctx.kept[3:])
        ctx.on_grid(0, 1)
        return out

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        if _heads_first(xp, g.shape[0]):
            g_heads = xp.empty(g.shape, g.dtype)
            g_heads[...] = g
            grads = xp.zeros((3,) + g.shape, g.dtype)
            _backward_into(ctx, g_heads, *grads)
            grad = xp.empty(ctx.qkv_shape, g.dtype)
            grad[...] = grads.transpose(1, 3, 2, 0, 4)
            return grad
        # the compiled shares write dq, dk and dv whole; the others add into zeros
        grad = (xp.empty if ctx.compiled else xp.zeros)(ctx.qkv_shape, g.dtype)
        _backward_into(ctx, g, *_unpack(grad))
        return grad


def _draws(generator, q, k, bs, hs, p):
    """draw(a, e, seen): the dropout keep mask of query rows [a, e) and keys [0, seen) of the
    heads (bs, hs), drawn from the full (b, heads, t_q, t_k) draw so that any split of the heads
    gives the masks of the dense probabilities."""
    if generator is None:
        return None
    shape = q.shape[:3] + (k.shape[2],)
    lead = tuple(part.indices(n)[:2] for part, n in zip((bs, hs), shape[:2]))
    return lambda a, e, seen: keep_mask(generator, shape, q.dtype, p, block=(a, e, seen), lead=lead)


def causal_attention(q, k, v, scale, dropout_p, dropout_site, training=True, block_size=None):
    """softmax(scale q k^T, causal) with dropout on the probabilities, @ v; q (b, heads, t_q, d),
    k and v (b, heads, t_k, d), the queries being the last t_q of the t_k positions (a KV cache).

    dropout_site: `random(shape, dtype, block, lead)` giving the same numbers every call (it is
    called again in backward), e.g. DropoutSite.frozen(), whose `keep` makes the masks without
    the numbers (dropouts.keep_mask); masks are drawn for the full (b, heads, t_q, t_k) probabilities,
    block by block, so they equal Dropout's on the dense probabilities."""
    if not 0.0 <= dropout_p < 1.0:
        raise InputError(f"dropout probability {dropout_p} is outside [0, 1); use e.g. 0.1")
    if q.ndim != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise InputError(f"attention needs q (b, heads, t_q, d) and k, v (b, heads, t_k, d), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] > k.shape[2]:
        raise InputError(f"{q.shape[2]} queries but {k.shape[2]} keys; queries are the last of the "
                         "key positions, so there can be no more of them than keys")
    if block_size is not None and block_size < 1:
        raise InputError(f"attention block size {block_size} must be a positive number of query rows")
    p = dropout_p if training else 0.0
    return CausalAttention.apply(q, k, v, scale=scale, p=p, generator=dropout_site if p > 0 else None,
                                 block_size=block_size)


def grouped_causal_attention(q, k, v, scale, dropout_p, dropout_site, training=True):
    """causal_attention where k and v (b, groups, t_k, d) may have fewer heads than q (b, heads,
    t_q, d): grouped-query attention, each key/value head serving heads // groups query heads. On
    a GPU, cuDNN's fused attention takes the groups as they are where fused_attention.attention_path
    chooses it and the queries are the keys' positions (training, a prompt's first pass); else
    each key/value head is repeated for its queries (RepeatHeads) and causal_attention runs."""
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise InputError(f"grouped attention needs q (b, heads, t, d) and k, v (b, groups, t, d) with "
                         f"groups dividing heads, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    p = dropout_p if training else 0.0
    xp = get_array_module(q.data if isinstance(q, Tensor) else q)
    if (q.shape[2] == k.shape[2] and attention_path(xp, p, q.shape[3], precision.kept_in_16_bit())[0] == "fused"
            and fused_attention._grouped_key(q, k) not in fused_attention.unsupported):
        try:
            return FusedGroupedCausalAttention.apply(q, k, v, scale=scale)
        except fused_attention.Unsupported:
            pass                # cuDNN has no engine for this layout here: the blockwise path
    per_group = q.shape[1] // k.shape[1]
    k, v = repeat_heads(k, per_group), repeat_heads(v, per_group)
    return causal_attention(q, k, v, scale, dropout_p, dropout_site, training)


def causal_attention_packed(qkv, scale, dropout_p, dropout_site, training=True, block_size=None):
    """causal_attention of the q, k, v packed as a QKV projection lays them out, (b, t, heads, 3,
    d), with one gradient of that shape (no split and concatenation). Returns (b, heads, t, d).
    On a GPU, cuDNN's fused flash attention where fused_attention.attention_path chooses it (no
    block size given): a 16-bit output under --fp16/--bf16, which the projection multiplies."""
    if qkv.ndim != 5 or qkv.shape[3] != 3:
        raise InputError(f"packed attention needs qkv of shape (b, t, heads, 3, d), got {tuple(qkv.shape)}")
    if not 0.0 <= dropout_p < 1.0:
        raise InputError(f"dropout probability {dropout_p} is outside [0, 1); use e.g. 0.1")
    if block_size is not None and block_size < 1:
        raise InputError(f"attention block size {block_size} must be a positive number of query rows")
    p = dropout_p if training else 0.0
    xp = get_array_module(qkv.data if isinstance(qkv, Tensor) else qkv)
    if (block_size is None and attention_path(xp, p, qkv.shape[4], precision.kept_in_16_bit())[0] == "fused"
            and (qkv.shape, qkv.dtype.name) not in fused_attention.unsupported):
        try:
            return FusedCausalAttention.apply(qkv, scale=scale)
        except fused_attention.Unsupported:
            pass                # cuDNN has no engine for this layout here: the blockwise path
    return PackedCausalAttention.apply(qkv, scale=scale, p=p, generator=dropout_site if p > 0 else None,
                                       block_size=block_size)
