"""A strict stand-in for nvidia-cudnn-frontend's `cudnn` module (its Python graph API), for the
scaled-dot-product attention graphs, over the strict CuPy stand-in's device memory.

It takes the calls the real package takes, by the same names and keywords: `pygraph(io_data_type,
intermediate_data_type, compute_data_type, handle)`, `graph.tensor(name, dim, stride, data_type)`,
`graph.sdpa(q, k, v, attn_scale, generate_stats, diagonal_alignment, diagonal_band_right_bound,
...)` -> [o, stats] (k and v may have fewer heads than q: grouped-query attention),
`graph.sdpa_backward(q, k, v, o, dO, stats, ...)` -> [dQ, dK, dV],
`tensor.set_output(True).set_dim(...).set_stride(...).set_data_type(...)`, the build steps in
their order (validate, build_operation_graph, create_execution_plans, check_support, build_plans),
`get_workspace_size()` and `execute(variant_pack, workspace, handle)`, with `create_handle()` and
`set_stream(handle, stream)`.

And it is strict where the plumbing can be wrong: a tensor's dims and strides (in elements) are
read at the device address the variant pack gives, exactly as the library would read them, so a
wrong stride, offset or layout gives wrong numbers; an address must lie inside a live allocation
of the handle's device, with room for every element the strides reach; every graph tensor must be
in the pack; the workspace must be at least get_workspace_size() bytes (it is left holding
garbage); the handle's stream must be the current stream at execute; build steps out of order,
dropout, other masks, a head dimension that is not a multiple of 8, or outputs without dims are
refused. Each execute is one recorded launch ("cudnn").

It computes the exact result in float64 from the operands' values and rounds it to each output's
dtype. Unlike cuDNN (16-bit operands only) it also takes FLOAT and DOUBLE operands, so the
plumbing can be held to the float64 reference.
"""
import ctypes
import enum

import cupy
import numpy
from cupy import _core, _strict

__version__ = "1.32.0"


class data_type(enum.Enum):
    NOT_SET = 0
    FLOAT = 1
    DOUBLE = 2
    HALF = 3
    BFLOAT16 = 4
    INT32 = 5
    INT64 = 6
    UINT8 = 7


class heur_mode(enum.Enum):
    A = 0
    B = 1
    FALLBACK = 2


class diagonal_alignment(enum.Enum):
    TOP_LEFT = 0
    BOTTOM_RIGHT = 1


class cudnnGraphNotSupportedError(RuntimeError):
    pass


def _numpy_dtype(t):
    if t is data_type.BFLOAT16:
        import ml_dtypes
        return numpy.dtype(ml_dtypes.bfloat16)
    return numpy.dtype({data_type.FLOAT: numpy.float32, data_type.DOUBLE: numpy.float64,
                        data_type.HALF: numpy.float16, data_type.INT32: numpy.int32,
                        data_type.INT64: numpy.int64, data_type.UINT8: numpy.uint8}[t])


def backend_version():
    return 92400


class Handle:
    def __init__(self):
        self.device = _strict.current_device()
        self.stream = 0


def create_handle():
    return Handle()


def set_stream(handle, stream):
    if not isinstance(handle, Handle):
        raise TypeError(f"cudnn.set_stream expects a cudnn.Handle, got {type(handle).__name__}")
    handle.stream = int(stream)


def destroy_handle(handle):
    handle.stream = None


class tensor:
    """A graph tensor: name, dims and strides in elements, data type, output or not."""

    def __init__(self, name, dim, stride, dtype, uid):
        self.name, self.dim, self.stride, self.data_type, self.uid = name, dim, stride, dtype, uid
        self.is_output = False

    def set_output(self, value):
        self.is_output = bool(value)
        return self

    def set_dim(self, dim):
        self.dim = [int(n) for n in dim]
        return self

    def set_stride(self, stride):
        self.stride = [int(s) for s in stride]
        return self

    def set_data_type(self, value):
        self.data_type = value
        return self

    def set_name(self, name):
        self.name = name
        return self

    def get_dim(self):
        return list(self.dim or [])

    def get_stride(self):
        return list(self.stride or [])

    def get_data_type(self):
        return self.data_type

    def get_uid(self):
        return self.uid

    def __repr__(self):
        return f"cudnn.tensor({self.name!r}, dim={self.dim}, stride={self.stride}, {self.data_type.name})"


