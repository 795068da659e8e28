"""--device gpu on a machine where CuPy imports but CUDA does not work: one sentence, not the raw
CUDARuntimeError of CuPy's first CUDA call (CuPy imports fine without a driver)."""
import sys

import pytest

from fakes.fake_cupy import CUDARuntimeError, FakeCupy
from npmegatron.autograd import InputError
from npmegatron.autograd.backend import array_module_for


@pytest.mark.parametrize("devices,detail", [
    (CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient"),
     " (CUDARuntimeError: cudaErrorInsufficientDriver"),
    (0, "; check nvidia-smi")])
def test_gpu_without_a_working_driver_is_one_sentence(monkeypatch, devices, detail):
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy(devices=devices))
    with pytest.raises(InputError) as error:
        array_module_for("gpu")
    message = str(error.value)
    assert message.startswith("device 'gpu' needs a CUDA driver and a visible GPU, and CuPy found none")
    assert detail in message and message.endswith("or use the CPU")


def test_gpu_with_a_device_gives_cupy(monkeypatch):
    fake = FakeCupy(devices=2)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert array_module_for("gpu") is fake
