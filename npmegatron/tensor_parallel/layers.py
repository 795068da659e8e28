"""Tensor-parallel layers (paper §3, Fig. 3): column- and row-parallel linear layers and the
vocabulary-parallel embedding. With a TP group of one rank they are the serial layers."""
from npmegatron import autograd as ag
from npmegatron import comm
from npmegatron.autograd import Function, InputError
from npmegatron.autograd.ops.arithmetic import Linear
from npmegatron.autograd.ops.mlp import GeluMLP
from npmegatron.autograd.backend import get_array_module, scatter_add
from npmegatron.module import Module, ParamSpec, parameter

from .mappings import (gather_from_sp_region, gather_from_tp_region,
                       reduce_from_tp_region, reduce_scatter_to_sp_region)


def divide(numerator, denominator, what):
    if numerator % denominator:
        raise InputError(f"{what} {numerator} is not divisible by the tensor-parallel size "
                         f"{denominator}; choose a TP size that divides it")
    return numerator // denominator


def pad_vocab_size(vocab_size, tp_size, divisible_by=128):
    """Round the vocabulary up to a multiple of divisible_by * TP (paper §5.1: 50,257 -> 51,200
    at TP=8), so every rank holds an equal shard of whole 128-column blocks."""
    if divisible_by < 1:
        raise InputError(f"make_vocab_size_divisible_by {divisible_by} must be a positive integer")
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


class ColumnParallelLinear(Module):
    """y = x W + b with the columns (outputs) of W and b split over the TP ranks. Its input
    enters the TP region through f (identity forward, all-reduce backward; one op with the GEMM,
    _LinearWithAsyncGradAllReduce), or under sequence parallelism through an all-gather of the
    sequence; the output stays split unless gathered."""

    def __init__(self, xp, dtype, in_features, out_features, std, group, sequence_parallel=False,
                 gather_output=False, skip_bias_add=False, bias=True):
        local = divide(out_features, group.size, "output size")
        cols = slice(group.rank * local, (group.rank + 1) * local)
        self.group, self.sequence_parallel, self.gather_output = group, sequence_parallel, gather_output
        self.skip_bias_add = skip_bias_add      # (x W, b) returned apart, for a fused bias + GeLU
        self.weight = parameter(xp, (in_features, local), dtype)
        self.specs = {"weight": ParamSpec(std, (in_features, out_features), (slice(None), cols), tp_axis=1)}
        self.bias = parameter(xp, (local,), dtype) if bias else None    # None: --disable-bias-linear
        if bias:
            self.specs["bias"] = ParamSpec("zeros", (out_features,), (cols,), tp_axis=0)

    def forward(self, x):
        bias = None if self.skip_bias_add else self.bias
        y = column_parallel_linear(x, self.weight, bias, self.group, self.sequence_parallel)
        if self.skip_bias_add:
            return y, self.bias
        return gather_from_tp_region(y, self.group) if self.gather_output else y


def column_parallel_linear(x, weight, bias, group, sequence_parallel):
    """x W + b for a column shard W of a weight: x enters the TP region through f fused with the
    GEMM, or through the sequence's all-gather under SP (ColumnParallelLinear's forward, also
    for a weight made of several column-parallel parts, as SwiGLU's gate and up)."""
    if sequence_parallel:
        return ag.linear(gather_from_sp_region(x, group), weight, bias)
    if group.size > 1:
        operands = (x, weight) if bias is None else (x, weight, bias)
        return _LinearWithAsyncGradAllReduce.apply(*operands, group=group)
    return ag.linear(x, weight, bias)


