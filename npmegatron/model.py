"""GPT-2 with the semantics of HF GPT2LMHeadModel, written on npmegatron.autograd.

Pre-LayerNorm blocks, causal multi-head attention, 4h GeLU MLP, learned positions, output layer
tied to the token embedding; init as in the Megatron paper (§4.2). This serial model is the
reference every parallel configuration must equal.
"""
import math
from dataclasses import dataclass
from typing import Optional

import numpy

from . import autograd as ag
from .autograd import InputError
from .autograd.backend import array_module_for
from .module import Module, parameter


@dataclass
class GPTConfig:
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    vocab_size: int = 256                  # byte-level tokens for the embedded corpus
    max_position_embeddings: int = 256     # length of the learned position table
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden_size, as GPT-2
    hidden_dropout: float = 0.1            # embeddings and residual branches
    attention_dropout: float = 0.1         # attention probabilities
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02          # paper §4.2
    gelu: str = "tanh"                     # GPT-2's approximation; 'none' for exact erf
    dtype: str = "float32"                 # float32, or float64 for exact comparisons
    device: str = "cpu"                    # 'gpu' puts every array on CuPy
    seed: int = 1234                       # weights and dropout streams derive from it

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "max_position_embeddings", "ffn_hidden_size"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} is {getattr(self, name)}; it must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise InputError(f"hidden size {self.hidden_size} is not divisible by "
                             f"{self.num_attention_heads} attention heads; choose a hidden size that "
                             "is a multiple of the number of heads")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise InputError(f"{name} is {getattr(self, name)}; it must be in [0, 1)")
        if self.dtype not in ("float32", "float64"):
            raise InputError(f"dtype {self.dtype!r} is not supported; use float32 or float64")
        if self.device not in ("cpu", "gpu"):
            raise InputError(f"device {self.device!r} is not supported; use cpu or gpu")

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads


class Linear(Module):
    """y = x @ weight + bias, weight stored (in, out)."""

    def __init__(self, xp, dtype, in_features, out_features, std):
        self.weight = parameter(xp, (in_features, out_features), dtype)
        self.bias = parameter(xp, (out_features,), dtype)
        self.inits = {"weight": std, "bias": "zeros"}

    def forward(self, x):
        return ag.linear(x, self.weight, self.bias)


class LayerNorm(Module):
    def __init__(self, xp, dtype, size, eps):
        self.weight = parameter(xp, (size,), dtype)
        self.bias = parameter(xp, (size,), dtype)
        self.eps = eps
        self.inits = {"weight": "ones", "bias": "zeros"}

    def forward(self, x):
        return ag.layer_norm(x, self.weight, self.bias, self.eps)


class Attention(Module):
    """Causal self-attention. The fused QKV columns are laid out head by head as (q, k, v), so a
    contiguous slice of columns is a set of whole heads (what tensor parallelism will split)."""

    def __init__(self, cfg, xp, dtype, rng):
        h = cfg.hidden_size
        self.cfg, self.rng = cfg, rng
        self.qkv = Linear(xp, dtype, h, 3 * h, cfg.init_method_std)
        self.proj = Linear(xp, dtype, h, h, cfg.init_method_std / math.sqrt(2 * cfg.num_layers))

    def forward(self, x):
        b, t, _ = x.shape
        heads, d = self.cfg.num_attention_heads, self.cfg.head_dim
        qkv = self.qkv(x).reshape(b, t, heads, 3, d)
        q, k, v = (part.reshape(b, t, heads, d).transpose(0, 2, 1, 3) for part in ag.split(qkv, 3, axis=3))
        probs = ag.softmax(q @ k.transpose(0, 1, 3, 2), scale=1.0 / math.sqrt(d), causal=True)
        probs = ag.dropout(probs, self.cfg.attention_dropout, self.rng, self.training)
        y = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, heads * d)
        return self.proj(y)


class MLP(Module):
    def __init__(self, cfg, xp, dtype):
        self.cfg = cfg
        self.fc = Linear(xp, dtype, cfg.hidden_size, cfg.ffn_hidden_size, cfg.init_method_std)
        self.proj = Linear(xp, dtype, cfg.ffn_hidden_size, cfg.hidden_size,
                           cfg.init_method_std / math.sqrt(2 * cfg.num_layers))

    def forward(self, x):
        return self.proj(ag.gelu(self.fc(x), self.cfg.gelu))


class Block(Module):
    """x + drop(attn(ln_1(x))), then x + drop(mlp(ln_2(x))): GPT-2's pre-LayerNorm block."""

    def __init__(self, cfg, xp, dtype, rng):
        self.cfg, self.rng = cfg, rng
        self.ln_1 = LayerNorm(xp, dtype, cfg.hidden_size, cfg.layernorm_epsilon)
        self.attn = Attention(cfg, xp, dtype, rng)
        self.ln_2 = LayerNorm(xp, dtype, cfg.hidden_size, cfg.layernorm_epsilon)
        self.mlp = MLP(cfg, xp, dtype)

    def forward(self, x):
        p = self.cfg.hidden_dropout
        x = x + ag.dropout(self.attn(self.ln_1(x)), p, self.rng, self.training)
        return x + ag.dropout(self.mlp(self.ln_2(x)), p, self.rng, self.training)


class GPT(Module):
    def __init__(self, cfg: GPTConfig):
        self.cfg = cfg
        self.xp = xp = array_module_for(cfg.device)
        dtype = numpy.dtype(cfg.dtype)
        # One dropout stream, seeded apart from the weights (seed + 1): resuming or changing
        # dropout never changes the initial weights.
        self.rng = (xp.random.default_rng(cfg.seed + 1))
        self.wte = parameter(xp, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.wpe = parameter(xp, (cfg.max_position_embeddings, cfg.hidden_size), dtype)
        self.inits = {"wte": cfg.init_method_std, "wpe": cfg.init_method_std}
        self.blocks = [Block(cfg, xp, dtype, self.rng) for _ in range(cfg.num_layers)]
        self.ln_f = LayerNorm(xp, dtype, cfg.hidden_size, cfg.layernorm_epsilon)
        self.initialize(cfg.seed)

    def forward(self, ids, targets=None):
        """ids (batch, seq) integers -> (logits (batch, seq, vocab), mean cross-entropy or None)."""
        ids = self.xp.asarray(ids)
        if ids.ndim != 2:
            raise InputError(f"token ids must have shape (batch, seq), got {tuple(ids.shape)}")
        t = ids.shape[1]
        if t > self.cfg.max_position_embeddings:
            raise InputError(f"sequence length {t} is longer than the position table "
                             f"({self.cfg.max_position_embeddings}); use shorter sequences or a "
                             "larger --max-position-embeddings")
        x = ag.embedding(ids, self.wte) + ag.embedding(self.xp.arange(t), self.wpe)
        x = ag.dropout(x, self.cfg.hidden_dropout, self.rng, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.T   # output layer tied to the token embedding
        loss = None if targets is None else ag.cross_entropy(logits, self.xp.asarray(targets))
        return logits, loss

    def num_parameters(self):
        return sum(p.size for p in self.parameters())


def model_flops(cfg, num_params, batch, seq):
    """FLOPs of one forward + backward: 6 * params * tokens for the GEMMs with weights, plus
    12 * layers * batch * seq^2 * hidden for the attention scores and their use (the paper's count
    without its vocabulary term, which 6 * params already includes through the tied embedding)."""
    return 6 * num_params * batch * seq + 12 * cfg.num_layers * batch * seq * seq * cfg.hidden_size
