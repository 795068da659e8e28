"""Tensor and sequence parallelism (paper §3; Megatron-LM's core/tensor_parallel)."""
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, column_parallel_linear,
                     divide, pad_vocab_size, parallel_gelu_mlp)
from .mappings import (copy_to_tp_region, gather_from_sp_region, gather_from_tp_region, gather_whole_sequence,
                       reduce_from_tp_region, reduce_scatter_to_sp_region, scatter_to_sp_region,
                       scatter_to_tp_region)
from .random import MODEL_PARALLEL, DEFAULT, RNGTracker

__all__ = [
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sp_region", "gather_from_sp_region", "gather_whole_sequence", "reduce_scatter_to_sp_region",
    "ColumnParallelLinear", "column_parallel_linear", "parallel_gelu_mlp", "RowParallelLinear", "VocabParallelEmbedding", "pad_vocab_size", "divide",
    "vocab_parallel_cross_entropy", "RNGTracker", "DEFAULT", "MODEL_PARALLEL",
]
