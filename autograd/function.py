"""Function: forward and backward on plain arrays, side by side, and the tape node it records.

As in Chainer and PyTorch, a Function saves only what it asks for (`ctx.save_for_backward`) and
reads `ctx.needs_input_grad` so it never computes a gradient nobody wants.
"""
import weakref

import numpy

from . import precision as _precision
from . import profile as _profile
from . import tensor as _tensor
from .backend import get_array_module
from .graph import AccumulateGrad, edge_of
from .tensor import Tensor


class Context:
    """What one call of a Function keeps for its backward."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad
        self.kept = ()              # the saved arrays as kept: 16-bit where `in_16_bit` says
        self.grid_indices = ()
        self.in_16_bit = ()             # indices of `kept` held in 16 bits
        self.fresh_grads = ()
        self.pending_grads = None
        self.pending_owned = ()     # per input: whether its pending gradient is the walk's alone
        self.summed_pending = ()
        self.grad_destinations = None

    def save_for_backward(self, *arrays):
        self.kept, self.grid_indices, self.in_16_bit = arrays, (), ()

    def on_grid(self, *indices):
        """The saved arrays at these indices lie on the 16-bit grid under --fp16/--bf16 (inputs or
        outputs of this Function, which are rounded): on a GPU they are kept as 16-bit arrays, the
        same numbers in half the bytes (precision.py), and backward reads them back in float32."""
        self.grid_indices = indices

    @property
    def saved(self):
        """The saved arrays, those kept in 16 bits cast back to float32 (once, on first reading)."""
        if self.in_16_bit:
            self.kept = tuple(_precision.to_float32(a) if i in self.in_16_bit else a
                              for i, a in enumerate(self.kept))
            self.in_16_bit = ()
        return self.kept

    def keep_16_bit(self, fmt):
        """Keep the on-grid saved arrays that are float32 device arrays as 16-bit arrays."""
        chosen = tuple(i for i in self.grid_indices if i < len(self.kept) and _keepable(self.kept[i]))
        self.kept = tuple(kept_16_bit_copy(a, fmt) if i in chosen else a for i, a in enumerate(self.kept))
        self.in_16_bit = chosen

    def mark_fresh(self, *indices):
        """Backward's gradients for these inputs are arrays it made and keeps no other reference
        to (a GEMM's or a reduction's result, not a view of an incoming gradient): a leaf may take
        one as its .grad without the copy (engine.py)."""
        self.fresh_grads = indices

    def destination(self, index):
        """(array, accumulate) where backward may put input `index`'s gradient itself, or None:
        the leaf's main_grad, to be overwritten (accumulate False) or added to (engine.py).
        Backward then returns that array as the gradient."""
        return self.grad_destinations[index] if self.grad_destinations else None

    def owned_pending(self, index):
        """Input `index`'s pending gradient when no one but the backward walk holds it: backward
        may add its own gradient into that array in place and return it (with sum_pending)."""
        if self.pending_grads and index < len(self.pending_owned) and self.pending_owned[index]:
            return self.pending_grads[index]
        return None

    def sum_pending(self, *indices):
        """Backward's gradients for these inputs already include `pending_grads` (the gradient
        each input holds from its other consumers when this backward runs, offered to Functions
        that set `adds_pending_grads`): the engine replaces that gradient instead of adding to it,
        which saves the add's launch (LayerNorm's kernel adds the residual path's gradient)."""
        self.summed_pending = indices


#: the 16-bit dtypes (precision._FORMATS_OF's keys): a set, for apply's test of every input
_SIXTEEN_BIT = frozenset(_precision._FORMATS_OF)


def _widened(a):
    """16-bit activation `a` as float32 (exact), for a Function that does not read 16 bits, with
    `a` remembered as its 16-bit copy: a keeping of the widened array finds it, costing nothing."""
    wide = _precision.to_float32(a)
    if wide.flags.c_contiguous and a.flags.c_contiguous:
        _remember_copy(wide, a, _precision.format_of(a.dtype))
    return wide


