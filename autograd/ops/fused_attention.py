"""Causal self-attention as two library calls on a GPU: cuDNN's fused flash attention (Dao, 2023)
through nvidia-cudnn-frontend's graph API, forward keeping the log-sum-exp per query and backward
recomputing the probabilities from it, as attention.py's blockwise path does in ~40 kernels.

The same Function as that path's PackedCausalAttention, packed q, k, v in and their one gradient
out; cuDNN reads q, k and v where the QKV projection wrote them (strided views, no copy) and writes
the output in the (b, t, heads, d) layout the projection reads. Under --fp16/--bf16 with 16-bit
arrays its operands are 16-bit (cuDNN's flash attention is 16-bit only): the QKV projection's
16-bit copy in, a 16-bit output the projection multiplies as it is, a 16-bit gradient, softmax
statistics in float32. Attention dropout would need cuDNN's own random numbers, not the stateless
masks the CPU draws, so dropout runs the blockwise path (attention_path says which runs).
"""
import numpy

from .. import precision
from ..backend import get_array_module
from ..function import Function, kept_16_bit_copy, remember_16_bit_copy

#: "auto": the fused path where attention_path() chooses it; "always": wherever the library
#: imports, any dtype (the tests' stand-in computes float64 too); "never": the blockwise path.
FUSED_ATTENTION = "auto"
#: The largest head dimension cuDNN's flash attention backward takes on every GPU it runs on
#: (Ampere and Ada: 128; Hopper: 256); it needs a multiple of 8.
MAX_HEAD_DIM = 128

_DATA_TYPES = {"float16": "HALF", "bfloat16": "BFLOAT16", "float32": "FLOAT", "float64": "DOUBLE"}
#: (id of the loaded cupy module) -> the cudnn module, or None where it does not import.
_libraries = {}
#: graph key -> (graph, its tensors in operand order, workspace bytes); a key is the operation,
#: every operand's shape, strides and dtype, the scale and the device.
_graphs = {}
#: device id -> cuDNN handle
_handles = {}


def library(xp):
    """nvidia-cudnn-frontend's `cudnn` module for CuPy module xp, or None where it is not installed
    or cannot load cuDNN (asked once per loaded CuPy)."""
    key = id(xp)
    if key not in _libraries:
        try:
            import cudnn
            cudnn.backend_version()
            _libraries[key] = cudnn
        except Exception:           # not installed, or no libcudnn / driver to load
            _libraries[key] = None
    return _libraries[key]


def attention_path(xp, dropout_p, head_dim, sixteen_bit):
    """("fused", why) or ("blockwise", why): which causal attention runs on array module xp for
    this dropout and head dimension, `sixteen_bit` being the format of the 16-bit arrays a GPU
    holds (precision.kept_in_16_bit()), or None."""
    if FUSED_ATTENTION == "never" or xp is numpy:
        return "blockwise", "the CPU's path" if xp is numpy else "fused attention turned off"
    if library(xp) is None:
        return "blockwise", "nvidia-cudnn-frontend and cuDNN are not installed or do not load (the gpu extra has them)"
    if dropout_p > 0:
        return "blockwise", "attention dropout > 0 (the fused path has no stateless masks)"
    if FUSED_ATTENTION == "always":
        return "fused", "cuDNN flash attention"
    if int(xp.cuda.Device().compute_capability) < 80:
        return "blockwise", "cuDNN's flash attention needs compute capability 8.0 (Ampere) or later"
    if sixteen_bit is None:
        return "blockwise", "cuDNN's flash attention is 16-bit only: run with --bf16 or --fp16 (CuPy >= 14 for bf16)"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return "blockwise", f"head dimension {head_dim} is not a multiple of 8 up to {MAX_HEAD_DIM}"
    return "fused", "cuDNN flash attention"


