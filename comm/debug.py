"""Debug mode (NPMEGATRON_DEBUG_COMM=1): before each collective the ranks of the group exchange
a short description of their call and stop with a clear error when they disagree, instead of
hanging or silently mixing buffers."""
import os

import numpy

_WIDTH = 192


class CommMismatchError(RuntimeError):
    """Ranks of one group made different collective calls."""


def enabled():
    return os.environ.get("NPMEGATRON_DEBUG_COMM", "0") not in ("", "0")


def check_agreement(group, description):
    """Raise CommMismatchError on every rank of the group if their descriptions differ."""
    mine = numpy.zeros(_WIDTH, numpy.uint8)
    encoded = description.encode()[:_WIDTH]
    mine[:len(encoded)] = numpy.frombuffer(encoded, numpy.uint8)
    everyone = numpy.empty((group.size, _WIDTH), numpy.uint8)
    group.mpi.Allgather(mine, everyone)
    calls = [bytes(row).rstrip(b"\0").decode() for row in everyone]
    other = next((i for i, c in enumerate(calls) if c != calls[0]), None)
    if other is not None:
        raise CommMismatchError(
            f"mismatched collectives in group {group.name}: rank {group.ranks[0]} called {calls[0]} "
            f"but rank {group.ranks[other]} called {calls[other]}; every rank of a group must make "
            "the same collective call with the same shape and dtype")


def check_counts(group, send_counts, recv_counts):
    """all_to_all_v: raise CommMismatchError on every rank of the group unless each rank expects
    from every other the rows that one sends it (else MPI fails on a truncated message, or NCCL
    hangs). Every rank sees all counts, so all of them raise together."""
    mine = numpy.concatenate([send_counts, recv_counts]).astype(numpy.int64)
    everyone = numpy.empty((group.size, 2, group.size), numpy.int64)
    group.mpi.Allgather(mine, everyone)
    sent, expected = everyone[:, 0], everyone[:, 1].T      # [i, j]: rows from rank i to rank j
    bad = numpy.argwhere(sent != expected)
    if len(bad):
        i, j = bad[0]
        raise CommMismatchError(
            f"all_to_all_v counts disagree in group {group.name}: rank {group.ranks[i]} sends "
            f"{sent[i, j]} rows to rank {group.ranks[j]}, which expects {expected[i, j]}; each rank's "
            "recv_counts[i] must equal group rank i's send_counts entry for it")
