"""Fused causal attention (autograd/ops/fused_attention.py) through the stand-in of
nvidia-cudnn-frontend's graph API (tests/fakes/strict_cupy/cudnn), which reads every operand at
the address, dims and strides the graph declares: equal to the blockwise path (values, gradients
and the kept log-sum-exp) in float64 and on the 16-bit grid, in one library call each way; and
the stand-in itself refuses what the library would."""
import numpy
import pytest

from npmegatron import autograd as ag
from npmegatron.autograd import precision
from npmegatron.autograd.ops import fused_attention
from npmegatron.config import GPTConfig, TrainConfig
from npmegatron.run import assemble


@pytest.fixture
def cp(fresh_strict_cupy, monkeypatch):
    monkeypatch.setattr(fused_attention, "_libraries", {})
    monkeypatch.setattr(fused_attention, "_graphs", {})
    monkeypatch.setattr(fused_attention, "_handles", {})
    return fresh_strict_cupy


def attention(cp, mode, qkv_host, g_host, monkeypatch, dtype=None):
    """(output, qkv's gradient, the Function's kept arrays, launches by op) of packed attention."""
    monkeypatch.setattr(fused_attention, "FUSED_ATTENTION", mode)
    qkv = ag.Tensor(cp.asarray(qkv_host.astype(dtype or qkv_host.dtype)), requires_grad=True)
    out = ag.causal_attention_packed(qkv, 0.3, 0.0, None)
    kept = out.grad_fn.ctx.kept
    cp._strict.reset()
    out.backward(cp.asarray(g_host.astype(dtype or g_host.dtype)))
    return out, qkv.grad, kept


def inputs(shape=(2, 24, 3, 8), seed=0):
    b, t, h, d = shape
    rng = numpy.random.default_rng(seed)
    return rng.standard_normal((b, t, h, 3, d)), rng.standard_normal((b, h, t, d))


def test_fused_equals_blockwise_in_float64_values_gradients_and_log_sum_exp(cp, monkeypatch):
    qkv, g = inputs()
    fused, fused_grad, fused_kept = attention(cp, "always", qkv, g, monkeypatch)
    blockwise, blockwise_grad, blockwise_kept = attention(cp, "never", qkv, g, monkeypatch)
    assert fused.grad_fn.name == "FusedCausalAttention" and blockwise.grad_fn.name == "PackedCausalAttention"
    numpy.testing.assert_allclose(cp.asnumpy(fused.data), cp.asnumpy(blockwise.data), rtol=1e-12, atol=1e-13)
    numpy.testing.assert_allclose(cp.asnumpy(fused_grad), cp.asnumpy(blockwise_grad), rtol=1e-11, atol=1e-12)
    # the statistics kept for backward: the log-sum-exp per query, (b, heads, t, 1) against (b, heads, t)
    numpy.testing.assert_allclose(cp.asnumpy(fused_kept[2])[..., 0], cp.asnumpy(blockwise_kept[-1]), rtol=1e-13)
    # causal: a query's output does not move when a later position's k and v change
    later = qkv.copy()
    later[:, -1] += 10.0
    moved, _, _ = attention(cp, "always", later, g, monkeypatch)
    numpy.testing.assert_array_equal(cp.asnumpy(moved.data)[:, :, :-1], cp.asnumpy(fused.data)[:, :, :-1])


def test_fused_attention_is_one_library_call_each_way_reading_q_k_v_where_the_projection_wrote_them(cp, monkeypatch):
    qkv, g = inputs()
    monkeypatch.setattr(fused_attention, "FUSED_ATTENTION", "always")
    x = ag.Tensor(cp.asarray(qkv), requires_grad=True)
    cp._strict.reset()
    out = ag.causal_attention_packed(x, 0.3, 0.0, None)
    forward = cp._strict.launches()
    out.backward(cp.asarray(g))
    core = [launch for launch in cp._strict.launches() if launch.op.startswith("FusedCausalAttention.")]
    assert [(launch.kind, launch.name) for launch in forward] == [("cudnn", "sdpa_forward")]
    assert [(launch.kind, launch.name) for launch in core] == [("cudnn", "sdpa_forward"), ("cudnn", "sdpa_backward")]
    # the output is laid out (b, t, heads, d): the projection reads it as (b, t, heads * d), a view
    assert out.data.transpose(0, 2, 1, 3).flags.c_contiguous


