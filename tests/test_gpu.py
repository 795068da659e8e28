"""The GPU path against the CPU, in float64: the script to run first on a machine with GPUs
(`pytest tests/test_gpu.py tests/comm/test_comm_gpu.py`). Where CuPy or a GPU is missing it
skips; tests/test_strict_gpu.py runs this very file on the CPU with the strict CuPy stand-in
(tests/fakes/strict_cupy) first on the path, where it also counts host synchronisations.

- the serial GPT's loss and gradients on CuPy equal NumPy's, with MoE layers too;
- every pipeline equality layout (PP 2 and 4, TP, DP, three schedules, overlap on and off,
  uneven layouts, variable lengths, SP) with the pipeline on CuPy equals the serial model;
- the training path at TP = 2 (and TP 2 x PP 2 x DP 2, slow) with sequence parallelism and
  dropout: losses, gradient norms and parameters equal the NumPy run's, a checkpoint resumes
  bitwise, generation gives the same text, each rank on its own GPU, and (stand-in) at most
  HOST_SYNCS_PER_STEP host synchronisations per training step."""
import json

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError
except Exception:
    pytest.skip("no CUDA device", allow_module_level=True)

from helpers import pipeline_cases  # noqa: E402
from npmegatron.model import GPT, GPTConfig  # noqa: E402
from npmegatron.moe import aux_loss  # noqa: E402

STRICT = hasattr(cupy, "_strict")
HOST_SYNCS_PER_STEP = 1     # the loss and the gradient norm, read together (Trainer.train_step)


GPT2_SMALL = dict(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32, max_position_embeddings=8,
                  dtype="float64", hidden_dropout=0.1, attention_dropout=0.1)
#: RMSNorm, rotary embeddings, SwiGLU and grouped-query attention: their chains compiled by
#: cupy.fuse, the rest on CuPy arrays
LLAMA_SMALL = dict(model_family="llama", num_layers=2, hidden_size=16, num_attention_heads=4,
                   group_query_attention=True, num_query_groups=2, ffn_hidden_size=24, vocab_size=32,
                   max_position_embeddings=8, dtype="float64", hidden_dropout=0.0, attention_dropout=0.0)
#: mixture-of-experts layers: the experts' grouped GEMMs (padded, batched over the experts) on CuPy
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.01)


@pytest.mark.parametrize("kw", [GPT2_SMALL, LLAMA_SMALL, {**GPT2_SMALL, **MOE}, {**LLAMA_SMALL, **MOE}],
                         ids=["gpt", "llama", "gpt-moe", "llama-moe"])
def test_gpt_on_gpu_equals_cpu_in_float64(kw):
    cpu, gpu = GPT(GPTConfig(**kw)), GPT(GPTConfig(**kw, device="gpu"))
    ids = np.random.default_rng(0).integers(0, 32, (2, 9))
    aux_loss.take_values()      # MoE losses logged by an earlier test's models (on either device)
    _, loss_cpu = cpu(ids[:, :-1], ids[:, 1:])
    aux_loss.take_values()      # the CPU model's, before the GPU model's
    _, loss_gpu = gpu(ids[:, :-1], ids[:, 1:])
    loss_cpu.backward()
    loss_gpu.backward()
    assert loss_gpu.item() == pytest.approx(loss_cpu.item(), rel=1e-12)
    for (name, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
        np.testing.assert_allclose(cupy.asnumpy(b.grad), a.grad, rtol=1e-9, atol=1e-12, err_msg=name)


def test_context_parallel_ring_on_gpu_equals_the_serial_model(mpirun):
    """The CP ring's key/value blocks as NCCL point-to-point messages (matched in posting order),
    both model families, CP 4 and CP 2 x TP 2."""
    cases = [dict(tp=tp, pp=1, m=2, schedule="1f1b", cp=cp, seq=16, family=family, device="gpu")
             for family in ("gpt2", "llama") for tp, cp in ((1, 4), (2, 2))]
    check_pipeline(mpirun, 4, cases)


def check_pipeline(mpirun, n, cases):
    result = mpirun(n, "ranks/pipeline_parallel.py", args=["check", json.dumps(cases)], timeout=600)
    worst = float(result.stdout.split("worst relative error")[1].split()[0])
    print(f"{n} ranks, {len(cases)} GPU pipeline cases: worst relative error {worst:.2e}")
    assert worst < 1e-10, result


@pytest.mark.slow
def test_two_rank_pipeline_layouts_on_gpu_equal_the_serial_model(mpirun):
    check_pipeline(mpirun, 2, pipeline_cases(2, device="gpu"))


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_four_and_eight_rank_pipeline_layouts_on_gpu(mpirun, overlap):
    check_pipeline(mpirun, 4, pipeline_cases(4, device="gpu", overlap=overlap))
    check_pipeline(mpirun, 8, pipeline_cases(8, device="gpu", overlap=overlap))
    check_pipeline(mpirun, 2, pipeline_cases(2, device="gpu", overlap=overlap))


def train_on_gpu(mpirun, tmp_path, n, tp, pp, **extra):
    result = mpirun(n, "ranks/gpu_training.py", args=[tp, pp, tmp_path / "ck", json.dumps(extra)], timeout=600)
    record = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"TP {tp} x PP {pp} x DP {n // (tp * pp)}: host syncs per step {record['syncs_per_step']}")
    if STRICT:
        assert record["syncs_per_step"] and max(record["syncs_per_step"]) <= HOST_SYNCS_PER_STEP, record
        # The model's elementwise chains ran through cupy.fuse (the stand-in records each).
        # (a branch's end: bias_dropout_add_forward). Under --fp16/--bf16 the branch's end and the
        # MLP's bias + GeLU are the 16-bit activations' own kernels (sixteen_bit_kernels.py) instead
        fused = set(record["fused"])
        assert "adamw_update_" in fused, record
        if not (extra.get("fp16") or extra.get("bf16")):
            assert {"bias_gelu_tanh_output", "bias_gelu_tanh_backward_recomputed"} <= fused, record
            assert fused & {"bias_dropout_add_forward", "dropout_add_forward"}, record
    return record


