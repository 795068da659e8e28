"""Under --fp16/--bf16 on a GPU (the strict stand-in) the parameters forward reads are 16-bit
arrays (the flat buffer's) and the tape keeps in 16 bits what lies on the 16-bit grid
(autograd/precision.py, Context.on_grid): half the bytes, and the numbers do not change, bit for
bit, since every value lies on the grid and every product and sum is still float32. LayerNorm keeps its input in 16 bits and its rows' statistics in place of
xhat (row_kernels.py's kept-input kernels). The GPT-2-shape figures are in
tests/test_gpu_work_counts.py."""
import json

import numpy
import pytest
from fakes.strict_cupy import strict_cupy_env

from npmegatron import autograd as ag
from npmegatron.autograd import epilogues, precision, row_kernels
from npmegatron.autograd.ops import fused_attention
from npmegatron.config import GPTConfig, TrainConfig
from npmegatron.run import assemble

FORMATS = ("bf16", "fp16")


@pytest.fixture
def cp(fresh_strict_cupy):
    return fresh_strict_cupy


def root(a):
    return a if a.base is None else a.base


def kept_arrays(loss, params=()):
    """Every array the tape reachable from `loss` keeps for backward, as kept (not cast back),
    but the parameters' (views of the flat buffers on a GPU: the tape refers to them, owns none)."""
    exclude = {id(root(p.data)) for p in params}
    arrays, stack, seen = [], [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if getattr(node, "ctx", None) is not None:
            arrays += [(node.name, a) for a in node.ctx.kept if hasattr(a, "dtype") and id(root(a)) not in exclude]
        stack.extend(edge[0] for edge in node.edges if edge is not None)
    return arrays


def train_pass(cp, fmt, batch, keep, monkeypatch, **options):
    """(loss, every parameter's gradient, the arrays kept for backward) of one forward and backward
    of a 2-layer GPT on the stand-in under `fmt`, keeping on-grid arrays in 16 bits or not."""
    monkeypatch.setattr(precision, "sixteen_bit_arrays_on_gpu", keep)
    options = {"hidden_dropout": 0.1, "attention_dropout": 0.1, **options}
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=96, max_position_embeddings=32,
                    device="gpu", **{fmt: True}, **options)
    run = assemble(TrainConfig(model=cfg, seq_length=32, micro_batch_size=batch, lr=1e-4, min_lr=0.0), world_size=1)
    ids = numpy.random.default_rng(7).integers(0, cfg.vocab_size, (batch, 33))
    _, loss = run.model.chunks[0](ids[:, :-1], ids[:, 1:])
    kept = [(name, a.dtype, a.nbytes) for name, a in kept_arrays(loss, run.params)]
    ag.backward(loss)
    train_pass.parameter_bytes = sum(p.data.nbytes for p in run.params)
    train_pass.parameter_dtypes = {p.data.dtype for p in run.params}
    return cp.asnumpy(loss.data), [cp.asnumpy(p.grad) for p in run.params], kept


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", [1, 2], ids=["views-of-qkv", "heads-first"])
@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_keeping_16_bit_arrays_changes_no_number(cp, monkeypatch, fmt, batch, dropout):
    """16-bit parameters and 16-bit kept activations against float32 arrays on the 16-bit grid:
    the loss and every gradient equal bit for bit, half the bytes. Without dropout the residual
    stream's gradient stays 16-bit through the layers (LayerNorm's kernel adds the fork's pending
    gradient, bias + residual's backward hands it on and sums the bias's in one GEMV). Both take
    blockwise attention: without dropout the 16-bit run would take cuDNN's, which sums in its own
    order (test_fused_attention_on_device.py holds it to the blockwise path)."""
    monkeypatch.setattr(fused_attention, "FUSED_ATTENTION", "never")
    options = {"hidden_dropout": dropout, "attention_dropout": dropout}
    loss, grads, kept = train_pass(cp, fmt, batch, True, monkeypatch, **options)
    parameter_bytes = train_pass.parameter_bytes
    loss_apart, grads_apart, kept_apart = train_pass(cp, fmt, batch, False, monkeypatch, **options)
    assert 2 * parameter_bytes == train_pass.parameter_bytes
    assert numpy.array_equal(loss, loss_apart)
    for g, h in zip(grads, grads_apart):
        assert numpy.array_equal(g, h)
    sixteen = numpy.dtype(precision.sixteen_bit_dtype(fmt))
    half = sum(n for _, dtype, n in kept if dtype == sixteen)
    assert half and sum(n for *_, n in kept) <= 0.55 * sum(n for *_, n in kept_apart)
    # what stays wider: statistics (attention's log-sum-exp, LayerNorm's rows, the loss's)
    wide = [(name, n) for name, dtype, n in kept if dtype.kind == "f" and dtype.itemsize >= 4]
    assert sum(n for _, n in wide) < 0.15 * half, wide


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_gemm_epilogues_and_the_kernels_in_their_place_give_the_emulations_numbers(cp, monkeypatch, fmt):
    """GPT-2's MLP (one GeluMLP) and the QKV projection under 16-bit arrays: with cuBLASLt's
    epilogues (nvmath-python's stand-in: bias, bias + GeLU keeping GeLU's input, GeLU's
    derivative in the data gradient's GEMM) and without them (the GEMMs' float32 sums, then the
    bias and GeLU kernels), against float32 arrays on the 16-bit grid: bit for bit."""
    monkeypatch.setattr(fused_attention, "FUSED_ATTENTION", "never")
    options = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    loss, grads, _ = train_pass(cp, fmt, 2, True, monkeypatch, **options)
    launches = cp._strict.launches("gemm")
    assert {r.fields.get("epilogue") for r in launches} >= {"BIAS", "GELU_AUX_BIAS", "DGELU"}
    monkeypatch.setattr(epilogues, "EPILOGUES", "never")
    cp._strict.reset()
    loss_kernels, grads_kernels, _ = train_pass(cp, fmt, 2, True, monkeypatch, **options)
    assert not [r for r in cp._strict.launches("gemm") if r.fields.get("epilogue")]
    loss_apart, grads_apart, _ = train_pass(cp, fmt, 2, False, monkeypatch, **options)
    for other_loss, other_grads in ((loss_kernels, grads_kernels), (loss_apart, grads_apart)):
        assert numpy.array_equal(loss, other_loss)
        for g, h in zip(grads, other_grads):
            assert numpy.array_equal(g, h)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_llama_familys_16_bit_kernels_change_no_number(cp, monkeypatch, fmt, dropout):
    """RMSNorm, the rotary embedding, SwiGLU and the residual add in 16-bit kernels
    (llama_kernels.py), grouped-query attention with 2 groups for 4 heads, against float32 arrays
    on the 16-bit grid through the chains: the loss and every gradient equal bit for bit. Both take
    blockwise attention: cuDNN's grouped attention sums a key head's gradient over its query heads
    in its own order (test_fused_attention_on_device.py holds it to the blockwise path)."""
    monkeypatch.setattr(fused_attention, "FUSED_ATTENTION", "never")
    options = {"model_family": "llama", "group_query_attention": True, "num_query_groups": 2,
               "hidden_dropout": dropout, "attention_dropout": dropout}
    loss, grads, kept = train_pass(cp, fmt, 2, True, monkeypatch, **options)
    loss_apart, grads_apart, _ = train_pass(cp, fmt, 2, False, monkeypatch, **options)
    assert numpy.array_equal(loss, loss_apart)
    for g, h in zip(grads, grads_apart):
        assert numpy.array_equal(g, h)
    assert {name for name, dtype, _ in kept if dtype == precision.sixteen_bit_dtype(fmt)} >= {"RMSNorm", "SwiGLU"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_with_full_recomputation_only_the_chunks_inputs_are_kept_in_16_bits(cp, monkeypatch, fmt):
    options = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    loss, grads, kept = train_pass(cp, fmt, 2, True, monkeypatch, **options)
    loss_apart, grads_apart, _ = train_pass(cp, fmt, 2, False, monkeypatch, **options)
    assert numpy.array_equal(loss, loss_apart)
    for g, h in zip(grads, grads_apart):
        assert numpy.array_equal(g, h)
    recomputed = [dtype for name, dtype, _ in kept if name == "Recompute"]
    assert recomputed and all(dtype == precision.sixteen_bit_dtype(fmt) for dtype in recomputed)


def layer_norm_pass(cp, fmt, keep, monkeypatch):
    monkeypatch.setattr(precision, "sixteen_bit_arrays_on_gpu", keep)
    rng = numpy.random.default_rng(2)
    x, w, b, g = (cp.asarray(rng.standard_normal(s).astype(numpy.float32)) for s in ((4, 7, 40), 40, 40, (4, 7, 40)))
    leaves = [ag.Tensor(a, requires_grad=True) for a in (x, w, b)]
    cp._strict.reset()
    with precision.storage(fmt):
        h = leaves[0] * 3.0             # rounded: on the grid, as LayerNorm's inputs are
        y = ag.layer_norm(h, leaves[1], leaves[2])
        kept = y.grad_fn.ctx.kept
        ag.backward(y, g)
    names = [launch.name for launch in cp._strict.launches()      # LayerNorm's row kernels (not the rounding's)
             if launch.kind == "raw" and launch.name.startswith("layer_norm")]
    return [cp.asnumpy(a) for a in [y.data] + [leaf.grad for leaf in leaves]], kept, names


@pytest.mark.parametrize("fmt", FORMATS)
def test_layer_norm_keeps_its_input_and_row_statistics_with_the_same_numbers_and_launches(cp, monkeypatch, fmt):
    got, kept, names = layer_norm_pass(cp, fmt, True, monkeypatch)
    expected, kept_apart, names_apart = layer_norm_pass(cp, fmt, False, monkeypatch)
    for a, e in zip(got, expected):
        assert numpy.array_equal(a, e)
    assert kept[0].dtype == precision.sixteen_bit_dtype(fmt) and kept[1].dtype == numpy.float64
    assert kept[1].shape == (28, 2) and kept_apart[0].dtype == numpy.float32
    # the input's rounding made its 16-bit copy: forward reads that copy and keeps it (no kept write)
    assert names == [f"layer_norm_forward_rows_float_kept_{fmt}_input_16_bit"] + [
        f"{n}_float_kept_{fmt}" for n in ("layer_norm_column_sums", "layer_norm_backward_rows")]
    assert names_apart == [f"{n}_float" for n in ("layer_norm_forward_rows", "layer_norm_column_sums",
                                                  "layer_norm_backward_rows")]


def test_the_kept_input_kernel_refuses_an_input_off_the_grid():
    """What the kernel would do silently (keep a rounded input) its twin refuses on the stand-in."""
    x = numpy.random.default_rng(1).standard_normal((3, 40)).astype(numpy.float32)
    kept = numpy.empty(x.shape, precision.sixteen_bit_dtype("bf16"))
    with pytest.raises(ValueError, match="not on the 16-bit grid"):
        row_kernels.layer_norm_forward_rows_kept_input(x, numpy.ones(40, numpy.float32), numpy.zeros(40, numpy.float32),
                                                       kept, numpy.empty_like(x), numpy.empty((3, 2)),
                                                       numpy.int32(40), numpy.float64(1e-5))


def test_an_activation_two_functions_keep_is_kept_once(cp, monkeypatch):
    """Attention's output is the projection's input: one 16-bit copy serves both."""
    cfg = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=96, max_position_embeddings=32,
                    device="gpu", bf16=True)
    run = assemble(TrainConfig(model=cfg, seq_length=32, micro_batch_size=2, lr=1e-4, min_lr=0.0), world_size=1)
    ids = numpy.random.default_rng(7).integers(0, cfg.vocab_size, (2, 33))
    _, loss = run.model.chunks[0](ids[:, :-1], ids[:, 1:])
    kept = kept_arrays(loss)
    attention_out = [a for name, a in kept if name == "PackedCausalAttention" and a.ndim == 4]
    projection_in = [a for name, a in kept if name == "Linear" and a.shape == (2, 32, 64)]
    assert len(attention_out) == 1 and projection_in
    assert any(a.data.ptr == attention_out[0].data.ptr for a in projection_in)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_0d_array_rounds_in_one_kernel_as_larger_ones_do(cp, fmt):
    """A reduction's result is 0-d on a GPU: its rounding keeps the uint32 arithmetic of the fused
    chain (the stand-in's NumPy would turn 0-d results into scalars and promote them)."""
    host = numpy.float32(1.2345678)
    x = cp.asarray(host)
    cp._strict.reset()
    precision.round_(x, fmt)
    assert len(cp._strict.launches()) == 1
    assert cp.asnumpy(x) == host.astype(precision.sixteen_bit_dtype(fmt)).astype(numpy.float32)