class _LinearWithAsyncGradAllReduce(Linear):
    """f then x W + b as one op (Megatron's async tensor-parallel all-reduce). Backward computes
    the input's gradient first and starts f's all-reduce of it, computes the weight and bias
    gradients, and only then waits. On a GPU the all-reduce runs on the group's stream meanwhile;
    on the CPU (comm/shared_memory.py) a rank that reaches it first posts its share and computes
    its weight GEMM, so a lag between the ranks shorter than that GEMM is not waited out."""

    @staticmethod
    def forward(ctx, x, w, b=None, group=None):
        ctx.group = group
        return Linear.forward(ctx, x, w, b)

    @staticmethod
    def backward(ctx, g):
        gx = Linear.input_grad(ctx, g, sixteen_bit=False)      # summed in float32, then rounded
        reduction = comm.all_reduce_async(gx, ctx.group) if gx is not None else None
        gw, gb = Linear.parameter_grads(ctx, g)
        return (reduction.wait() if reduction else None), gw, gb


def parallel_gelu_mlp(x, fc, proj):
    """proj(gelu(fc(x))) as the model's MLP under 16-bit storage (ag.gelu_mlp: both GEMMs and GeLU
    in one Function, GeLU in their epilogues on a GPU): x enters the TP region as it enters fc (f
    fused with the Function, or the sequence's all-gather under SP) and the partial sums leave it
    as they leave proj. Returns (y, proj's bias), as the two Linears with skip_bias_add do."""
    group = fc.group
    if fc.sequence_parallel:
        partial = ag.gelu_mlp(gather_from_sp_region(x, group), fc.weight, fc.bias, proj.weight)
        return reduce_scatter_to_sp_region(partial, group), proj.bias
    if group.size > 1:
        partial = _GeluMLPWithAsyncGradAllReduce.apply(x, fc.weight, fc.bias, proj.weight, group=group)
    else:
        partial = ag.gelu_mlp(x, fc.weight, fc.bias, proj.weight)
    return reduce_from_tp_region(partial, group), proj.bias


class _GeluMLPWithAsyncGradAllReduce(GeluMLP):
    """f then the MLP as one op, f's all-reduce of x's gradient started before the weights'
    gradients are computed and waited for after (_LinearWithAsyncGradAllReduce's overlap)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, group=None):
        ctx.group = group
        return GeluMLP.forward(ctx, x, w1, b1, w2)

    @staticmethod
    def backward(ctx, g):
        d = GeluMLP.gelu_input_grad(ctx, g)
        gx = GeluMLP.input_grad(ctx, d, sixteen_bit=False)     # summed in float32, then rounded
        reduction = comm.all_reduce_async(gx, ctx.group) if gx is not None else None
        grads = GeluMLP.parameter_grads(ctx, g, d)
        return ((reduction.wait() if reduction else None),) + grads


class RowParallelLinear(Module):
    """y = x W + b with the rows (inputs) of W split: each rank multiplies its slice of the
    input, and the partial sums leave the TP region through g (all-reduce forward, identity
    backward), or under sequence parallelism through a reduce-scatter of the sequence. The bias
    is added once, after the reduction; added before, it would be summed TP times. With
    skip_bias_add, (y, b) are returned apart for the block's fused bias + dropout + residual."""

    def __init__(self, xp, dtype, in_features, out_features, std, group, sequence_parallel=False,
                 skip_bias_add=False, bias=True):
        local = divide(in_features, group.size, "input size")
        rows = slice(group.rank * local, (group.rank + 1) * local)
        self.group, self.sequence_parallel, self.skip_bias_add = group, sequence_parallel, skip_bias_add
        self.weight = parameter(xp, (local, out_features), dtype)
        self.specs = {"weight": ParamSpec(std, (in_features, out_features), (rows,), tp_axis=0)}
        self.bias = parameter(xp, (out_features,), dtype) if bias else None    # None: --disable-bias-linear
        if bias:
            self.specs["bias"] = ParamSpec("zeros", (out_features,), sp_partial=sequence_parallel)

    def forward(self, x):
        partial = ag.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp_region(partial, self.group)
        else:
            y = reduce_from_tp_region(partial, self.group)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias


