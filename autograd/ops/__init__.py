"""The ops, and the operator methods they give Tensor (`a + b`, `a @ b`, `x[i]`, `x.sum()`)."""
from .arithmetic import add, sub, mul, div, neg, pow, matmul, linear
from .shape import reshape, transpose, split, concatenate, getitem, repeat_heads
from .reduce import sum, mean, max
from .elementwise import exp, log, tanh, gelu, bias_gelu
from .dropouts import add_rows_dropout, dropout, dropout_add, bias_dropout_add
from .nn import softmax, layer_norm, embedding, cross_entropy
from .attention import causal_attention, causal_attention_packed, grouped_causal_attention
from .rms_norm import rms_norm
from .rotary import rotary, rotary_angles
from .swiglu import swiglu
from .mlp import gelu_mlp
from .grouped import RowBlocks, grouped_bias, grouped_matmul
from ..tensor import Tensor


def _reflected(op):
    return lambda self, other: op(Tensor(_as_array(other, self)), self)


def _as_array(x, like):
    from .arithmetic import _operand
    return _operand(x, like)


Tensor.__add__ = add
Tensor.__radd__ = lambda self, other: add(self, other)
Tensor.__sub__ = sub
Tensor.__rsub__ = _reflected(sub)
Tensor.__mul__ = mul
Tensor.__rmul__ = lambda self, other: mul(self, other)
Tensor.__truediv__ = div
Tensor.__rtruediv__ = _reflected(div)
Tensor.__neg__ = neg
Tensor.__pow__ = pow
Tensor.__rpow__ = _reflected(pow)
Tensor.__matmul__ = matmul
Tensor.__getitem__ = getitem
Tensor.reshape = reshape
Tensor.transpose = transpose
Tensor.T = property(lambda self: transpose(self))
Tensor.sum = sum
Tensor.mean = mean
Tensor.max = max
Tensor.exp = exp
Tensor.log = log
Tensor.tanh = tanh