def test_under_cupy_13_bf16_keeps_float32_arrays_on_the_grid(cp, monkeypatch):
    """CuPy 13 has no bfloat16 arrays: --bf16 then holds its values in float32 arrays, as before
    (float16 arrays are CuPy's own and stay)."""
    monkeypatch.setattr(cp, "__version__", "13.6.0")
    _, _, kept = train_pass(cp, "bf16", 2, True, monkeypatch)
    assert train_pass.parameter_dtypes == {numpy.dtype(numpy.float32)}
    assert all(dtype.name != "bfloat16" for _, dtype, _ in kept)
    _, _, kept = train_pass(cp, "fp16", 2, True, monkeypatch)
    assert train_pass.parameter_dtypes == {numpy.dtype(numpy.float16)}
    assert any(dtype == numpy.float16 for _, dtype, _ in kept)


def test_at_tp_2_with_and_without_sequence_parallelism_and_dropout_the_numbers_are_the_same(mpirun):
    """The tensor-parallel mappings (all-reduce, all-gather and reduce-scatter of the sequence, the
    column-parallel input gradient's asynchronous all-reduce) between 16-bit arrays: still bit for
    bit the float32 arrays' numbers."""
    result = mpirun(2, "ranks/sixteen_bit_tensor_parallel.py", env=strict_cupy_env(devices=2), timeout=300)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for layout in ("", "-sp"):
        assert report["bf16" + layout] == {"bitwise_equal": True, "dtypes": ["bfloat16"], "dtypes_apart": ["float32"]}, report
        assert report["fp16" + layout] == {"bitwise_equal": True, "dtypes": ["float16"], "dtypes_apart": ["float32"]}, report


