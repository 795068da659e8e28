"""The serial GPT-2: gradcheck of the whole model, an independent NumPy reference forward
(HF GPT2LMHeadModel semantics), initialisation, dtypes and bad input."""
import math

import numpy as np
import pytest

import npmegatron.autograd as ag
from npmegatron.autograd import InputError
from npmegatron.model import GPT, GPTConfig

TINY = dict(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=11,
            max_position_embeddings=6, dtype="float64")


def batch(cfg, b=2, t=5, seed=0):
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (b, t + 1))
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.slow
def test_whole_two_layer_gpt_gradcheck_float64():
    model = GPT(GPTConfig(**TINY, hidden_dropout=0.0, attention_dropout=0.0))
    ids, targets = batch(model.cfg)
    params = model.parameters()
    assert len(params) == 2 + 2 * 12 + 2
    err = ag.gradcheck(lambda *_: model(ids, targets)[1], params)
    assert err < 1e-6


def test_gpt_gradcheck_with_dropout_replaying_the_masks():
    model = GPT(GPTConfig(**TINY, hidden_dropout=0.2, attention_dropout=0.3))
    ids, targets = batch(model.cfg)
    states = model.rng.get_states()

    def loss(*_):
        model.rng.set_states(states)           # the same masks on every evaluation
        return model(ids, targets)[1]

    assert ag.gradcheck(loss, model.parameters(), max_entries=20) < 1e-6


def reference_gpt2_logits(model, ids):
    """GPT-2 written out in plain NumPy from the parameters: pre-LN, eps 1e-5, tanh GeLU,
    causal softmax(q k^T / sqrt(d)), tied output layer."""
    p = {name: t.data for name, t in model.named_parameters()}
    cfg = model.cfg
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    d = h // heads

    def ln(x, prefix):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * p[prefix + ".weight"] + p[prefix + ".bias"]

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    b, t = ids.shape
    wte = p["wte.weight"][:cfg.vocab_size]      # rows past the vocabulary are padding
    x = wte[ids] + p["wpe"][:t]
    for i in range(cfg.num_layers):
        pre = f"blocks.{i}."
        a = ln(x, pre + "ln_1")
        qkv = (a @ p[pre + "attn.qkv.weight"] + p[pre + "attn.qkv.bias"]).reshape(b, t, heads, 3, d)
        q, k, v = (qkv[:, :, :, j].transpose(0, 2, 1, 3) for j in range(3))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        y = (w @ v).transpose(0, 2, 1, 3).reshape(b, t, h)
        x = x + y @ p[pre + "attn.proj.weight"] + p[pre + "attn.proj.bias"]
        m = gelu(ln(x, pre + "ln_2") @ p[pre + "mlp.fc.weight"] + p[pre + "mlp.fc.bias"])
        x = x + m @ p[pre + "mlp.proj.weight"] + p[pre + "mlp.proj.bias"]
    return ln(x, "ln_f") @ wte.T


def test_forward_equals_an_independent_reference():
    model = GPT(GPTConfig(**TINY))
    model.eval()
    for _, param in model.named_parameters():   # move away from the zero/one init
        param.data += np.random.default_rng(3).standard_normal(param.shape) * 0.1
    ids, targets = batch(model.cfg)
    logits, loss = model(ids, targets)
    ref = reference_gpt2_logits(model, ids)
    np.testing.assert_allclose(model.full_logits(logits), ref, rtol=1e-12, atol=1e-13)
    flat = ref.reshape(-1, ref.shape[-1])
    nll = np.log(np.exp(flat).sum(-1)) - flat[np.arange(flat.shape[0]), targets.reshape(-1)]
    assert loss.item() == pytest.approx(nll.mean(), rel=1e-12)


def test_causality_future_tokens_do_not_change_past_logits():
    model = GPT(GPTConfig(**TINY)).eval()
    ids, _ = batch(model.cfg)
    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % model.cfg.vocab_size
    a, b = model.full_logits(model(ids)[0]), model.full_logits(model(changed)[0])
    np.testing.assert_array_equal(a[:, :-1], b[:, :-1])
    assert not np.allclose(a[:, -1], b[:, -1])


def test_initialisation_follows_the_paper():
    cfg = GPTConfig(num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=512,
                    max_position_embeddings=64, dtype="float64")
    params = dict(GPT(cfg).named_parameters())
    assert params["blocks.0.attn.qkv.weight"].data.std() == pytest.approx(0.02, rel=0.02)
    assert params["wte.weight"].data.std() == pytest.approx(0.02, rel=0.02)
    scaled = 0.02 / math.sqrt(2 * cfg.num_layers)
    assert params["blocks.3.attn.proj.weight"].data.std() == pytest.approx(scaled, rel=0.02)
    assert params["blocks.3.mlp.proj.weight"].data.std() == pytest.approx(scaled, rel=0.02)
    assert not params["blocks.0.mlp.fc.bias"].data.any()
    np.testing.assert_array_equal(params["ln_f.weight"].data, 1.0)
    np.testing.assert_array_equal(params["blocks.7.ln_2.bias"].data, 0.0)


