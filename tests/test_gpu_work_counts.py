"""The strict stand-in counts what a GPU would be asked to do (cupy._strict.launches and memory):
one launch per kernel CuPy runs, none for a view, each cuBLAS call with its dtypes, compute type
and transposes as CuPy 14 chooses them (cupy/_core/_routines_linalg.pyx), the copies CuPy makes
inside a call, and device bytes; and scripts/count_gpu_work.py reports them per layer and step."""
import json
import subprocess
import sys

import ml_dtypes
import numpy
import pytest

from fakes.strict_cupy import strict_cupy
from helpers import ROOT, counted_gpu_work


@pytest.fixture
def cp():
    with strict_cupy(devices=1) as module:
        module._strict.reset()
        yield module


def kinds(cp):
    return [(launch.kind, launch.name) for launch in cp._strict.launches()]


def test_each_kernel_is_one_launch_and_a_view_is_none(cp):
    x = cp.ones((4, 8), cp.float32)
    cp._strict.reset()
    y = x + 1
    x.T, x[1:], x.reshape(8, 4), x[None]              # views
    y.sum(axis=0)
    cp.exp(y, out=y)
    x[:, 1:].reshape(-1)                              # not expressible as a view: a copy
    x[cp.asarray(numpy.array([0, 2]))]                # a gather (after an upload)
    assert kinds(cp) == [("elementwise", "add"), ("reduction", "sum"), ("elementwise", "exp"),
                         ("copy", "reshape"), ("memcpy", "host to device"), ("elementwise", "take")]


def test_a_fused_chain_is_one_launch_with_its_reduction(cp):
    @cp.fuse
    def squares_sum(a, b):
        return cp.sum((a - b) * (a - b))

    a, b = cp.ones(16, cp.float32), cp.zeros(16, cp.float32)
    cp._strict.reset()
    squares_sum(a, b)
    assert kinds(cp) == [("fused", "squares_sum")]


def gemms(cp):
    return [launch.fields for launch in cp._strict.launches("gemm")]


def test_2d_gemms_take_their_transposes_from_the_memory_order_and_copy_neither_order(cp):
    x, w = cp.ones((32, 16), cp.float32), cp.ones((8, 16), cp.float32)
    cp._strict.reset()
    x @ w.T                                          # w.T is F-ordered: no copy, a transpose flag
    x.T @ x                                          # x.T is F-ordered too
    (gemm_1, gemm_2) = gemms(cp)
    assert (gemm_1["routine"], gemm_1["transa"], gemm_1["transb"], gemm_1["compute"]) == ("gemmEx", "T", "N", "32F")
    assert (gemm_1["m"], gemm_1["n"], gemm_1["k"]) == (8, 32, 16)
    assert (gemm_2["transa"], gemm_2["transb"]) == ("N", "T")
    assert [launch for launch in cp._strict.launches() if "hidden" in launch.fields] == []
    cp._strict.reset()
    x[:, ::2] @ cp.ones((8, 4), cp.float32)          # strided columns: neither C nor F order
    assert [launch.fields["hidden"] for launch in cp._strict.launches("copy")] == [
        "operand neither C- nor F-contiguous"]


def test_tf32_reaches_2d_gemms_only(cp):
    cp._core.set_compute_type(numpy.float32, cp._core._routines_linalg.COMPUTE_TYPE_TF32)
    try:
        a, b = cp.ones((2, 4, 8), cp.float32), cp.ones((8, 4), cp.float32)
        cp._strict.reset()
        a[0] @ b
        a @ b                                        # batched: the compute type is the dtype's
        assert [g["compute"] for g in gemms(cp)] == ["32F_FAST_TF32", "R_32F"]
    finally:
        cp._core.set_compute_type(numpy.float32, cp._core._routines_linalg.COMPUTE_TYPE_DEFAULT)