def _elements(a):
    return [s // a.itemsize for s in a.strides]


def _handle(cudnn, xp):
    device = xp.cuda.Device().id
    if device not in _handles:
        _handles[device] = cudnn.create_handle()
    return _handles[device]


def _describe(graph, cudnn, name, a):
    return graph.tensor(name=name, dim=list(a.shape), stride=_elements(a),
                        data_type=getattr(cudnn.data_type, _DATA_TYPES[a.dtype.name]))


def _set_output(cudnn, tensor, a):
    tensor.set_output(True).set_dim(list(a.shape)).set_stride(_elements(a)).set_data_type(
        getattr(cudnn.data_type, _DATA_TYPES[a.dtype.name]))


def _build(cudnn, xp, backward, operands, scale):
    """A built graph of the forward (q, k, v -> o, stats) or backward (q, k, v, o, dO, stats ->
    dQ, dK, dV) for operands laid out as given, and its tensors in operand order."""
    graph = cudnn.pygraph(io_data_type=getattr(cudnn.data_type, _DATA_TYPES[operands[0].dtype.name]),
                          intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=_handle(cudnn, xp))
    causal = {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "diagonal_band_right_bound": 0}
    if not backward:
        q, k, v = (_describe(graph, cudnn, n, a) for n, a in zip("qkv", operands[:3]))
        outputs = graph.sdpa(name="flash_attention", q=q, k=k, v=v, attn_scale=scale, generate_stats=True,
                             **causal)
        inputs = (q, k, v)
    else:
        inputs = tuple(_describe(graph, cudnn, n, a) for n, a in zip(("q", "k", "v", "o", "dO", "stats"), operands))
        # deterministic: the same gradients every run, as the rest of this project's GPU path
        outputs = graph.sdpa_backward(name="flash_attention_backward", q=inputs[0], k=inputs[1], v=inputs[2],
                                      o=inputs[3], dO=inputs[4], stats=inputs[5], attn_scale=scale,
                                      use_deterministic_algorithm=True, **causal)
    for tensor, a in zip(outputs, operands[len(inputs):]):
        _set_output(cudnn, tensor, a)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, tuple(inputs) + tuple(outputs), graph.get_workspace_size()


class Unsupported(RuntimeError):
    """cuDNN has no engine for this attention (its support check said so): the blockwise path runs."""


#: (qkv shape, dtype) whose graphs cuDNN does not support: the blockwise path runs for them.
unsupported = set()


def _graph(backward, operands, scale):
    """The built graph (and its tensors, workspace bytes) for operands laid out as these arrays."""
    xp = get_array_module(operands[0])
    key = (backward, float(scale), xp.cuda.Device().id, id(xp),
           tuple([(a.shape, a.strides, a.dtype.name) for a in operands]))
    if key not in _graphs:
        cudnn = library(xp)
        try:
            _graphs[key] = _build(cudnn, xp, backward, operands, scale)
        except cudnn.cudnnGraphNotSupportedError as error:
            raise Unsupported(str(error)) from None
    return _graphs[key]


def run_graph(backward, operands, scale):
    """Build (once per layout) and execute the forward or backward graph on these operands: the
    inputs, then the arrays cuDNN writes, on the current stream; one kernel launch."""
    xp = get_array_module(operands[0])
    cudnn = library(xp)
    graph, tensors, workspace_bytes = _graph(backward, operands, scale)
    workspace = xp.empty(max(workspace_bytes, 1), xp.uint8)
    handle = _handle(cudnn, xp)
    cudnn.set_stream(handle=handle, stream=xp.cuda.get_current_stream().ptr)
    graph.execute({t: a.data.ptr for t, a in zip(tensors, operands)}, workspace.data.ptr, handle=handle)


def _split(qkv):
    """q, k, v as (b, heads, t, d) views of (b, t, heads, 3, d)."""
    return tuple(qkv[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))


def _stats_dtype(dtype):
    """cuDNN keeps the log-sum-exp in float32; float64 operands (the stand-in) keep it in float64."""
    return numpy.float64 if dtype == numpy.float64 else numpy.float32


class FusedCausalAttention(Function):
    """PackedCausalAttention in one cuDNN call each way (module doc): qkv (b, t, heads, 3, d) ->
    (b, heads, t, d), laid out (b, t, heads, d); a 16-bit output under 16-bit arrays."""
    reads_16_bit = True     # cuDNN reads 16-bit q, k, v
    reads_16_bit_grads = True       # cuDNN reads the 16-bit dO

    @staticmethod
    def forward(ctx, qkv, scale):
        xp = get_array_module(qkv)
        fmt = precision.kept_in_16_bit()
        # the 16-bit copy the QKV projection's rounding made (function.py), else one cast
        operands = kept_16_bit_copy(qkv, fmt) if fmt and qkv.dtype == numpy.float32 else qkv
        b, t, h, _, d = operands.shape
        out = xp.empty((b, t, h, d), operands.dtype)
        stats = xp.empty((b, h, t, 1), _stats_dtype(operands.dtype))
        try:
            # backward's graph too, before anything runs: its output gradient is laid out as the
            # output, its gradients as the operands (a layout cuDNN refuses falls back whole)
            _graph(True, _split(operands) + (out.transpose(0, 2, 1, 3),) * 2 + (stats,) + _split(operands), scale)
            run_graph(False, _split(operands) + (out.transpose(0, 2, 1, 3), stats), scale)
        except Unsupported:
            unsupported.add((qkv.shape, qkv.dtype.name))
            raise
        ctx.scale = scale
        ctx.save_for_backward(operands, out, stats)
        return out.transpose(0, 2, 1, 3)

    @staticmethod
    def backward(ctx, g):
        operands, out, stats = ctx.kept       # as kept: cuDNN reads the 16-bit arrays themselves
        xp = get_array_module(g)
        fmt = precision.format_of(operands.dtype)
        d_out = g if g.dtype == operands.dtype else _sixteen_bit(g, fmt)
        grad = xp.empty(operands.shape, operands.dtype)
        run_graph(True, _split(operands) + (out.transpose(0, 2, 1, 3), d_out, stats) + _split(grad), ctx.scale)
        return grad         # 16-bit under 16-bit arrays: the QKV projection's GEMMs take it as it is


def _sixteen_bit(g, fmt):
    """The output's gradient (b, heads, t, d) in 16 bits: the copy the projection's backward
    rounding made of its buffer (laid out (b, t, heads, d)), else one cast laid out the same way,
    as the backward graph built in forward expects."""
    laid_out = g.transpose(0, 2, 1, 3)
    if laid_out.flags.c_contiguous:
        return kept_16_bit_copy(laid_out, fmt).transpose(0, 2, 1, 3)
    return kept_16_bit_copy(g, fmt)


class FusedGroupedCausalAttention(Function):
    """Causal attention of separate q (b, heads, t, d) and k, v (b, groups, t, d) in one cuDNN
    call each way: each key/value head serves heads // groups query heads as it is (grouped-query
    attention; cuDNN takes fewer key/value heads than query heads, so nothing is repeated) -> (b,
    heads, t, d) laid out (b, t, heads, d). The Llama family's path, q and k rotated. Under 16-bit
    arrays cuDNN reads the 16-bit copies the roundings of q, k and the QKV projection's output
    made (views of them), writes the three gradients into one 16-bit buffer, and one kernel widens
    it to float32 for the rotations' and the split's backward."""
    reads_16_bit = True     # cuDNN reads 16-bit q, k, v
    reads_16_bit_grads = True       # cuDNN reads the 16-bit dO

    @staticmethod
    def forward(ctx, q, k, v, scale):
        xp = get_array_module(q)
        fmt = precision.kept_in_16_bit()
        widen = bool(fmt) and q.dtype == numpy.float32      # float32 in: float32 gradients out
        if widen:
            q, k, v = (kept_16_bit_copy(a, fmt) for a in (q, k, v))
        b, heads, t, d = q.shape
        out = xp.empty((b, t, heads, d), q.dtype)
        stats = xp.empty((b, heads, t, 1), _stats_dtype(q.dtype))
        laid_out = out.transpose(0, 2, 1, 3)
        try:    # backward's graph too, before anything runs (FusedCausalAttention.forward)
            _graph(True, (q, k, v, laid_out, laid_out, stats) + _grouped_grads(xp, q, k)[1], scale)
            run_graph(False, (q, k, v, laid_out, stats), scale)
        except Unsupported:
            unsupported.add(_grouped_key(q, k))
            raise
        ctx.scale, ctx.widen = scale, widen
        ctx.save_for_backward(q, k, v, out, stats)
        return laid_out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, stats = ctx.kept       # as kept: cuDNN reads the 16-bit arrays themselves
        xp = get_array_module(g)
        d_out = g if g.dtype == q.dtype else _sixteen_bit(g, precision.format_of(q.dtype))
        buffer, grads = _grouped_grads(xp, q, k)
        run_graph(True, (q, k, v, out.transpose(0, 2, 1, 3), d_out, stats) + grads, ctx.scale)
        if ctx.widen:       # one kernel for the three gradients, whose 16-bit copy is the buffer
            wide = precision.to_float32(buffer)
            remember_16_bit_copy(wide, buffer)
            grads = _grouped_views(wide, q.shape[1], k.shape[1])
        return grads


def _grouped_grads(xp, q, k):
    """(one buffer (b, t, heads + 2 groups, d) of q's dtype, the views dq, dk, dv of it laid out as
    q, k and v)."""
    b, heads, t, d = q.shape
    groups = k.shape[1]
    buffer = xp.empty((b, t, heads + 2 * groups, d), q.dtype)
    return buffer, _grouped_views(buffer, heads, groups)


def _grouped_views(buffer, heads, groups):
    return tuple(buffer[:, :, start:stop].transpose(0, 2, 1, 3)
                 for start, stop in ((0, heads), (heads, heads + groups), (heads + groups, heads + 2 * groups)))


def _grouped_key(q, k):
    """What `unsupported` remembers of a grouped attention cuDNN refused: the shapes and dtype."""
    return (q.shape, k.shape, q.dtype.name)
