"""gradcheck on gradients that live on a GPU: they refuse numpy.asarray (as CuPy arrays do) and
are fetched with .get(). A host-only stand-in plays the CuPy array, so no GPU is needed."""
import importlib

import numpy
import pytest

from npmegatron.autograd import Tensor, gradcheck
# The package re-exports the function under the module's name: fetch the module itself.
gradcheck_module = importlib.import_module("npmegatron.autograd.gradcheck")


class DeviceArray:
    """Refuses implicit conversion like cupy.ndarray; .get() copies to the host."""

    def __init__(self, host):
        self.host = host

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed")

    def get(self):
        return self.host.copy()


def test_gradcheck_reads_gradients_with_get(monkeypatch):
    real_backward = gradcheck_module.backward

    def backward_to_device(outputs, grads):
        real_backward(outputs, grads)
        x.grad = DeviceArray(x.grad)

    monkeypatch.setattr(gradcheck_module, "backward", backward_to_device)
    x = Tensor(numpy.linspace(-1.0, 1.0, 6).reshape(2, 3), requires_grad=True)
    assert gradcheck(lambda t: t * t, [x]) < 1e-6


def test_stand_in_refuses_asarray():
    with pytest.raises(TypeError):
        numpy.asarray(DeviceArray(numpy.zeros(2)))