def test_batched_gemms_copy_what_is_not_c_ordered_upcast_float16_and_send_bfloat16_to_an_integer_kernel(cp):
    q, k = cp.ones((2, 3, 4, 8), cp.float32), cp.ones((2, 3, 5, 8), cp.float32)
    cp._strict.reset()
    q @ k.swapaxes(-1, -2)
    assert [launch.fields.get("hidden") for launch in cp._strict.launches()] == [
        "batched operand not C-contiguous", None]
    assert gemms(cp)[0]["routine"] == "gemmStridedBatchedEx" and gemms(cp)[0]["batch"] == 6
    cp._strict.reset()
    q.astype(cp.float16) @ q.astype(cp.float16).swapaxes(-1, -2)
    hidden = [launch.fields["hidden"] for launch in cp._strict.launches() if "hidden" in launch.fields]
    assert hidden == ["cast float16 to float32 for a batched GEMM"] * 2 + ["result from float32 to float16"]
    assert gemms(cp)[0]["a"] == "float32"
    cp._strict.reset()
    half = q.astype(ml_dtypes.bfloat16)
    half @ half.swapaxes(-1, -2)
    assert gemms(cp) == [] and ("elementwise", "_integral_tensordot_core_batched") in kinds(cp)


def test_allocations_and_the_peak_of_bytes_live(cp):
    cp._strict.reset()
    a = cp.zeros(1024, cp.float32)
    b = a + 1
    del b
    c = cp.empty(256, cp.float64)
    memory = cp._strict.memory()
    assert memory["allocations"] == 3 and memory["allocated_bytes"] == 4096 + 4096 + 2048
    assert memory["peak_bytes"] - memory["live_bytes"] == 2048     # b's 4096 freed, c's 2048 live
    del a, c


def moved(cp):
    """(read_bytes, written_bytes) of each launch since the last reset."""
    return [(launch.fields["read_bytes"], launch.fields["written_bytes"]) for launch in cp._strict.launches()]


def test_each_launch_records_the_bytes_it_reads_and_writes(cp):
    x, y = cp.ones((4, 8), cp.float32), cp.ones((4, 8), cp.float32)
    row = cp.ones(8, cp.float32)
    cp._strict.reset()
    x + y                                  # two (4, 8) float32 operands read, one written
    x + row                                # the broadcast row is read once: its 8 elements
    x + 2.0                                # a scalar moves nothing
    x += y                                 # in place: x read and written
    x.sum(axis=0)                          # a reduction: (4, 8) in, (8,) out
    x.astype(ml_dtypes.bfloat16)           # a cast: float32 in, 16 bits out
    x[:, 1:].copy()                        # a view counts its own elements
    x.fill(0)
    assert moved(cp) == [(256, 128), (160, 128), (128, 128), (256, 128), (128, 32), (128, 64), (112, 112),
                         (0, 128)]


def test_a_gemm_reads_its_operands_and_writes_its_product(cp):
    x, w = cp.ones((32, 16), cp.float32), cp.ones((8, 16), cp.float32)
    cp._strict.reset()
    x @ w.T
    assert moved(cp) == [((32 * 16 + 8 * 16) * 4, 32 * 8 * 4)]


def test_a_direct_cublas_gemm_reads_c_too_when_it_accumulates(cp):
    from cupy.cuda import cublas, runtime
    a, b, c = cp.ones((4, 8), cp.float32), cp.ones((8, 2), cp.float32), cp.zeros((4, 2), cp.float32)
    cp._strict.reset()
    for beta in (0.0, 1.0):     # C = A B (+ C): column-major, so C^T = B^T A^T
        cublas._gemm_on("gemmEx", 0, 0, 2, 4, 8, 1.0, b.data.ptr, runtime.CUDA_R_32F, 2, 0, a.data.ptr,
                        runtime.CUDA_R_32F, 8, 0, beta, c.data.ptr, runtime.CUDA_R_32F, 2, 0, 1,
                        cublas.CUBLAS_COMPUTE_32F)
    assert moved(cp) == [(128 + 64, 32), (128 + 64 + 32, 32)]


def test_a_fused_call_reads_the_arguments_its_body_reads_and_writes_its_outputs(cp):
    @cp.fuse
    def scaled_sum(a, b, out):
        out[...] = a * 2.0              # `out` is written, not read; `b` is passed but unused
        return a + 1.0

    @cp.fuse
    def add_into(a, b):
        a += b                           # read and written

    @cp.fuse
    def squares_sum(a, b):
        return cp.sum((a - b) * (a - b))

    a, b, out = cp.ones((4, 8), cp.float32), cp.ones((4, 8), cp.float32), cp.empty((4, 8), cp.float32)
    cp._strict.reset()
    scaled_sum(a, b, out)
    add_into(a, b)
    squares_sum(a, b)
    assert moved(cp) == [(128, 256), (256, 128), (256, 4)]