def ulps(fmt):
    return 2.0 ** -8 if fmt == "bf16" else 2.0 ** -11


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_on_the_16_bit_grid_16_bit_operands_give_the_rounded_reference(cp, monkeypatch, fmt):
    """Under 16-bit arrays cuDNN reads the 16-bit copy of q, k, v, writes a 16-bit output and a
    16-bit gradient, and keeps float32 statistics; each equals the float64 blockwise result of the
    same (on-grid) numbers to within one rounding."""
    qkv, g = inputs((2, 32, 2, 16), seed=3)
    dtype = precision.sixteen_bit_dtype(fmt)
    qkv, g = (a.astype(dtype).astype(numpy.float64) for a in (qkv, g))      # values on the grid
    reference, reference_grad, reference_kept = attention(cp, "never", qkv, g, monkeypatch)
    with precision.storage(fmt):
        fused, fused_grad, kept = attention(cp, "auto", qkv, g, monkeypatch, dtype=numpy.float32)
    assert fused.grad_fn.name == "FusedCausalAttention"
    assert fused.data.dtype == dtype and fused_grad.dtype == dtype and kept[0].dtype == dtype
    assert kept[2].dtype == numpy.float32
    expected = cp.asnumpy(reference.data)
    numpy.testing.assert_allclose(cp.asnumpy(fused.data).astype(numpy.float64), expected,
                                  rtol=ulps(fmt), atol=ulps(fmt) * numpy.abs(expected).max())
    expected_grad = cp.asnumpy(reference_grad)
    numpy.testing.assert_allclose(cp.asnumpy(fused_grad).astype(numpy.float64), expected_grad,
                                  rtol=ulps(fmt), atol=ulps(fmt) * numpy.abs(expected_grad).max())
    numpy.testing.assert_allclose(cp.asnumpy(kept[2])[..., 0], cp.asnumpy(reference_kept[-1]), rtol=1e-6)


def test_the_path_chosen_and_why(cp, monkeypatch):
    path = fused_attention.attention_path
    assert path(numpy, 0.0, 64, None)[0] == "blockwise"
    assert path(cp, 0.0, 64, None)[0] == "blockwise" and "16-bit" in path(cp, 0.0, 64, None)[1]
    assert path(cp, 0.0, 64, "bf16") == ("fused", "cuDNN flash attention")
    assert path(cp, 0.1, 64, "bf16")[0] == "blockwise" and "dropout" in path(cp, 0.1, 64, "bf16")[1]
    assert path(cp, 0.0, 60, "fp16")[0] == "blockwise" and path(cp, 0.0, 256, "fp16")[0] == "blockwise"
    monkeypatch.setitem(fused_attention._libraries, id(cp), None)
    assert "not installed" in path(cp, 0.0, 64, "bf16")[1]


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_a_16_bit_model_step_with_fused_attention_matches_the_blockwise_one(cp, monkeypatch, fmt):
    """A 2-layer GPT on the stand-in: the fused path's loss and gradients are the blockwise
    path's to within 16-bit rounding (different summation orders of the same on-grid numbers)."""
    results = {}
    for mode in ("auto", "never"):
        monkeypatch.setattr(fused_attention, "FUSED_ATTENTION", mode)
        cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=96,
                        max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, device="gpu",
                        **{fmt: True})
        run = assemble(TrainConfig(model=cfg, seq_length=32, micro_batch_size=2, lr=1e-4, min_lr=0.0), world_size=1)
        ids = numpy.random.default_rng(7).integers(0, cfg.vocab_size, (2, 33))
        _, loss = run.model.chunks[0](ids[:, :-1], ids[:, 1:])
        ag.backward(loss)
        names = {node.name for node in _nodes(loss)}
        results[mode] = (float(cp.asnumpy(loss.data)), [cp.asnumpy(p.grad) for p in run.params], names)
    assert "FusedCausalAttention" in results["auto"][2] and "FusedCausalAttention" not in results["never"][2]
    assert results["auto"][0] == pytest.approx(results["never"][0], rel=1e-3)
    for fused, blockwise in zip(results["auto"][1], results["never"][1]):
        scale = numpy.abs(blockwise).max() + 1e-30
        assert numpy.abs(fused - blockwise).max() <= 0.05 * scale