_STEPS = ("validate", "build_operation_graph", "create_execution_plans", "check_support", "build_plans")
_UNSUPPORTED = ("bias", "block_mask", "use_alibi_mask", "use_padding_mask", "seq_len_q", "seq_len_kv",
                "diagonal_band_left_bound", "paged_attention_k_table", "paged_attention_v_table", "rng_dump")


class pygraph:
    def __init__(self, io_data_type=data_type.NOT_SET, intermediate_data_type=data_type.NOT_SET,
                 compute_data_type=data_type.NOT_SET, handle=None, name=""):
        self.io_data_type, self.handle, self.name = io_data_type, handle, name
        self.tensors, self.node, self.done = [], None, []

    def tensor(self, dim, stride=None, data_type=data_type.NOT_SET, is_virtual=False, is_pass_by_value=False,
               name="", **unsupported):
        if is_virtual or is_pass_by_value or unsupported:
            raise NotImplementedError("the stand-in takes device tensors with dims, strides and a type")
        if stride is None or len(stride) != len(dim):
            raise ValueError(f"tensor {name!r}: give a stride per dim, got dim {dim} and stride {stride}")
        if data_type is globals()["data_type"].NOT_SET:
            data_type = self.io_data_type
        t = tensor(name or f"tensor_{len(self.tensors)}", [int(n) for n in dim], [int(s) for s in stride],
                   data_type, len(self.tensors) + 1)
        self.tensors.append(t)
        return t

    def _output(self, name, dtype):
        t = tensor(name, None, None, dtype, len(self.tensors) + 1)
        self.tensors.append(t)
        return t

    def _check_mask(self, kwargs, dropout, alignment, right_bound):
        given = [k for k in _UNSUPPORTED if kwargs.get(k) not in (None, False)]
        if given or dropout is not None:
            raise NotImplementedError(f"the stand-in computes causal attention only, not {given or ['dropout']}")
        if alignment is not diagonal_alignment.TOP_LEFT or right_bound not in (None, 0):
            raise NotImplementedError("the stand-in takes a TOP_LEFT diagonal with right bound 0 or none")
        return right_bound == 0

    def sdpa(self, q, k, v, attn_scale=None, generate_stats=None, diagonal_alignment=diagonal_alignment.TOP_LEFT,
             diagonal_band_right_bound=None, dropout=None, compute_data_type=data_type.NOT_SET, name="", **kwargs):
        if self.node is not None:
            raise RuntimeError("the stand-in holds one SDPA operation per graph")
        causal = self._check_mask(kwargs, dropout, diagonal_alignment, diagonal_band_right_bound)
        o = self._output(name + "::O", self.io_data_type)
        stats = self._output(name + "::Stats", data_type.FLOAT) if generate_stats else None
        self.node = ("forward", (q, k, v), (o, stats), _scale(attn_scale), causal)
        return [o, stats]

    def sdpa_backward(self, q, k, v, o, dO, stats, attn_scale=None, diagonal_alignment=diagonal_alignment.TOP_LEFT,
                      diagonal_band_right_bound=None, dropout=None, use_deterministic_algorithm=False,
                      compute_data_type=data_type.NOT_SET, name="", **kwargs):
        if self.node is not None:
            raise RuntimeError("the stand-in holds one SDPA operation per graph")
        causal = self._check_mask(kwargs, dropout, diagonal_alignment, diagonal_band_right_bound)
        grads = [self._output(name + "::" + n, self.io_data_type) for n in ("dQ", "dK", "dV")]
        self.node = ("backward", (q, k, v, o, dO, stats), tuple(grads), _scale(attn_scale), causal)
        return grads

    def _step(self, step):
        expected = _STEPS[len(self.done)] if len(self.done) < len(_STEPS) else None
        if step != expected:
            raise RuntimeError(f"graph.{step}() called after {self.done or 'nothing'}; the order is {_STEPS}")
        self.done.append(step)

    def validate(self):
        self._step("validate")
        if self.node is None:
            raise RuntimeError("graph.validate(): the graph has no operation")
        kind, inputs, outputs, _, _ = self.node
        q, k, v = inputs[:3]
        for t in inputs + tuple(o for o in outputs if o is not None):
            if t.dim is None or t.stride is None or len(t.dim) != 4 or len(t.stride) != 4:
                raise ValueError(f"{t!r}: SDPA tensors are 4-D (b, h, s, d) with dims and strides set")
        b, h, s_q, d = q.dim
        # grouped-query attention: k and v may have fewer heads, each serving h // h_k query heads
        if (k.dim != v.dim or k.dim[0] != b or h % k.dim[1] or k.dim[3] != d
                or (kind == "forward" and q.dim[2] != k.dim[2])):
            raise ValueError(f"q {q.dim}, k {k.dim}, v {v.dim} do not make one self-attention")
        if d % 8:
            raise cudnnGraphNotSupportedError(f"head dimension {d} is not a multiple of 8")
        expected = ([q.dim, [b, h, s_q, 1]] if kind == "forward" else [q.dim, k.dim, v.dim])
        for t, dims in zip(outputs, expected):
            if t is not None and (not t.is_output or t.dim != dims):
                raise ValueError(f"{t!r}: an output must be set_output(True) with dims {dims}")
        if kind == "backward" and (inputs[3].dim != q.dim or inputs[4].dim != q.dim or inputs[5].dim != [b, h, s_q, 1]):
            raise ValueError("o and dO must have q's dims, stats (b, h, s_q, 1)")

    def build_operation_graph(self):
        self._step("build_operation_graph")

    def create_execution_plans(self, heuristics=None):
        self._step("create_execution_plans")
        if not heuristics:
            raise ValueError("create_execution_plans needs a list of heur_mode")

    def check_support(self):
        self._step("check_support")
        stats = self.node[2][1] if self.node[0] == "forward" else self.node[1][5]
        if stats is not None and stats.data_type not in (data_type.FLOAT, data_type.DOUBLE):
            raise cudnnGraphNotSupportedError(f"softmax stats are FLOAT, not {stats.data_type.name}")

    def build_plans(self, *args, **kwargs):
        self._step("build_plans")

    def build(self, heuristics=None):
        for step in _STEPS[len(self.done):]:
            getattr(self, step)(*([heuristics] if step == "create_execution_plans" else []))

    def get_workspace_size(self):
        if len(self.done) < len(_STEPS):
            raise RuntimeError("get_workspace_size() before build_plans()")
        b, h, s_q, d = self.node[1][0].dim
        # backward accumulates dQ in float32 and keeps a row sum of dO * O per query
        return 0 if self.node[0] == "forward" else b * h * s_q * (d + 1) * 4

    @_strict.device_work
    def execute(self, variant_pack, workspace, handle=None, **unsupported):
        if len(self.done) < len(_STEPS) or unsupported:
            raise RuntimeError("execute() before build_plans(), or with arguments the stand-in does not take")
        handle = handle or self.handle
        if not isinstance(handle, Handle) or handle.device != _strict.current_device():
            raise RuntimeError("execute needs the cudnn.Handle of the current device")
        # (a replay runs where the graph was captured, whatever the handle was set to since)
        if not _strict.replaying() and handle.stream != cupy.cuda.get_current_stream().ptr:
            raise RuntimeError(f"the handle's stream ({handle.stream:#x}) is not the current stream "
                               f"({cupy.cuda.get_current_stream().ptr:#x}): call cudnn.set_stream first")
        kind, inputs, outputs, scale, causal = self.node
        needed = [t for t in inputs + outputs if t is not None]
        missing = [t.name for t in needed if t not in variant_pack]
        if missing:
            raise KeyError(f"the variant pack lacks {missing}")
        size = self.get_workspace_size()
        if size:
            _view(_pointer(workspace), [size], [1], numpy.dtype(numpy.uint8), handle)[...] = 0xA5
        arrays = {t.uid: _view(_pointer(variant_pack[t]), t.dim, t.stride, _numpy_dtype(t.data_type), handle)
                  for t in needed}
        _strict.launch("cudnn", f"sdpa_{kind}", read=[arrays[t.uid] for t in inputs if t is not None],
                       written=[arrays[t.uid] for t in outputs if t is not None],
                       shape=tuple(inputs[0].dim), dtype=self.io_data_type.name)
        values = [arrays[t.uid].astype(numpy.float64) for t in inputs if t is not None]
        results = (_forward if kind == "forward" else _backward)(values, scale, causal)
        for t, r in zip(outputs, results):
            if t is not None:
                arrays[t.uid][...] = r.astype(arrays[t.uid].dtype)