def add_into_twin(x, out, n):
    """The twin of the raw kernel below: out += x."""
    out += x


ADD_INTO = r"""
// twin: test_gpu_work_counts:add_into_twin
extern "C" __global__ void add_into(const float* x, float* out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] += x[i];
}
"""


def copy_twin(x, out, n):
    out[...] = x


COPY = r"""
// twin: test_gpu_work_counts:copy_twin
extern "C" __global__ void copy(const float* x, float* out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i];
}
"""


def test_a_raw_kernel_reads_its_const_pointers_and_the_outputs_it_adds_into(cp):
    x, out = cp.ones((4, 8), cp.float32), cp.ones((4, 8), cp.float32)
    cp._strict.reset()
    cp.RawKernel(ADD_INTO, "add_into")((1,), (32,), (x, out, numpy.int64(32)))
    cp.RawKernel(COPY, "copy")((1,), (32,), (x, out, numpy.int64(32)))
    assert moved(cp) == [(256, 128), (128, 128)]
    assert float(out.sum()) == 32.0


SMALL_MODEL = ("--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256", "--vocab-size", "512")


def count(*flags):
    """The counting script's JSON for the small model with `flags`, each a fresh dict."""
    return json.loads(counted_gpu_work(SMALL_MODEL + flags))


def test_the_counting_script_reports_per_layer_counts_that_do_not_depend_on_depth():
    result = count("--check-depth", "--hidden-dropout", "0.1", "--attention-dropout", "0.1")
    assert result["third_layer_adds_the_same_launches"] is True
    assert result["syncs_per_step"] == 1        # the loss and the gradient norm, together
    layer, core, rest = result["layer"], result["layer_attention_core"], result["layer_without_attention_core"]
    assert layer["launches"] == core["launches"] + rest["launches"] > 0
    total = 2 * layer["launches"] + result["outside_layers"]["launches"] + result["optimizer_step"]["launches"]
    assert result["step_two_layers"]["launches"] == total
    assert sum(layer["by_op"].values()) == layer["launches"]
    assert sum(layer["gemms"].values()) == layer["by_kind"]["gemm"] >= 8     # 4 linears x (forward + 2 backward) at least


def test_the_counting_script_reports_the_bytes_moved_outside_gemms_and_attention_by_function():
    result = count("--bf16")
    layer, core = result["layer"], result["layer_attention_core"]
    outside = layer["bytes_outside_gemms_and_attention"]
    assert outside > 0 and outside == sum(layer["bytes_outside_gemms_and_attention_by_op"].values())
    assert core["bytes"] > 0 and core["bytes_outside_gemms_and_attention"] == 0
    assert layer["bytes"] > outside and not any(op.startswith("FusedCausalAttention.")
                                                for op in layer["bytes_outside_gemms_and_attention_by_op"])
    # a second layer adds the layer's launches and bytes and its parameters' optimizer work (the
    # first layer's may differ: its input's gradient meets the embedding's; what differs is counted
    # outside the layers)
    for key in ("launches", "bytes"):
        grown = result["optimizer_step"][key] - result["optimizer_step_one_layer"][key]
        assert result["step_two_layers"][key] == result["step_one_layer"][key] + layer[key] + grown


#: Python call counts do not depend on the shapes much: the smallest that run the model's paths
TINY_MODEL = ("--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128", "--vocab-size", "512")