def test_training_path_tp2_with_sp_checkpoint_and_generation(mpirun, tmp_path):
    record = train_on_gpu(mpirun, tmp_path, 2, 2, 1)
    assert record["sample"].startswith("sample")


@pytest.mark.slow
def test_training_path_dp2_with_recomputation_and_the_distributed_optimizer(mpirun, tmp_path):
    """Full recomputation and the distributed optimizer's reduce-scatter, sharded AdamW and
    parameter all-gather on CuPy arrays: the NumPy run's losses, norms and parameters, no more
    host synchronisations, and a bitwise resume."""
    train_on_gpu(mpirun, tmp_path, 2, 1, 1, recompute_granularity="full", use_distributed_optimizer=True)


@pytest.mark.slow
@pytest.mark.parametrize("ranks, tp, pp", [(2, 2, 1), (8, 2, 2)], ids=["tp2", "tp2-pp2-dp2"])
def test_training_path_fp16_and_bf16(mpirun, tmp_path, ranks, tp, pp):
    """--fp16 (dynamic loss scaling) and --bf16 on CuPy arrays, with sequence parallelism and
    dropout, at TP 2 and at TP 2 x PP 2 x DP 2: the 16-bit rounding runs on the device (one fused
    kernel per array; bfloat16 on the float32 bits, as CuPy has no bfloat16 type), the Linears
    on 16-bit tensor cores (their operands on the grid: the stand-in refuses any that is not), no
    more host synchronisations than float32, the NumPy run's figures, and a bitwise resume."""
    for fmt in ("fp16", "bf16"):
        train_on_gpu(mpirun, tmp_path / fmt, ranks, tp, pp, dtype="float32", initial_loss_scale=1024.0,
                     rtol=1e-3, **{fmt: True}, **({"loss_scale": 512.0} if fmt == "bf16" else {}))


@pytest.mark.slow
def test_training_path_bf16_with_fused_attention(mpirun, tmp_path):
    """--bf16 at TP 2 with sequence parallelism and attention dropout 0, where attention is
    cuDNN's fused flash attention (the library's stand-in under the strict CuPy stand-in): its
    16-bit output into the projection, its 16-bit gradient into the QKV projection; the NumPy
    (blockwise) run's figures and a bitwise resume."""
    record = train_on_gpu(mpirun, tmp_path, 2, 2, 1, dtype="float32", rtol=1e-3, bf16=True, loss_scale=512.0,
                          attention_dropout=0.0)
    assert record["attention"] == "fused" or not STRICT, record


@pytest.mark.slow
def test_training_path_bf16_with_the_distributed_optimizer(mpirun, tmp_path):
    """--bf16 at DP 2 with ZeRO-1: each rank updates its float32 masters and the 16-bit parameter
    buffers are all-gathered in bfloat16 (NCCL_BFLOAT16); the NumPy run's figures and a bitwise
    resume."""
    train_on_gpu(mpirun, tmp_path, 2, 1, 1, dtype="float32", rtol=1e-3, bf16=True, loss_scale=512.0,
                 use_distributed_optimizer=True)


@pytest.mark.slow
def test_training_path_tp2_pp2_dp2(mpirun, tmp_path):
    train_on_gpu(mpirun, tmp_path, 8, 2, 2)