def _scale(attn_scale):
    if attn_scale is not None and not isinstance(attn_scale, (int, float)):
        raise NotImplementedError("the stand-in takes the scale as a float")
    return 1.0 if attn_scale is None else float(attn_scale)


def _pointer(value):
    if isinstance(value, int):
        return value
    if isinstance(value, cupy.ndarray):
        return value.data.ptr
    raise TypeError(f"a variant pack holds device addresses or cupy arrays, not {type(value).__name__}")


def _view(ptr, dim, stride, dtype, handle):
    """The elements a tensor of these dims and strides reads at `ptr`: a NumPy view of the live
    allocation there (which must hold every element the strides reach)."""
    if any(s < 0 for s in stride):
        raise ValueError(f"negative strides {stride}")
    span = (1 + sum((n - 1) * s for n, s in zip(dim, stride))) * dtype.itemsize
    entry = _core.find_buffer(ptr, span)
    if entry is None:
        raise ValueError(f"{span} bytes at {ptr:#x} (dims {dim}, strides {stride}, {dtype}) are not inside one "
                         "live device allocation")
    if entry.device != handle.device:
        raise ValueError(f"the buffer at {ptr:#x} is on device {entry.device}, the handle's on {handle.device}")
    raw = numpy.frombuffer((ctypes.c_ubyte * span).from_address(ptr), numpy.uint8).view(dtype)
    return numpy.lib.stride_tricks.as_strided(raw, shape=dim, strides=[s * dtype.itemsize for s in stride])