def test_project_python_calls_per_step_are_printed_deterministic_and_linear_in_depth():
    """The script extrapolates to GPT-2 124M's 12 layers from 1 and 2; a real 12-layer model's
    step makes exactly that many calls, and a second run counts the same."""
    runs = []
    for extra in (("--check-python-calls", "12"), ()):
        run = subprocess.run([sys.executable, "scripts/count_gpu_work.py", "--bf16", *TINY_MODEL, *extra,
                              "--json", "/dev/stdout"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        runs.append((run.stdout, json.loads(run.stdout[run.stdout.index("\n{") + 1:])))
    (text, checked), (_, again) = runs
    calls = checked["python_calls_per_step_12_layers"]
    assert f"project Python calls per step at 12 layers: {calls}\n" in text
    assert calls > 0 and calls == again["python_calls_per_step_12_layers"]
    depth = checked["python_calls"]["measured_at_depth"]
    assert depth == {"layers": 12, "measured": calls, "extrapolated": calls}
    top = checked["python_calls"]["per_layer_top_25"]
    assert 0 < len(top) <= 25 and all(not key.startswith("tests/") and n > 0 for key, n in top.items())


@pytest.mark.slow
def test_the_counting_script_sees_tf32_in_every_gemm():
    result = count("--tf32")
    gemms = {**result["layer"]["gemms"], **result["outside_layers"]["gemms"]}
    assert gemms and all("compute 32F_FAST_TF32" in key for key in gemms), gemms


def count_gpt2(*flags):
    """The counts at GPT-2 124M's layer shapes (the script's defaults: hidden 768, 12 heads,
    seq 1024, vocab 50,304, micro-batch 1), each a fresh dict; the float32 run's counts serve
    both its budget test and the 16-bit one's."""
    return json.loads(counted_gpu_work(flags))


#: Launches per transformer layer (forward + backward) outside attention's core at GPT-2 124M's
#: shapes, the issue's budgets (measured: 27, and 31 with dropout; docs/gpu.md, "Counting the
#: GPU's work", lists them).
LAYER_BUDGET, LAYER_BUDGET_WITH_DROPOUT = 30, 35
#: The optimizer step's launches for the 2-layer model, the issue's budget (measured: 6; the flat
#: buffers make it independent of the parameter count: one norm, one update, two gradients
#: copied in, the tied embedding's and the position embedding's).
OPTIMIZER_BUDGET = 20


@pytest.mark.slow
@pytest.mark.parametrize("flags, budget", [((), LAYER_BUDGET),
                                           (("--hidden-dropout", "0.1", "--attention-dropout", "0.1"),
                                            LAYER_BUDGET_WITH_DROPOUT)])
def test_gpt2_layer_budget_no_hidden_copies_and_every_gemm_through_cublas_directly(flags, budget):
    result = count_gpt2(*flags)
    assert result["layer_without_attention_core"]["launches"] <= budget
    assert result["optimizer_step"]["launches"] <= OPTIMIZER_BUDGET
    assert result["syncs_per_step"] <= 1
    step = result["step_two_layers"]
    assert step["hidden_copies"] == 0 and step["gemms_through_cupy_matmul"] == 0
    assert all(" compute 32F " in key and key.split()[1] == "float32xfloat32->float32" for key in step["gemms"]), \
        step["gemms"]


def test_16_bit_rounding_is_one_kernel_per_array_on_the_gpu():
    """--bf16 and --fp16 keep float32 arrays on the 16-bit grid (autograd/precision.py): each
    rounding is one fused kernel in place, strided views included, never the generic integer
    code's nine kernels."""
    plain = count()
    for flag in ("--bf16", "--fp16"):
        result = count(flag)
        layer = result["layer_without_attention_core"]
        assert "_round_bf16_" not in layer["by_op"], layer["by_op"]
        assert layer["launches"] <= plain["layer_without_attention_core"]["launches"] + 60, (flag, layer["launches"])
        # what the tape keeps is 16-bit (precision.py): about half the float32 run's bytes
        assert result["kept_for_backward_per_layer"] <= KEPT_FRACTION * plain["kept_for_backward_per_layer"]
        assert result["kept_for_backward_two_layers"] <= KEPT_FRACTION * plain["kept_for_backward_two_layers"]


#: --bf16's launches per layer outside attention's core at GPT-2 124M's shapes (measured: 24 with
#: the fused attention): 16 GEMMs (the QKV projection's bias and the MLP's bias + GeLU and GeLU's
#: derivative in their epilogues, every bias's gradient one GEMV), LayerNorm one kernel forward
#: and two backward (the second adds the fork's pending 16-bit gradient), bias + dropout +
#: residual one forward; the kernels read 16 bits and round as they store. The issue's budget:
#: at most 30.
BF16_LAYER_BUDGET = 30
#: Bytes kept for backward under --bf16/--fp16 against the float32 run, at most (the issue's 55 %;
#: measured at GPT-2 124M's shapes: 50.1 % per layer, 50.0 % for the 2-layer model).
KEPT_FRACTION = 0.55


@pytest.mark.slow
def test_gpt2_bf16_layer_budget_and_bytes_kept_for_backward():
    result, plain = count_gpt2("--bf16"), count_gpt2()
    assert result["layer_without_attention_core"]["launches"] <= BF16_LAYER_BUDGET
    assert result["kept_for_backward_per_layer"] <= KEPT_FRACTION * plain["kept_for_backward_per_layer"]
    assert result["kept_for_backward_two_layers"] <= KEPT_FRACTION * plain["kept_for_backward_two_layers"]


def min_layer_bytes(b, s, h, e):
    """The fewest bytes one GPT-2 layer's kernels outside its GEMMs and attention's core read and
    write in a training step (forward + backward), with ideal fusion (docs/performance.md, "The
    GPU's memory traffic"): micro-batch b, sequence s, hidden h, e bytes an activation element.
    Forward: two LayerNorms reading x and writing y (2 e b s h each) and their float32 mean and
    1/std (2 x 4 b s), two bias + dropout + residual adds reading two and writing one (3 e b s h
    each), bias + GeLU in the GEMM's epilogue; backward: two LayerNorm backwards reading dy, x,
    the residual's gradient they add to and the statistics, writing dx (4 e b s h + 8 b s each);
    the residual adds' gradients are their input's, bias gradients and GeLU's derivative are in
    the GEMMs' epilogues."""
    return 18 * b * s * h * e + 32 * b * s


MIN_LAYER_BYTES_BF16, MIN_LAYER_BYTES_FLOAT32 = min_layer_bytes(1, 1024, 768, 2), min_layer_bytes(1, 1024, 768, 4)
#: Bytes per layer outside the GEMMs and attention's core at GPT-2 124M's shapes, measured on
#: 2026-11-29 (34,725,888 under --bf16) and 2026-11-28 (185,720,832 in float32), rounded up by
#: about 2 %; and the issue's bound, 1.5 x the minimum.
LAYER_BYTES_BF16, LAYER_BYTES_FLOAT32 = 35_500_000, 189_500_000
ISSUE_BOUND = 1.5


@pytest.mark.slow
def test_gpt2_layer_bytes_outside_gemms_and_attention_do_not_grow():
    """The bytes one layer's kernels outside its GEMMs and attention's core read and write per
    step. Measured: 1.23 x the minimum under --bf16 (34,725,888 against 28,344,320: LayerNorm's
    backward reads the gradient and the input a second time for its column sums, the rest is the
    minimum's), within the issue's 1.5 x; 3.28 x in float32 (185,720,832 against 56,655,872: the
    float32 model keeps bias + GeLU apart from its GEMMs). Both are also kept from growing."""
    assert (MIN_LAYER_BYTES_BF16, MIN_LAYER_BYTES_FLOAT32) == (28_344_320, 56_655_872)
    for flags, bound in ((("--bf16",), LAYER_BYTES_BF16), ((), LAYER_BYTES_FLOAT32)):
        layer = count_gpt2(*flags)["layer"]
        assert 0 < layer["bytes_outside_gemms_and_attention"] <= bound, (flags, layer["bytes_outside_gemms_and_attention"])
    assert count_gpt2("--bf16")["layer"]["bytes_outside_gemms_and_attention"] <= ISSUE_BOUND * MIN_LAYER_BYTES_BF16


#: Launches of attention's core per layer, forward and backward, where cuDNN's fused attention
#: runs (--bf16/--fp16, attention dropout 0): the issue's budget (measured: 2, the forward and
#: the backward call, the output gradient's 16-bit copy being its rounding's; the blockwise path:
#: 39; the Llama family's grouped attention: 3, its gradients' widening too).
FUSED_ATTENTION_BUDGET = 3


def test_fused_attention_is_at_most_three_launches_per_layer():
    for flag in ("--bf16", "--fp16"):
        core = count(flag)["layer_attention_core"]
        assert core["launches"] <= FUSED_ATTENTION_BUDGET, (flag, core)
        assert core["by_kind"].get("cudnn") == 2 and not core["gemms"], (flag, core)


@pytest.mark.parametrize("flags", [pytest.param(("--blockwise-attention",), marks=pytest.mark.slow), ()],
                         ids=["blockwise", "fused"])
def test_under_16_bit_storage_the_linears_run_16_bit_tensor_cores(flags):
    """--bf16 / --fp16: every Linear's GEMM (the layers' 2-D products and the output layer) takes
    16-bit operands (the 16-bit weights and the 16-bit copy of its input or output gradient; the
    fused attention's 16-bit output and gradient as they are) and sums in float32; every forward
    GEMM and every data gradient writes its 16-bit result itself, the QKV projection's bias, the
    MLP's first bias and GeLU and GeLU's derivative in cuBLASLt's epilogues (nvmath-python's
    stand-in): 10 of the counted kinds, 3 of them epilogues; the weight and bias gradients (float32
    main_grad) write float32; the blockwise attention's products, whose probabilities are not
    rounded, stay float32."""
    for flag, sixteen in (("--bf16", "bfloat16"), ("--fp16", "float16")):
        result = count(flag, *flags)
        gemms = {**result["layer"]["gemms"], **result["outside_layers"]["gemms"]}
        linears = {key for key in gemms if key.startswith(("gemmEx ", "cublasLtMatmul "))}
        assert linears and all(f" {sixteen}x{sixteen}->" in key for key in linears), gemms
        writing_16_bit = [key for key in linears if f"->{sixteen} compute 32F" in key]
        assert sum(gemms[key] for key in writing_16_bit) == 10 and all(
            f"->float32 compute 32F" in key for key in linears - set(writing_16_bit)), gemms
        epilogues = sorted(key.rsplit(" ", 1)[-1] for key in linears if key.startswith("cublasLtMatmul "))
        assert epilogues == ["BIAS", "DGELU", "GELU_AUX_BIAS"], gemms
        assert all("float32xfloat32->float32 compute 32F " in key for key in set(gemms) - linears), gemms


#: Launches per Llama-family layer (forward + backward) outside attention's core (measured: 41 at
#: hidden 64, 4 heads in 2 key/value groups, seq 256: GPT-2's 27 plus RMSNorm's extra row kernel,
#: the rotary chains of q and k each way, the grouped keys' and values' repetition and its sum, the
#: gate and up weights joined for one GEMM, and the residual adds that GPT-2 fuses with its biases).
LLAMA_LAYER_BUDGET = 45


def test_llama_layer_budget_one_kernel_per_chain_and_every_gemm_through_cublas():
    result = count("--model-family", "llama", "--num-query-groups", "2", "--check-depth")
    assert result["third_layer_adds_the_same_launches"] is True
    layer = result["layer_without_attention_core"]
    assert layer["launches"] <= LLAMA_LAYER_BUDGET, layer
    by_op = result["layer"]["by_op"]
    # one kernel each way per rotation (q and k), SwiGLU's chain (+ nothing) forward and backward,
    # RMSNorm's two kernels forward and three backward (two norms a layer)
    assert (by_op["Rotary.forward"], by_op["Rotary.backward"]) == (2, 2)
    assert (by_op["SwiGLU.forward"], by_op["SwiGLU.backward"]) == (1, 1)
    assert (by_op["RMSNorm.forward"], by_op["RMSNorm.backward"]) == (4, 6)
    step = result["step_two_layers"]
    assert step["hidden_copies"] == 0 and step["gemms_through_cupy_matmul"] == 0


#: --bf16 Llama-family launches per layer outside attention's core at hidden 64, 4 heads in 2
#: key/value groups, seq 256: the issue's budget (measured: 31; was 108 with RepeatHeads and every
#: rounding its own kernel, and 62 with RMSNorm, the rotations, SwiGLU and the residual adds on
#: float32 arrays, their 16-bit inputs widened and outputs rounded).
LLAMA_BF16_LAYER_BUDGET = 35


@pytest.mark.parametrize("fmt", ["--bf16", "--fp16"])
def test_llama_16_bit_layer_runs_its_16_bit_kernels_within_the_budget(fmt):
    """--bf16/--fp16 Llama: cuDNN's fused attention takes the key/value groups as they are
    (attention's core at most three launches a layer, and no RepeatHeads); RMSNorm is one kernel
    forward and two backward (the second adds the residual path's gradient: no separate sum at the
    fork), SwiGLU and each rotation one each way, the residual add one, and no launch rounds,
    casts or widens between them (llama_kernels.py)."""
    result = count(fmt, "--model-family", "llama", "--num-query-groups", "2")
    core, by_op = result["layer_attention_core"], result["layer"]["by_op"]
    assert core["launches"] <= FUSED_ATTENTION_BUDGET and core["by_kind"].get("cudnn") == 2, core
    assert not [op for op in by_op if op.startswith("RepeatHeads.")], by_op
    assert (by_op["RMSNorm.forward"], by_op["RMSNorm.backward"]) == (2, 4), by_op
    assert (by_op["Rotary.forward"], by_op["Rotary.backward"]) == (2, 2), by_op
    assert (by_op["SwiGLU.forward"], by_op["SwiGLU.backward"]) == (1, 1), by_op
    assert by_op["DropoutAdd.forward"] == 2 and "DropoutAdd.backward" not in by_op, by_op
    assert not [op for op in by_op if op.startswith(("__call__", "_accumulate", "Block.", "ParallelMLP.",
                                                     "ParallelAttention."))], by_op
    assert result["layer_without_attention_core"]["launches"] <= LLAMA_BF16_LAYER_BUDGET


@pytest.mark.parametrize("fmt", ["--bf16", "--fp16"])
def test_gpt2_16_bit_layer_runs_bias_and_gelu_in_gemm_epilogues_and_hands_on_16_bit_gradients(fmt):
    """--bf16/--fp16 GPT-2 without dropout: the QKV projection's bias and the MLP's bias + GeLU are
    in their GEMMs' epilogues, and so is GeLU's derivative (GeluMLP: its launches are GEMMs only,
    nothing outside them); the residual stream's gradient stays 16-bit through a layer: LayerNorm's
    input-gradient kernel adds the fork's pending 16-bit gradient (no separate float32 sum, no
    widening), bias + dropout + residual's backward hands its gradient on and sums the bias's in
    one GEMV; no launch rounds, casts or widens between the layer's Functions."""
    layer = count(fmt)["layer"]
    by_op, outside = layer["by_op"], layer["bytes_outside_gemms_and_attention_by_op"]
    assert not [op for op in by_op if op.startswith(("__call__", "_accumulate", "Block.", "ParallelMLP.",
                                                     "ParallelAttention.", "BiasGelu."))], by_op
    assert by_op["LayerNorm.backward"] == 4 and (by_op["GeluMLP.forward"], by_op["GeluMLP.backward"]) == (2, 5), by_op
    assert not [op for op in outside if op.startswith(("BiasDropoutAdd.backward", "GeluMLP.", "Linear."))], outside
    assert by_op["BiasDropoutAdd.backward"] == 2 and layer["by_kind"]["gemm"] == 16, layer


#: Python calls inside the project's own files per eager training step at GPT-2 124M's 12 layers
#: under --bf16 (scripts/count_gpu_work.py): the issue's budget.
PYTHON_CALLS_BUDGET = 15_000


@pytest.mark.slow
def test_gpt2_bf16_step_makes_at_most_15000_project_python_calls():
    assert 0 < count_gpt2("--bf16")["python_calls_per_step_12_layers"] <= PYTHON_CALLS_BUDGET


def test_python_calls_count_only_the_repositorys_sources():
    """A virtual environment inside the checkout (CI makes .venv-ci there) holds NumPy and the rest:
    their calls are not the project's."""
    probe = ("import os, sys; sys.path.insert(0, 'scripts'); import count_gpu_work as c; r = c.ROOT; "
             "print([c.is_project_source(os.path.join(r, *p.split('/'))) for p in ("
             "'npmegatron/model.py', 'autograd/function.py', 'tests/fakes/strict_cupy/cupy/__init__.py', "
             "'.venv-ci/lib/python3.12/site-packages/numpy/core/numeric.py')])")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[True, True, False, False]", result.stdout + result.stderr


def test_an_moe_layer_synchronises_once_and_its_launches_do_not_grow_with_the_experts():
    """The MoE layer's one host synchronisation a forward is the choice of experts going to the
    host (the dispatch sorts and lays out the blocks there; the balancing loss counts on the
    device). Its experts run as grouped GEMMs, batched over the experts through cuBLAS with no
    hidden copy, so a layer of 8 experts makes the launches and GEMMs of a layer of 2."""
    two, eight = (count("--model-family", "llama", "--num-experts", str(e), "--moe-router-topk", "2")
                  for e in (2, 8))
    for result in (two, eight):
        assert result["syncs_per_step"] == 1 + 2      # the loss and norm's, and one a MoE layer
        step = result["step_two_layers"]
        assert step["hidden_copies"] == 0 and step["gemms_through_cupy_matmul"] == 0
    for key in ("launches", "by_kind"):
        assert eight["layer"][key] == two["layer"][key], (eight["layer"][key], two["layer"][key])
    batched = {name: n for name, n in eight["layer"]["gemms"].items() if "batch=8" in name}
    assert sum(batched.values()) == 2 * 3, eight["layer"]["gemms"]   # two projections, three GEMMs each
