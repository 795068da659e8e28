"""Which tokens a context-parallel rank holds. Causal attention gives the last tokens of a
sequence the most keys to see, so a plain split in C parts would give the last rank C times the
first one's work. As Megatron-LM does, the sequence is cut into 2C chunks and rank i holds
chunks i and 2C - 1 - i: one early and one late, the same work on every rank."""
import numpy

from ..autograd import InputError


def local_positions(seq_length, cp_rank, cp_size):
    """The positions (a host int64 array, in order) of the tokens rank `cp_rank` of `cp_size`
    holds in a sequence of `seq_length`; all positions when cp_size is 1."""
    if cp_size == 1:
        return numpy.arange(seq_length)
    check_divisible(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    early, late = cp_rank, 2 * cp_size - 1 - cp_rank
    return numpy.concatenate([numpy.arange(early * chunk, (early + 1) * chunk),
                              numpy.arange(late * chunk, (late + 1) * chunk)])


def check_divisible(seq_length, cp_size):
    if seq_length % (2 * cp_size):
        raise InputError(f"sequence length {seq_length} is not divisible by 2 x context-parallel size "
                         f"{cp_size} = {2 * cp_size}, as the balanced causal split needs; use a multiple "
                         f"of {2 * cp_size}")


def check_no_dropout(cfg, cp_size):
    """Context parallelism runs without dropout: ring attention draws no masks, and the masks of
    the other layers are keyed by their shape and place in the model, not by token positions, so
    the CP ranks would drop the same entries of different tokens."""
    for name in ("hidden_dropout", "attention_dropout"):
        if getattr(cfg, name) > 0:
            flag = "--" + name.replace("_", "-")
            raise InputError(f"--cp {cp_size} runs without dropout, but {flag} is {getattr(cfg, name)}; "
                             f"pass {flag} 0")
