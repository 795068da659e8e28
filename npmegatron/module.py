"""Module: a container of parameters and sub-modules, with seeded, name-keyed initialisation.

Each parameter is drawn from a generator seeded by (seed, its full name), so the weights do not
depend on construction order: a model split across ranks draws exactly what the serial one does.
"""
import zlib

import numpy

from .autograd import Tensor


class Module:
    """Parameters are Tensor attributes with requires_grad; `inits` maps their names to how they
    start: a float is N(0, std), or 'zeros' / 'ones'."""

    training = True

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def named_modules(self, prefix=""):
        yield prefix, self
        for name, value in vars(self).items():
            children = value if isinstance(value, (list, tuple)) else [value]
            for i, child in enumerate(children):
                if isinstance(child, Module):
                    label = f"{name}.{i}" if isinstance(value, (list, tuple)) else name
                    yield from child.named_modules(f"{prefix}{label}.")

    def named_parameters(self):
        for prefix, module in self.named_modules():
            for name, value in vars(module).items():
                if isinstance(value, Tensor) and value.requires_grad:
                    yield prefix + name, value

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

    def initialize(self, seed):
        """Fill every parameter from its own seeded stream, drawn in float64 then cast."""
        for prefix, module in self.named_modules():
            for name, spec in getattr(module, "inits", {}).items():
                param = getattr(module, name)
                full = param.shape
                if spec == "zeros":
                    host = numpy.zeros(full)
                elif spec == "ones":
                    host = numpy.ones(full)
                else:
                    rng = numpy.random.default_rng([seed, zlib.crc32((prefix + name).encode())])
                    host = rng.normal(0.0, spec, full)
                param.data[...] = param.xp.asarray(host.astype(param.dtype))


def parameter(xp, shape, dtype):
    """An uninitialised trainable tensor; Module.initialize gives it values."""
    return Tensor(xp.empty(shape, dtype=dtype), requires_grad=True)