def _nodes(loss):
    nodes, stack, seen = [], [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(edge[0] for edge in node.edges if edge is not None)
    return nodes


# --- grouped-query attention (the Llama family): k and v with fewer heads --------------------

def grouped(cp, mode, q_host, k_host, v_host, g_host, monkeypatch, dtype=None):
    """(output, the gradients of q, k and v) of grouped_causal_attention."""
    monkeypatch.setattr(fused_attention, "FUSED_ATTENTION", mode)
    q, k, v = (ag.Tensor(cp.asarray(a.astype(dtype or a.dtype)), requires_grad=True) for a in (q_host, k_host, v_host))
    out = ag.grouped_causal_attention(q, k, v, 0.3, 0.0, None)
    cp._strict.reset()
    out.backward(cp.asarray(g_host.astype(dtype or g_host.dtype)))
    return out, q.grad, k.grad, v.grad


def grouped_inputs(b=2, heads=4, groups=2, t=24, d=8, seed=5):
    rng = numpy.random.default_rng(seed)
    return (rng.standard_normal((b, heads, t, d)), rng.standard_normal((b, groups, t, d)),
            rng.standard_normal((b, groups, t, d)), rng.standard_normal((b, heads, t, d)))


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_fused_attention_equals_repeating_the_heads_in_float64(cp, monkeypatch, groups):
    """cuDNN takes the key/value groups as they are; the blockwise path repeats each group's heads
    (RepeatHeads) and sums their gradients back: the same numbers in float64, one call each way."""
    q, k, v, g = grouped_inputs(groups=groups)
    fused = grouped(cp, "always", q, k, v, g, monkeypatch)
    launches = cp._strict.launches()
    blockwise = grouped(cp, "never", q, k, v, g, monkeypatch)
    assert fused[0].grad_fn.name == "FusedGroupedCausalAttention"
    assert blockwise[0].grad_fn.name == "CausalAttention"
    assert [(launch.kind, launch.name) for launch in launches
            if launch.op.startswith("FusedGroupedCausalAttention.")] == [("cudnn", "sdpa_backward")]
    for got, want in zip((fused[0].data,) + fused[1:], (blockwise[0].data,) + blockwise[1:]):
        numpy.testing.assert_allclose(cp.asnumpy(got), cp.asnumpy(want), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_grouped_fused_attention_under_16_bit_arrays(cp, monkeypatch, fmt):
    """Under 16-bit arrays cuDNN reads 16-bit copies and writes a 16-bit output; the three
    gradients come back float32, widened from one 16-bit buffer by one kernel, each within one
    rounding of the float64 blockwise result of the same on-grid numbers."""
    dtype = precision.sixteen_bit_dtype(fmt)
    q, k, v, g = (a.astype(dtype).astype(numpy.float64) for a in grouped_inputs(t=32, d=16, seed=8))
    reference = grouped(cp, "never", q, k, v, g, monkeypatch)
    with precision.storage(fmt):
        fused = grouped(cp, "auto", q, k, v, g, monkeypatch, dtype=numpy.float32)
    assert fused[0].grad_fn.name == "FusedGroupedCausalAttention" and fused[0].data.dtype == dtype
    assert all(grad.dtype == numpy.float32 for grad in fused[1:])
    for got, want in zip((fused[0].data,) + fused[1:], (reference[0].data,) + reference[1:]):
        want = cp.asnumpy(want)
        numpy.testing.assert_allclose(cp.asnumpy(got).astype(numpy.float64), want,
                                      rtol=ulps(fmt), atol=ulps(fmt) * numpy.abs(want).max())


def test_grouped_attention_with_more_queries_than_keys_is_refused_and_decoding_takes_the_blockwise_path(cp, monkeypatch):
    monkeypatch.setattr(fused_attention, "FUSED_ATTENTION", "always")
    q, k, v, _ = grouped_inputs()
    with pytest.raises(ag.InputError, match="groups dividing heads"):
        ag.grouped_causal_attention(ag.Tensor(cp.asarray(q)), ag.Tensor(cp.asarray(k[:, :1].repeat(3, 1))),
                                    ag.Tensor(cp.asarray(v[:, :1].repeat(3, 1))), 0.3, 0.0, None)
    # one new query against every earlier key (generation with a cache): cuDNN's top-left causal
    # mask would be wrong there, so the blockwise path runs
    out = ag.grouped_causal_attention(ag.Tensor(cp.asarray(q[:, :, -1:])), ag.Tensor(cp.asarray(k)),
                                      ag.Tensor(cp.asarray(v)), 0.3, 0.0, None)
    assert out.data.shape == (2, 4, 1, 8)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_a_16_bit_llama_step_with_grouped_fused_attention_matches_the_blockwise_one(cp, monkeypatch, fmt):
    """A 2-layer Llama-family model with 2 key/value groups for 4 heads on the stand-in: no
    RepeatHeads on the fused path, and the loss and gradients are the blockwise path's to within
    16-bit rounding."""
    results = {}
    for mode in ("auto", "never"):
        monkeypatch.setattr(fused_attention, "FUSED_ATTENTION", mode)
        cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=96, model_family="llama",
                        group_query_attention=True, num_query_groups=2, max_position_embeddings=32,
                        hidden_dropout=0.0, attention_dropout=0.0, device="gpu", **{fmt: True})
        run = assemble(TrainConfig(model=cfg, seq_length=32, micro_batch_size=2, lr=1e-4, min_lr=0.0), world_size=1)
        ids = numpy.random.default_rng(7).integers(0, cfg.vocab_size, (2, 33))
        _, loss = run.model.chunks[0](ids[:, :-1], ids[:, 1:])
        names = {node.name for node in _nodes(loss)}
        ag.backward(loss)
        results[mode] = (float(cp.asnumpy(loss.data)), [cp.asnumpy(p.grad) for p in run.params], names)
    assert "FusedGroupedCausalAttention" in results["auto"][2] and "RepeatHeads" not in results["auto"][2]
    assert "RepeatHeads" in results["never"][2]
    assert results["auto"][0] == pytest.approx(results["never"][0], rel=1e-3)
    for fused, blockwise in zip(results["auto"][1], results["never"][1]):
        scale = numpy.abs(blockwise).max() + 1e-30
        assert numpy.abs(fused - blockwise).max() <= 0.05 * scale


# --- the stand-in refuses what cuDNN would ---------------------------------------------------

def _forward_graph(cudnn, cp, q):
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.DOUBLE, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=cudnn.create_handle())
    tensors = [graph.tensor(name=n, dim=list(q.shape), stride=[s // 8 for s in q.strides],
                            data_type=cudnn.data_type.DOUBLE) for n in "qkv"]
    o, stats = graph.sdpa(q=tensors[0], k=tensors[1], v=tensors[2], attn_scale=0.5, generate_stats=True,
                          diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0)
    return graph, tensors, o, stats


def test_the_stand_in_refuses_steps_out_of_order_a_missing_operand_a_short_buffer_and_another_stream(cp):
    import cudnn
    q = cp.ones((1, 2, 8, 8))
    out, lse = cp.empty((1, 2, 8, 8)), cp.empty((1, 2, 8, 1), cp.float32)
    graph, (tq, tk, tv), o, stats = _forward_graph(cudnn, cp, q)
    with pytest.raises(ValueError, match="dims and strides set"):
        graph.validate()
    graph, (tq, tk, tv), o, stats = _forward_graph(cudnn, cp, q)
    o.set_output(True).set_dim([1, 2, 8, 8]).set_stride([128, 64, 8, 1])
    stats.set_output(True).set_dim([1, 2, 8, 1]).set_stride([16, 8, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
    with pytest.raises(RuntimeError, match="order"):
        graph.build_plans()
    graph.build([cudnn.heur_mode.A])
    pack = {tq: q.data.ptr, tk: q.data.ptr, tv: q.data.ptr, o: out.data.ptr, stats: lse.data.ptr}
    handle = graph.handle
    with pytest.raises(RuntimeError, match="set_stream"):
        cudnn.set_stream(handle=handle, stream=12345)
        graph.execute(pack, 0, handle=handle)
    cudnn.set_stream(handle=handle, stream=cp.cuda.get_current_stream().ptr)
    with pytest.raises(KeyError, match="lacks"):
        graph.execute({tq: q.data.ptr}, 0, handle=handle)
    with pytest.raises(ValueError, match="live device allocation"):
        graph.execute({**pack, o: out[:, :1].data.ptr + out.nbytes // 2 + 8}, 0, handle=handle)
    graph.execute(pack, 0, handle=handle)
    numpy.testing.assert_allclose(cp.asnumpy(out), 1.0)


def test_a_layout_cudnn_does_not_support_falls_back_to_the_blockwise_path(cp, monkeypatch):
    """cuDNN's support check refusing the backward graph (no engine for it on this GPU) is found
    before anything runs, in forward, and that layout then takes the blockwise path."""
    import cudnn

    def refuse_backward(graph):
        if graph.node[0] == "backward":
            raise cudnn.cudnnGraphNotSupportedError("no engine for this backward")
    monkeypatch.setattr(cudnn.pygraph, "check_support", refuse_backward)
    monkeypatch.setattr(fused_attention, "unsupported", set())
    qkv, g = inputs()
    out, grad, _ = attention(cp, "always", qkv, g, monkeypatch)
    reference, reference_grad, _ = attention(cp, "never", qkv, g, monkeypatch)
    assert out.grad_fn.name == "PackedCausalAttention" and len(fused_attention.unsupported) == 1
    numpy.testing.assert_array_equal(cp.asnumpy(out.data), cp.asnumpy(reference.data))
    numpy.testing.assert_array_equal(cp.asnumpy(grad), cp.asnumpy(reference_grad))
