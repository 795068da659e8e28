"""npmegatron.autograd: a minimal tape-based autograd over NumPy and CuPy arrays.

Plays the role PyTorch's autograd plays under Megatron-LM: `Tensor`, `Function` (forward and
backward side by side on plain arrays), a reverse-topological `backward`, and the ops GPT-2 needs.
"""
from .backend import get_array_module
from .errors import InputError
from .tensor import Tensor, enable_grad, no_grad, is_grad_enabled
from .function import Function
from .graph import grad_accumulator
from .engine import backward
from .recomputation import recompute
from . import precision
from .ops import (
    add, sub, mul, div, neg, pow, matmul, linear,
    reshape, transpose, split, concatenate, getitem,
    sum, mean, max,
    exp, log, tanh, gelu, bias_gelu,
    softmax, layer_norm, dropout, dropout_add, bias_dropout_add, add_rows_dropout, embedding, cross_entropy,
    causal_attention, causal_attention_packed, grouped_causal_attention, repeat_heads, rms_norm, rotary, rotary_angles,
    swiglu, gelu_mlp, RowBlocks, grouped_matmul, grouped_bias,
)
from .gradcheck import gradcheck, numerical_grad

__all__ = [
    "InputError", "get_array_module", "Tensor", "no_grad", "enable_grad", "is_grad_enabled", "Function",
    "grad_accumulator", "backward", "recompute", "precision",
    "add", "sub", "mul", "div", "neg", "pow", "matmul", "linear",
    "reshape", "transpose", "split", "concatenate", "getitem",
    "sum", "mean", "max", "exp", "log", "tanh", "gelu", "bias_gelu",
    "softmax", "layer_norm", "dropout", "dropout_add", "bias_dropout_add", "add_rows_dropout", "embedding",
    "cross_entropy",
    "causal_attention", "causal_attention_packed", "grouped_causal_attention", "repeat_heads", "rms_norm",
    "rotary", "rotary_angles", "swiglu", "gelu_mlp", "RowBlocks", "grouped_matmul", "grouped_bias", "gradcheck",
    "numerical_grad",
]