class _FixedMask:
    """A dropout generator whose keep mask is given (keep_mask takes a generator's own `keep`)."""

    def __init__(self, mask):
        self.mask = mask

    def keep(self, shape, dtype, p, block=None):
        assert shape == self.mask.shape and dtype == numpy.float32
        return self.mask


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("p", [None, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("residual_16_bit", [False, True], ids=["residual-float32", "residual-16-bit"])
def test_the_16_bit_residual_stream_is_the_cpu_emulations_numbers_in_one_kernel(cp, fmt, p, residual_16_bit):
    """A branch's end under --fp16/--bf16 on a GPU: one launch (besides the mask's), a 16-bit
    output, and the numbers of the CPU's two rounded ops (y + bias rounded, then residual +
    dropout rounded) bit for bit; LayerNorm's row kernel then reads that output as it is, with the
    numbers it gives for the output's float32 widening."""
    rng = numpy.random.default_rng(5)
    shape = (2, 24, 48)
    y = rng.standard_normal(shape).astype(numpy.float32) * 3
    bias, residual = (precision.round_(rng.standard_normal(s).astype(numpy.float32), fmt) for s in (shape[-1:], shape))
    mask = rng.random(shape) >= 0.1
    weight, ln_bias = (precision.round_(rng.standard_normal(shape[-1]).astype(numpy.float32), fmt) for _ in range(2))
    with precision.storage(fmt):
        expected = ag.bias_dropout_add(ag.Tensor(y), ag.Tensor(bias), ag.Tensor(residual), p or 0.0,
                                       _FixedMask(mask)).data
        sixteen = precision.sixteen_bit_dtype(fmt)
        on_device = [cp.asarray(a) for a in (y, bias.astype(sixteen), residual.astype(sixteen) if residual_16_bit else residual)]
        device_mask = _FixedMask(cp.asarray(mask))
        cp._strict.reset()
        out = ag.bias_dropout_add(*map(ag.Tensor, on_device), p or 0.0, device_mask)
        assert [launch.name for launch in cp._strict.launches()] == [
            f"bias_dropout_add_{fmt}_y_float32_residual_{'16' if residual_16_bit else 'float32'}"
            + ("_dropout" if p else "")]
        assert out.data.dtype == sixteen
        assert numpy.array_equal(cp.asnumpy(out.data).astype(numpy.float32), expected)
        ln_params = [ag.Tensor(cp.asarray(a.astype(sixteen))) for a in (weight, ln_bias)]
        layer_norm = ag.layer_norm(out, *ln_params)
        assert layer_norm.grad_fn is None or layer_norm.grad_fn.ctx.kept[0] is out.data
        widened = ag.layer_norm(ag.Tensor(out.data.astype(numpy.float32)), *ln_params)
    assert numpy.array_equal(cp.asnumpy(layer_norm.data), cp.asnumpy(widened.data))


def _bits(a, cp=None):
    """A 16-bit array's bits (a device array's fetched first)."""
    a = cp.asnumpy(a) if cp is not None else a
    return numpy.asarray(a).view(numpy.uint16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("p", [0.25, None])
def test_the_embeddings_end_reads_and_writes_16_bits_with_the_emulations_numbers(cp, fmt, p):
    """The word embedding's 16-bit lookup plus the position table's rows, then dropout: one 16-bit
    kernel forward and one backward (the dropout's; none without it), the table's gradient one
    GEMV summed in float32 over the batch: bit for bit the CPU's emulation of the two ops, the
    incoming gradient rounded first."""
    from npmegatron.autograd.ops.dropouts import AddRowsDropout
    rng = numpy.random.default_rng(9)
    sixteen = precision.sixteen_bit_dtype(fmt)
    shape, rows = (3, 8, 16), slice(4, 12)
    x, table = (rng.standard_normal(s).astype(sixteen) for s in (shape, (20, 16)))
    g = rng.standard_normal(shape).astype(sixteen)
    mask = rng.random(shape) >= (p or 0)
    results = {}
    for device in ("cpu", "gpu"):
        to = cp.asarray if device == "gpu" else (lambda a: a.astype(numpy.float32))
        xt, tt = ag.Tensor(to(x), requires_grad=True), ag.Tensor(to(table), requires_grad=True)
        tt.is_parameter = True
        generator, grad = _FixedMask(to(mask) if device == "gpu" else mask), to(g)
        cp._strict.reset()
        with precision.storage(fmt):
            out = AddRowsDropout.apply(xt, tt, rows=rows, p=p, generator=generator)
        forward = [launch.name for launch in cp._strict.launches()]
        cp._strict.reset()
        ag.backward(out, grad)
        results[device] = (out.data, xt.grad, tt.grad, forward, [launch.kind for launch in cp._strict.launches()
                                                                 if launch.op == "AddRowsDropout.backward"
                                                                 and launch.name != "full"])     # (the GEMV's ones, made once)
    (out, gx, gt, _, _), (dout, dgx, dgt, forward, backward) = results["cpu"], results["gpu"]
    assert dout.dtype == dgx.dtype == sixteen and dgt.dtype == numpy.float32
    assert forward == [f"add_rows_dropout_{fmt}_x_16_rows" + ("_dropout" if p else "")]
    assert backward == (["raw"] if p else []) + ["elementwise", "gemm"]     # the dropout, the table's zeros, the GEMV
    assert numpy.array_equal(_bits(dout, cp), _bits(out.astype(sixteen)))
    assert numpy.array_equal(_bits(dgx, cp), _bits(gx.astype(sixteen)))
    assert numpy.array_equal(cp.asnumpy(dgt), gt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_loss_reads_16_bit_logits_once_and_writes_their_16_bit_gradient(cp, fmt, reduction):
    """The cross-entropy on a GPU's 16-bit logits: one kernel forward reads them (each row's
    maximum, sum of exponentials and target logit), one backward writes the gradient in 16 bits,
    padded columns included; the loss and the gradient bit for bit the CPU's emulation (the
    gradient as the tape rounds it)."""
    from npmegatron.comm import Group
    from npmegatron.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    rng = numpy.random.default_rng(4)
    sixteen = precision.sixteen_bit_dtype(fmt)
    logits = (rng.standard_normal((2, 6, 40)) * 3).astype(sixteen)
    targets = rng.integers(0, 37, (2, 6))
    g = rng.random((2, 6)).astype(numpy.float32) if reduction == "none" else None
    results = {}
    for device in ("cpu", "gpu"):
        z = ag.Tensor(cp.asarray(logits) if device == "gpu" else logits.astype(numpy.float32), requires_grad=True)
        cp._strict.reset()
        with precision.storage(fmt):
            loss = vocab_parallel_cross_entropy(z, targets, Group.single("tp"), 0, 37, reduction)
        forward = [launch for launch in cp._strict.launches() if launch.kind == "raw"]
        cp._strict.reset()
        ag.backward(loss, None if g is None else (cp.asarray(g) if device == "gpu" else g))
        backward = [launch for launch in cp._strict.launches() if launch.kind == "raw"]
        results[device] = (loss.data, z.grad, forward, backward)
    (loss, grad, _, _), (dloss, dgrad, forward, backward) = results["cpu"], results["gpu"]
    assert [launch.name for launch in forward] == [f"cross_entropy_rows_{fmt}"]
    assert forward[0].fields["read_bytes"] < logits.nbytes + 1024        # the logits once, the targets
    assert [launch.name for launch in backward] == [f"cross_entropy_grad_rows_{fmt}_grad_{fmt}"]
    assert backward[0].fields["written_bytes"] == logits.nbytes
    assert dloss.dtype == numpy.float32 and dgrad.dtype == sixteen
    assert numpy.array_equal(cp.asnumpy(dloss), loss)
    assert numpy.array_equal(_bits(dgrad, cp), _bits(grad.astype(sixteen)))
    assert not numpy.asarray(cp.asnumpy(dgrad).astype(numpy.float32)[..., 37:]).any()


def dtypes_between_functions(cp, fmt, monkeypatch, hidden_dropout=0.1):
    """{("forward" or "backward", Function name): dtype names} of every array a Function handed on
    in one forward and backward of a 2-layer GPT on the stand-in: its outputs,
    and the gradients its backward returned for inputs that are not parameters (nor views of one)."""
    from npmegatron.autograd import function
    seen = {}
    apply, run = function.Function.apply.__func__, function.Node.run

    def recording_apply(cls, *inputs, **params):
        out = apply(cls, *inputs, **params)
        for t in out if isinstance(out, tuple) else (out,):
            seen.setdefault(("forward", cls.__name__), set()).add(t.data.dtype.name)
        return out

    def recording_run(node, grads, *args, **kwargs):
        result = run(node, grads, *args, **kwargs)
        for g, edge in zip(result, node.edges):
            parameter = isinstance(edge[0], function.AccumulateGrad) and edge[0].leaf.is_parameter \
                if edge is not None else False
            if g is not None and not parameter and not function._reaches_parameter(edge):
                seen.setdefault(("backward", node.name), set()).add(g.dtype.name)
        return result

    monkeypatch.setattr(function.Function, "apply", classmethod(recording_apply))
    monkeypatch.setattr(function.Node, "run", recording_run)
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=96, max_position_embeddings=32,
                    hidden_dropout=hidden_dropout, attention_dropout=0.0, device="gpu", **{fmt: True})
    run_ = assemble(TrainConfig(model=cfg, seq_length=32, micro_batch_size=2, lr=1e-4, min_lr=0.0), world_size=1)
    ids = numpy.random.default_rng(7).integers(0, cfg.vocab_size, (2, 33))
    _, loss = run_.model.chunks[0](ids[:, :-1], ids[:, 1:])
    ag.backward(loss)
    return seen


#: What a --fp16/--bf16 step on a GPU hands on in float32: the loss (the loss and its reductions
#: are float32, as Megatron keeps them). Everything else, forward and backward, with and without
#: hidden dropout, is a 16-bit array: the embedding's lookup and its end (AddRowsDropout), every
#: layer's Functions, the logits, and the gradients from the logits' to the embedding's.
FLOAT32_BETWEEN_FUNCTIONS = {("forward", "_VocabParallelCrossEntropy")}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("hidden_dropout", [0.1, 0.0])
def test_a_steps_tape_hands_on_16_bit_arrays_between_the_layers_functions(cp, monkeypatch, fmt, hidden_dropout):
    seen = dtypes_between_functions(cp, fmt, monkeypatch, hidden_dropout)
    sixteen = precision.sixteen_bit_dtype(fmt).name
    float32 = {key for key, dtypes in seen.items() if "float32" in dtypes}
    expected = FLOAT32_BETWEEN_FUNCTIONS
    assert float32 == expected, float32
    # the MLP is one Function under 16-bit storage (ops/mlp.py)
    layer_functions = {"LayerNorm", "Linear", "FusedCausalAttention", "BiasDropoutAdd", "GeluMLP", "AddRowsDropout",
                       "_ShardLookup"}
    assert {name for _, name in seen} >= layer_functions, seen
    for (phase, name), dtypes in seen.items():
        assert dtypes <= {sixteen, "float32"}, (phase, name, dtypes)
        if (phase, name) not in expected:
            assert dtypes == {sixteen}, (phase, name, dtypes)