def _masked_scores(q, k, scale, causal):
    s = scale * (q @ k.swapaxes(-1, -2))
    if causal:
        s_q, s_k = s.shape[-2:]
        s[..., numpy.triu(numpy.ones((s_q, s_k), bool), 1)] = -numpy.inf
    return s


def _grouped(q, k, v):
    """k and v with each key/value head repeated for the query heads it serves (grouped-query
    attention; h_k = h: as they are)."""
    per_group = q.shape[1] // k.shape[1]
    return numpy.repeat(k, per_group, axis=1), numpy.repeat(v, per_group, axis=1)


def _summed_over_groups(grad, heads):
    """The gradient of repeated key/value heads summed back onto each group's head."""
    b, h, s, d = grad.shape
    return grad.reshape(b, heads, h // heads, s, d).sum(axis=2)


def _forward(values, scale, causal):
    q, k, v = values
    k, v = _grouped(q, k, v)
    s = _masked_scores(q, k, scale, causal)
    top = s.max(axis=-1, keepdims=True)
    e = numpy.exp(s - top)
    total = e.sum(axis=-1, keepdims=True)
    return (e / total) @ v, top + numpy.log(total)


def _backward(values, scale, causal):
    q, k, v, o, d_o, stats = values
    groups = k.shape[1]
    k, v = _grouped(q, k, v)
    p = numpy.exp(_masked_scores(q, k, scale, causal) - stats)
    d_p = d_o @ v.swapaxes(-1, -2)
    d_s = p * (d_p - (d_o * o).sum(axis=-1, keepdims=True))
    return (scale * d_s @ k, _summed_over_groups(scale * d_s.swapaxes(-1, -2) @ q, groups),
            _summed_over_groups(p.swapaxes(-1, -2) @ d_o, groups))
