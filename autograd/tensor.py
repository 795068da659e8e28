"""The Tensor: an array plus the autograd bookkeeping (its grad and the node that made it)."""
import contextlib

import numpy

from . import engine
from .backend import get_array_module, to_numpy

_grad_enabled = True


def is_grad_enabled():
    return _grad_enabled


@contextlib.contextmanager
def no_grad():
    """Inside this block ops record nothing on the tape (evaluation, generation, optimizer steps)."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = previous


@contextlib.contextmanager
def enable_grad():
    """Inside this block ops record on the tape again, even within no_grad (a recomputation in
    backward records the graph it then walks)."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, True
    try:
        yield
    finally:
        _grad_enabled = previous


class Tensor:
    """An array of NumPy or CuPy with an optional gradient.

    `grad_fn` is the tape node that produced it (None for leaves); `output_index` says which of
    that node's outputs it is. The node refers to its inputs' nodes, never to this tensor, so an
    intermediate's data is freed as soon as neither the user nor a saved-for-backward slot holds it.
    """

    __slots__ = ("data", "requires_grad", "grad", "grad_fn", "output_index", "_accumulator", "name",
                 "main_grad", "is_parameter", "__weakref__")

    def __init__(self, data, requires_grad=False, name=None):
        if isinstance(data, Tensor):
            data = data.data
        if not hasattr(data, "__array_function__") and not hasattr(data, "__cuda_array_interface__"):
            data = numpy.asarray(data)
        self.data = data
        self.requires_grad = requires_grad
        self.grad = None
        # A leaf's place in a flat gradient buffer (Megatron's main_grad; set by the data-parallel
        # buckets on a GPU): backward may write the gradient there itself (engine.py)
        self.main_grad = None
        # A model's trainable weight (npmegatron.module.parameter): under 16-bit storage its
        # gradient is not rounded to the 16-bit grid but adds up in float32 as the Functions compute
        # it, as Megatron's gradient-accumulation fusion sums weight gradients into main_grad
        # (precision.py); any other leaf's gradient (a pipeline stage's input) is an activation's
        self.is_parameter = False
        self.grad_fn = None
        self.output_index = 0
        self._accumulator = None
        self.name = name

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    xp = property(lambda self: get_array_module(self.data))

    def backward(self, grad=None):
        engine.backward([self], None if grad is None else [grad])

    def item(self):
        return self.data.item()

    def numpy(self):
        return to_numpy(self.data)

    def zero_grad(self):
        self.grad = None

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        extra = f", grad_fn={self.grad_fn.name}" if self.grad_fn is not None else (
            ", requires_grad=True" if self.requires_grad else "")
        label = f"{self.name}: " if self.name else ""
        return f"Tensor({label}shape={self.shape}, dtype={self.dtype}{extra})"