class _ShardLookup(Function):
    """Rows of this rank's vocabulary shard; tokens outside [start, start + rows) read zeros and
    send no gradient (another rank owns them). Masks multiply rather than index: a boolean index
    would need the count of its true elements on the host (a GPU synchronisation). Backward adds
    its rows straight into the weight's gradient so far (the tied output layer's, computed first)
    when that is the weight's main_grad or an array the backward walk alone holds: no
    vocabulary-sized zeros, no vocabulary-sized add."""

    adds_pending_grads = True
    writes_grad_destinations = True

    @staticmethod
    def forward(ctx, ids, weight, start, whole=False):
        xp = get_array_module(weight)
        if whole:           # one shard holds every row (TP = 1): a plain gather, no masks
            ctx.local, ctx.inside, ctx.shape, ctx.dtype = ids, None, weight.shape, weight.dtype
            # a GPU's 16-bit rows stay 16-bit under --fp16/--bf16 (the embedding's end reads them)
            return weight[ids] if ag.precision.active() else _wide(weight[ids])
        local = ids - start
        inside = (local >= 0) & (local < weight.shape[0])
        local = xp.where(inside, local, 0)
        out = _wide(weight[local])
        out *= inside[..., None]
        ctx.local, ctx.inside, ctx.shape, ctx.dtype = local, inside, weight.shape, weight.dtype
        return out

    @staticmethod
    def backward(ctx, g):
        xp = get_array_module(g)
        dtype = ag.precision.master_dtype(ctx.dtype)            # float32 for 16-bit weights
        destination, gw = ctx.destination(1), ctx.owned_pending(1)
        if destination is not None and destination[0].shape == ctx.shape and destination[0].dtype == dtype:
            gw, accumulate = destination
            if not accumulate:          # the weight's first gradient this step
                gw.fill(0)
        elif gw is not None and gw.shape == ctx.shape and gw.dtype == dtype and gw.flags.c_contiguous:
            ctx.sum_pending(1)
        else:
            gw = xp.zeros(ctx.shape, dtype)
            ctx.mark_fresh(1)
        rows = g.reshape(-1, ctx.shape[1])
        if ctx.inside is not None:
            rows = rows * ctx.inside.reshape(-1, 1)      # outside rows add zeros to row 0
        scatter_add(gw, ctx.local.reshape(-1), rows)
        return None, gw


def _wide(rows):
    """Looked-up rows in float32: a GPU's 16-bit weights (--fp16/--bf16) widened, as the model
    computes in float32."""
    return ag.precision.to_float32(rows) if ag.precision.format_of(rows.dtype) else rows


class VocabParallelEmbedding(Module):
    """The word embedding with its (padded) vocabulary rows split over the TP ranks; partial
    lookups are summed with g (or reduce-scattered over the sequence under SP). The same weight,
    transposed, is the output layer (GPT-2 ties them)."""

    def __init__(self, xp, dtype, vocab_size, padded_vocab_size, hidden_size, std, group,
                 sequence_parallel=False):
        local = divide(padded_vocab_size, group.size, "padded vocabulary size")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_size, self.vocab_start = vocab_size, group.rank * local
        self.weight = parameter(xp, (local, hidden_size), dtype)
        self.specs = {"weight": ParamSpec(std, (vocab_size, hidden_size),
                                          (slice(self.vocab_start, self.vocab_start + local),),
                                          tp_axis=0, padded_rows=padded_vocab_size)}

    def forward(self, ids):
        partial = _ShardLookup.apply(ids, self.weight, start=self.vocab_start, whole=self.group.size == 1)
        if self.sequence_parallel:
            return reduce_scatter_to_sp_region(partial, self.group)
        return reduce_from_tp_region(partial, self.group)

    def logits(self, hidden):
        """This rank's vocabulary columns of hidden @ weight^T; the input enters the TP region
        through f, fused with the GEMM as in ColumnParallelLinear (or an all-gather of the
        sequence under SP)."""
        if self.sequence_parallel:
            return ag.linear(gather_from_sp_region(hidden, self.group), self.weight.T)
        if self.group.size > 1:
            return _LinearWithAsyncGradAllReduce.apply(hidden, self.weight.T, group=self.group)
        return ag.linear(hidden, self.weight.T)