def test_weights_depend_on_seed_and_name_not_on_construction():
    a = dict(GPT(GPTConfig(**TINY)).named_parameters())
    b = dict(GPT(GPTConfig(**{**TINY, "num_layers": 3})).named_parameters())
    c = dict(GPT(GPTConfig(**TINY, seed=7)).named_parameters())
    np.testing.assert_array_equal(a["blocks.1.attn.qkv.weight"].data, b["blocks.1.attn.qkv.weight"].data)
    assert not np.array_equal(a["wte.weight"].data, c["wte.weight"].data)


def test_float32_model_trains_in_float32():
    model = GPT(GPTConfig(**{**TINY, "dtype": "float32"}))
    ids, targets = batch(model.cfg)
    logits, loss = model(ids, targets)
    loss.backward()
    assert logits.dtype == np.float32 and loss.dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in model.parameters())
    assert abs(loss.item() - math.log(11)) < 0.2


def test_bad_model_input_is_one_clear_sentence():
    with pytest.raises(InputError, match="hidden size 100 is not divisible by 3 attention heads"):
        GPTConfig(hidden_size=100, num_attention_heads=3)
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(InputError, match=r"token id 11 is outside the vocabulary \[0, 11\); tokenize with the "
                       "model's vocabulary or build the model with a larger vocab_size$"):
        model(np.array([[1, 11]]))
    with pytest.raises(InputError, match="sequence length 7 is longer than the position table .*"
                       "larger max_position_embeddings$"):
        model(np.zeros((1, 7), int))


@pytest.mark.parametrize("padded", [False, True])
def test_compiled_cross_entropy_equals_the_numpy_passes_in_float64(padded, monkeypatch):
    """Logits large enough for the numba passes (_cross_entropy_cpu.py) give NumPy's loss and
    gradient to round-off; with a padded vocabulary the padding columns get no gradient."""
    import npmegatron.tensor_parallel.cross_entropy as ce
    from npmegatron.comm import Group
    rows, width = 96, 4096
    vocab = width - 100 if padded else width
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((1, rows, width)) * 3
    targets = rng.integers(0, vocab, (1, rows))
    results = []
    for threshold in (1, 1 << 60):           # compiled, then NumPy's passes
        monkeypatch.setattr(ce, "COMPILED_CROSS_ENTROPY_SIZE", threshold)
        x = ag.Tensor(logits.copy(), requires_grad=True)
        loss = ce.vocab_parallel_cross_entropy(x, targets, Group.single("tp"), 0, vocab)
        loss.backward()
        results.append((loss.item(), x.grad))
    (loss_c, grad_c), (loss_n, grad_n) = results
    assert loss_c == pytest.approx(loss_n, rel=1e-13)
    np.testing.assert_allclose(grad_c, grad_n, rtol=1e-11, atol=1e-16)
    assert not grad_c[..., vocab:].any()


@pytest.mark.parametrize("padded", [False, True])
def test_compiled_cross_entropy_in_float32_is_float64s_to_float32_round_off(padded):
    """float32 logits large enough for the numba kernel (_cross_entropy_cpu._exponentials32: the
    row maximum and the exponentials in one read) give float64's loss and gradient to float32
    round-off; a NaN logit makes its row's loss NaN, as NumPy's passes do."""
    import npmegatron.tensor_parallel.cross_entropy as ce
    from npmegatron.comm import Group
    rows, width = 96, 4096
    vocab = width - 100 if padded else width
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((1, rows, width)) * 3
    targets = rng.integers(0, vocab, (1, rows))
    assert ce._compiled(logits.reshape(rows, width).astype(np.float32), vocab)
    results = []
    for dtype in (np.float32, np.float64):
        x = ag.Tensor(logits.astype(dtype), requires_grad=True)
        loss = ce.vocab_parallel_cross_entropy(x, targets, Group.single("tp"), 0, vocab)
        loss.backward()
        results.append((loss.item(), x.grad))
    (loss_32, grad_32), (loss_64, grad_64) = results
    assert grad_32.dtype == np.float32
    assert loss_32 == pytest.approx(loss_64, rel=1e-6)
    np.testing.assert_allclose(grad_32, grad_64, rtol=1e-4, atol=1e-10)
    assert not grad_32[..., vocab:].any()
    logits[0, 5, 7] = np.nan
    per_token = ce.vocab_parallel_cross_entropy(ag.Tensor(logits.astype(np.float32)), targets,
                                                Group.single("tp"), 0, vocab, reduction="none").data
    assert np.isnan(per_token[0, 5]) and np.isfinite(np.delete(per_token[0], 5)).all()