def _keepable(a):
    return a is not None and getattr(a, "dtype", None) == numpy.float32 and get_array_module(a) is not numpy


#: (pointer, bytes, format) of a C-ordered float32 buffer -> (weak reference to the array owning it,
#: its 16-bit copy): an activation kept by two Functions (attention's output is the projection's
#: input) is cast once and kept once. An entry goes when its array is freed.
_kept_copies = {}


def kept_16_bit_copy(a, fmt):
    """a (float32 on fmt's grid) as a 16-bit array: the copy its rounding made or an earlier keeping
    of the same buffer, where there is one; else one cast. A 16-bit array of fmt is itself."""
    if _precision.format_of(a.dtype) == fmt:
        return a
    if not a.flags.c_contiguous:
        view = _known_view(a, fmt)
        return _precision.to_16_bit(a, fmt) if view is None else view
    copy = _known_copy(a, fmt)
    return _remember_copy(a, _precision.to_16_bit(a, fmt), fmt) if copy is None else copy


def sixteen_bit_form(a, fmt):
    """a as fmt's 16-bit array without a launch: a itself when it is one, the copy its rounding
    made when C-ordered float32 `a` has one; else None (the 16-bit residual stream's kernels read
    a stream that starts as the embedding's rounded float32 output through its copy)."""
    if _precision.format_of(a.dtype) == fmt:
        return a
    return _known_copy(a, fmt) if a.dtype == numpy.float32 and a.flags.c_contiguous else None


def _buffer(a, fmt):
    """(_kept_copies' key of C-ordered `a`'s buffer, the array owning it)."""
    return (a.data.ptr, a.nbytes, fmt), (a if a.base is None else a.base)


def _known_copy(a, fmt):
    """The remembered 16-bit copy of C-ordered `a`'s buffer, shaped as a, or None."""
    key, owner = _buffer(a, fmt)
    entry = _kept_copies.get(key)
    return entry[1].reshape(a.shape) if entry is not None and entry[0]() is owner else None


