"""The same code on CuPy arrays: runs where a GPU is present, skips cleanly elsewhere."""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError
except Exception:
    pytest.skip("no CUDA device", allow_module_level=True)

from npmegatron.model import GPT, GPTConfig  # noqa: E402


def test_gpt_on_gpu_equals_cpu_in_float64():
    kw = dict(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32,
              max_position_embeddings=8, dtype="float64", hidden_dropout=0.0, attention_dropout=0.0)
    cpu, gpu = GPT(GPTConfig(**kw)), GPT(GPTConfig(**kw, device="gpu"))
    ids = np.random.default_rng(0).integers(0, 32, (2, 9))
    _, loss_cpu = cpu(ids[:, :-1], ids[:, 1:])
    _, loss_gpu = gpu(ids[:, :-1], ids[:, 1:])
    loss_cpu.backward()
    loss_gpu.backward()
    assert loss_gpu.item() == pytest.approx(loss_cpu.item(), rel=1e-12)
    for (name, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
        np.testing.assert_allclose(cupy.asnumpy(b.grad), a.grad, rtol=1e-9, atol=1e-12, err_msg=name)
