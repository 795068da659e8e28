"""--tf32: refused off the GPU or outside float32, and on the GPU it reaches the float32 compute
type CuPy's matmuls read (cupy/_core/_routines_linalg.pyx), checked here with a stand-in `cupy`."""
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from npmegatron import model as model_module
from npmegatron.autograd import InputError
from npmegatron.autograd import gemm
from npmegatron.autograd.gemm import enable_tf32
from npmegatron.config import GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = dict(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16,
            max_position_embeddings=8)


@pytest.fixture
def fake_cupy(monkeypatch):
    """`cupy._core.set_compute_type` and `_routines_linalg.COMPUTE_TYPE_TF32` (7, as in CuPy's
    _routines_linalg.pxd), recording each call."""
    calls = []
    monkeypatch.setitem(gemm._settings, "tf32", False)      # restored after the test
    cupy, core, linalg = (types.ModuleType(n) for n in ("cupy", "cupy._core",
                                                         "cupy._core._routines_linalg"))
    linalg.COMPUTE_TYPE_TF32 = 7
    core._routines_linalg = linalg
    core.set_compute_type = lambda dtype, compute_type: calls.append((np.dtype(dtype), compute_type))
    cupy._core = core
    for name, module in (("cupy", cupy), ("cupy._core", core), ("cupy._core._routines_linalg", linalg)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cpu", "float64"), ("gpu", "float64")])
def test_tf32_is_refused_off_the_gpu_or_outside_float32(device, dtype):
    with pytest.raises(InputError, match=f"tf32 is for float32 matmuls on the GPU, but this run has "
                                         f"device {device} and dtype {dtype}"):
        GPTConfig(device=device, dtype=dtype, tf32=True)


def test_tf32_refusal_on_the_command_line_is_one_sentence():
    result = subprocess.run([sys.executable, "scripts/train.py", "--tf32"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(lines) == 1 and "--tf32 is for float32 matmuls on the GPU" in lines[0], result.stderr


def test_enable_tf32_sets_cupys_float32_compute_type(fake_cupy):
    enable_tf32()
    assert fake_cupy == [(np.dtype(np.float32), 7)] and gemm._settings["tf32"]


@pytest.mark.parametrize("tf32", [True, False])
def test_a_gpu_model_with_tf32_sets_it_and_one_without_leaves_cupy_alone(tf32, fake_cupy, monkeypatch):
    monkeypatch.setattr(model_module, "array_module_for", lambda device: np)   # no GPU here
    model_module.GPT(GPTConfig(device="gpu", tf32=tf32, **TINY))
    assert fake_cupy == ([(np.dtype(np.float32), 7)] if tf32 else [])
