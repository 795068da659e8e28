"""Module: a container of parameters and sub-modules, with seeded, name-keyed initialisation.

Each parameter is drawn whole (its master shape) from a generator seeded by (seed, its full name)
and then sliced to this rank's part, so weights depend neither on construction order nor on the
tensor-parallel size: TP=1 and TP=k start from identical parameters (Megatron's CPU init path).
"""
import weakref
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy

from .autograd import Tensor, precision


@dataclass
class ParamSpec:
    """How a parameter starts and how it is laid out over the tensor-parallel ranks."""
    init: object                        # 'zeros', 'ones', or the std of N(0, std)
    shape: tuple                        # the master (unsharded, unpadded) shape
    index: tuple = ()                   # this rank's slice of the (padded) master
    tp_axis: Optional[int] = None       # axis split over TP ranks; None: replicated
    padded_rows: Optional[int] = None   # master padded with zero rows to this many (vocabulary)
    sp_partial: bool = False            # under sequence parallelism each rank holds a partial grad
    expert: bool = False                # an MoE expert's: split over the expert-parallel ranks

    def master(self, seed, name):
        if self.init == "zeros":
            host = numpy.zeros(self.shape)
        elif self.init == "ones":
            host = numpy.ones(self.shape)
        else:
            rng = numpy.random.default_rng([seed, zlib.crc32(name.encode())])
            host = rng.normal(0.0, self.init, self.shape)
        return pad_master(host, self)


class Module:
    """Parameters are Tensor attributes with requires_grad, each described in `self.specs`.
    Sub-modules are Module attributes, or lists, tuples or dicts of them."""

    training = True

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def children(self):
        """(name, sub-module) pairs; a list or tuple names its items by index, a dict by key (GPT's
        layers by their global number). A subclass may give "" to list a child under its own
        prefix."""
        for name, value in vars(self).items():
            if isinstance(value, dict):
                items = [(f"{name}.{key}", child) for key, child in value.items()]
            elif isinstance(value, (list, tuple)):
                items = [(f"{name}.{i}", child) for i, child in enumerate(value)]
            else:
                items = [(name, value)]
            yield from ((label, child) for label, child in items if isinstance(child, Module))

    def named_modules(self, prefix="", seen=None):
        """(name prefix, module) for this module and each below it, once: a module held twice
        (a word embedding tied across pipeline stages) keeps its first name."""
        seen = set() if seen is None else seen
        if id(self) in seen:
            return
        seen.add(id(self))
        yield prefix, self
        for label, child in self.children():
            yield from child.named_modules(f"{prefix}{label}." if label else prefix, seen)

    def named_parameters(self):
        for prefix, module in self.named_modules():
            for name, value in vars(module).items():
                if isinstance(value, Tensor) and value.requires_grad:
                    yield prefix + name, value

    def named_specs(self):
        """(full name, parameter, ParamSpec) for every parameter."""
        for prefix, module in self.named_modules():
            for name, spec in getattr(module, "specs", {}).items():
                yield prefix + name, getattr(module, name), spec

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    def train(self, mode=True):
        for _, module in self.named_modules():
            module.training = mode
        return self

    def eval(self):
        return self.train(False)

    def initialize(self, seed, storage=None):
        """Fill every parameter with its slice of its master weight, drawn in float64, and
        rounded to the 16-bit `storage` format under mixed precision."""
        for name, param, spec in self.named_specs():
            set_slice(param, spec.master(seed, name)[spec.index], storage)


def pad_master(host, spec):
    """A master tensor (spec.shape) with the padding rows its layout adds (the vocabulary's)."""
    if spec.padded_rows is None or spec.padded_rows == host.shape[0]:
        return host
    return numpy.concatenate([host, numpy.zeros((spec.padded_rows - host.shape[0],) + host.shape[1:], host.dtype)])


def load_masters(module, masters, storage=None):
    """Set every parameter to its slice of a whole, unpadded master tensor: `masters` maps each
    full parameter name (named_specs') to an array of its spec's shape."""
    for name, param, spec in module.named_specs():
        set_slice(param, pad_master(numpy.asarray(masters[name]), spec)[spec.index], storage)


def set_slice(param, host, storage=None):
    """The parameter becomes its slice `host` of the master (a host array), in its dtype and on
    its device, rounded to the 16-bit `storage` format under mixed precision."""
    param.data[...] = param.xp.asarray(host.astype(param.dtype))
    precision.round_(param.data, storage)


def parameter(xp, shape, dtype, decayed=True):
    """An uninitialised trainable tensor; Module.initialize gives it values. decayed=False: a
    matrix AdamW spares weight decay all the same (weight_decayed), such as a stack of biases,
    an expert a row."""
    param = Tensor(xp.empty(shape, dtype=dtype), requires_grad=True)
    param.is_parameter = True       # its gradient adds up in float32 under --fp16/--bf16
    if not decayed:
        _SPARED_MATRICES[id(param)] = param
    return param


#: The matrices parameter(decayed=False) made, by id, for as long as each lives.
_SPARED_MATRICES = weakref.WeakValueDictionary()


def weight_decayed(param):
    """Whether AdamW decays `param`: its matrices, not biases, norms' gains or a stack of biases
    (Megatron decays neither a 1-D parameter nor one named *.bias)."""
    return param.ndim >= 2 and _SPARED_MATRICES.get(id(param)) is not param
