"""Which tokens a context-parallel rank holds. Causal attention gives the last tokens of a
sequence the most keys to see, so a plain split in C parts would give the last rank C times the
first one's work. As Megatron-LM does, the sequence is cut into 2C chunks and rank i holds
chunks i and 2C - 1 - i: one early and one late, the same work on every rank."""
import numpy

from ..config import check_context_parallel_split


def local_positions(seq_length, cp_rank, cp_size):
    """The positions (a host int64 array, in order) of the tokens rank `cp_rank` of `cp_size`
    holds in a sequence of `seq_length`; all positions when cp_size is 1."""
    if cp_size == 1:
        return numpy.arange(seq_length)
    check_context_parallel_split(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    early, late = cp_rank, 2 * cp_size - 1 - cp_rank
    return numpy.concatenate([numpy.arange(early * chunk, (early + 1) * chunk),
                              numpy.arange(late * chunk, (late + 1) * chunk)])