def _known_view(a, fmt):
    """A view `a` (transposed, strided: grouped attention's keys and values inside the QKV
    projection's output) of a C-ordered array with a remembered 16-bit copy, as the same view of
    that copy; else None."""
    owner = a.base
    copy = _owner_copy(owner, fmt)
    if copy is None:
        return None
    start, ratio = (a.data.ptr - owner.data.ptr) // a.itemsize, a.itemsize // copy.itemsize
    return get_array_module(a).lib.stride_tricks.as_strided(
        copy.reshape(-1)[start:], a.shape, tuple([s // ratio for s in a.strides]))


def _owner_copy(owner, fmt):
    """The remembered 16-bit copy of `owner` (a view's base), where it is C-ordered and has one."""
    if owner is None or not owner.flags.c_contiguous:
        return None
    return _known_copy(owner, fmt)


def remember_16_bit_copy(a, copy):
    """Remember `copy` (16-bit) as the copy of C-ordered float32 `a`, which holds the same numbers
    (a's widening): a's roundings and keepings then find it instead of rounding or casting again."""
    _remember_copy(a, copy, _precision.format_of(copy.dtype))


def _remember_copy(a, copy, fmt):
    """Keep `copy` (a's 16-bit copy) for kept_16_bit_copy while a's buffer lives."""
    key, owner = _buffer(a, fmt)

    def forget(ref, key=key):
        if _kept_copies.get(key, (None,))[0] is ref:
            del _kept_copies[key]

    try:
        _kept_copies[key] = (weakref.ref(owner, forget), copy)
    except TypeError:       # an array type without weak references: no sharing, still exact
        pass
    return copy


def _round(a, fmt, keep_copy):
    """a rounded to fmt's grid (precision.round_); with keep_copy, on a GPU whose 16-bit arrays are
    on, the rounding kernel also makes the 16-bit copy a Linear (or a keeping) would cast next."""
    if not keep_copy or not _precision.kept_in_16_bit(fmt) or not _keepable(a):
        return _precision.round_(a, fmt)
    if a.flags.c_contiguous and _known_copy(a, fmt) is not None:
        return a        # a view of an array already rounded, its copy made: nothing to do
    if _owner_copy(a.base, fmt) is not None:
        return a        # a transposed or strided view into one (a split, a reshape's transpose)
    copy = _precision.round_keeping_copy(a, fmt)
    if copy is not None:
        _remember_copy(a, copy, fmt)
    return a


class Node:
    """One recorded call: the Function, its context, and edges to the nodes of its inputs."""

    def __init__(self, function, ctx, edges, n_outputs):
        self.function = function
        self.ctx = ctx
        self.edges = edges          # per input: (node, output_index) or None
        self.n_outputs = n_outputs
        self.name = function.__name__
        self.storage = None         # the 16-bit format its input gradients are rounded to
        self.fresh_grads = ()       # the last run's ctx.fresh_grads
        self.summed_pending = ()    # the last run's ctx.summed_pending

    def run(self, grads, pending=None, destinations=None):
        """Backward on the output gradients; `pending` (engine.py): the inputs' gradients so far,
        whether the walk alone holds each and whether each is complete, handed to backward as they
        are where no 16-bit rounding of the results follows (it would round their sum), and under
        16-bit storage only where the emulation rounds the sum anyway (_rounded_before_use);
        `destinations`: per input, where backward may write the gradient (Context.destination)."""
        if self.ctx is None:
            raise RuntimeError(f"backward through {self.name} a second time: its saved arrays were "
                               "freed after the first backward; run the forward again")
        if self.storage is None:
            self.ctx.pending_grads, self.ctx.pending_owned = pending[:2] if pending else (None, ())
            self.ctx.grad_destinations = destinations
        elif pending:
            self.ctx.pending_grads = _rounded_before_use(pending, self.edges)
        if self.storage is not None and destinations:
            # the results are rounded below, but a parameter's (its gradient adds up in float32,
            # precision.py): a parameter's main_grad may be written or added to (a GEMM's beta =
            # 1); another leaf's only written (the rounding in place is then its own, where a sum
            # would be rounded whole)
            self.ctx.grad_destinations = tuple(
                None if d is None or (d[1] and not edge[0].leaf.is_parameter) else d
                for d, edge in zip(destinations, self.edges))
        if self.storage is not None and not self.function.reads_16_bit_grads:
            grads = [_precision.to_float32(g) if g is not None and g.dtype in _SIXTEEN_BIT else g for g in grads]
        if _profile._table is not None:
            result = _profile.timed(self.name, 1, lambda: self.function.backward(self.ctx, *grads))
        else:
            result = self.function.backward(self.ctx, *grads)
        self.fresh_grads, self.summed_pending = self.ctx.fresh_grads, self.ctx.summed_pending
        self.ctx = None     # drop saved arrays as soon as they are used
        result = result if isinstance(result, tuple) else (result,)
        if self.storage is not None:    # gradients of 16-bit activations are 16-bit (precision.py)
            rounded = []
            for g, edge in zip(result, self.edges):
                leaf = edge[0].leaf if edge is not None and isinstance(edge[0], AccumulateGrad) else None
                if (leaf is not None and leaf.is_parameter) or _reaches_parameter(edge):
                    rounded.append(g)       # a parameter's gradient: float32 as computed (module doc)
                else:   # with a 16-bit copy for those that flow on to other Functions (not a leaf's)
                    rounded.append(_round(g, self.storage, leaf is None and edge is not None))
            result = tuple(rounded)
        return result


def _rounded_before_use(pending, edges):
    """Under 16-bit storage, per input, the pending 16-bit gradient a Function may add into its
    own rounded gradient (rounding the sum again) where the CPU's emulation makes the same
    numbers: the sum is the input's whole gradient (no other consumer is left) and its producer
    rounds it before any arithmetic (`ctx.rounds_gradient_first`: a residual add, the embedding's
    end), so the float32 sum the engine would make is rounded next anyway; else None."""
    grads, _, complete = pending
    chosen = []
    for g, edge, whole in zip(grads, edges, complete):
        producer = edge[0] if edge is not None else None
        chosen.append(g if g is not None and whole and g.dtype in _SIXTEEN_BIT
                      and getattr(producer, "storage", None) is not None
                      and getattr(producer.ctx, "rounds_gradient_first", False) else None)
    return tuple(chosen) if any(g is not None for g in chosen) else None


def _reaches_parameter(edge):
    """Whether a gradient sent along `edge` reaches parameters through views only (the tied
    output layer's weight is the embedding's transpose, a Transpose node; SwiGLU's weight is its
    gate's and up's, a Concatenate node): it is a parameter's gradient then, and not rounded
    either."""
    while edge is not None and not isinstance(edge[0], AccumulateGrad):
        function = getattr(edge[0], "function", None)
        if getattr(function, "passes_gradient_parts", False):
            return all(_reaches_parameter(part) for part in edge[0].edges)
        if not getattr(function, "passes_gradient_views", False) or len(edge[0].edges) != 1:
            return False
        edge = edge[0].edges[0]
    return edge is not None and edge[0].leaf.is_parameter


class Function:
    """Subclass with static `forward(ctx, *arrays, **params)` and `backward(ctx, *grads)`.

    `backward` returns one gradient per positional input of forward (None where not needed).
    Call through `apply`, which unwraps tensors and records a node when a gradient may be needed.
    Under 16-bit storage (precision.py) outputs are rounded unless `float32_output` is set.
    """

    float32_output = False
    # forward takes 16-bit activations as they are (a GPU's 16-bit residual stream, a 16-bit GEMM
    # output): its kernels read 16 bits and compute in float32. Any other Function gets them widened
    # to float32 first (apply), so a 16-bit array never meets an array library's 16-bit arithmetic.
    reads_16_bit = False
    reads_16_bit_grads = False      # the same of backward's incoming gradients (Node.run widens them)
    adds_pending_grads = False      # backward may add ctx.pending_grads into its results
    writes_grad_destinations = False    # backward may write into ctx.destination(i)

    @staticmethod
    def forward(ctx, *arrays, **params):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError

    @classmethod
    def apply(cls, *inputs, **params):
        # plain loops and module attributes rather than comprehensions and helper calls: this runs
        # for every op, and on a GPU the host issuing them bounds an eager step
        arrays, needs = [], []
        widen = _precision._active is not None and not cls.reads_16_bit
        for x in inputs:
            if isinstance(x, Tensor):
                data = x.data
                if widen and data.dtype in _SIXTEEN_BIT and not x.is_parameter:
                    data = _widened(data)
                arrays.append(data)
                needs.append(x.requires_grad)
            else:
                arrays.append(x)
                needs.append(False)
        ctx = Context(tuple(needs))
        if _profile._table is not None:
            out = _profile.timed(cls.__name__, 0, lambda: cls.forward(ctx, *arrays, **params))
        else:
            out = cls.forward(ctx, *arrays, **params)
        record = _tensor._grad_enabled and any(needs)
        outs = out if isinstance(out, tuple) else (out,)
        storage = _precision._active
        if storage is not None and not cls.float32_output:
            outs = tuple([_round(o, storage, record) for o in outs])
        if not record:
            tensors = tuple([Tensor(o, requires_grad=False) for o in outs])
            return tensors if isinstance(out, tuple) else tensors[0]
        if ctx.grid_indices and _precision.kept_in_16_bit():
            ctx.keep_16_bit(storage)        # after the rounding: saved outputs are on the grid now
        node = Node(cls, ctx, tuple([edge_of(x) if needed else None for x, needed in zip(inputs, needs)]), len(outs))
        node.storage = storage
        tensors = []
        for i, o in enumerate(outs):
            t = Tensor(o, requires_grad=True)
            t.grad_fn, t.output_index = node, i
            tensors.append(t)
        return tuple(tensors) if isinstance(out, tuple) else tensors[0]
