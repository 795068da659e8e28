"""Multi-GPU hazards a reading of the GPU path found, each shown on the strict CuPy stand-in (NCCL
over MPI): communicators made at grid set-up in one order on every rank, no device-wide
synchronisation while NCCL calls may be in flight, DP bucket all-reduces that overlap backward
under the interleaved schedule, buckets never written while being reduced, and communication
timed by events on the GPU. One 4-rank run (tests/ranks/multi_gpu_safety.py) gives the facts."""
import json

import numpy
import pytest

from fakes.strict_cupy import strict_cupy_env
from npmegatron.autograd import Tensor
from npmegatron.comm.group import Group
from npmegatron.data_parallel.buckets import BucketWrittenError
from npmegatron.data_parallel.distributed_optimizer import ShardedGradientBuckets

ELAPSED_S = 2.5e-3      # what the rank program makes get_elapsed_time answer (2.5 ms)


@pytest.fixture(scope="module")
def facts():
    """Each rank's facts of one interleaved PP 2 x DP 2 training step on the stand-in."""
    from helpers import run_ranks
    result = run_ranks(4, "ranks/multi_gpu_safety.py", env=strict_cupy_env(devices=4), timeout=300)
    lines = [line[len("FACTS "):] for line in result.stdout.splitlines() if line.startswith("FACTS ")]
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


def test_every_communicator_is_made_at_set_up_in_one_order(facts):
    """The DP group's communicator was made inside its first collective, in a backward hook:
    NCCL's set-up blocks until every member joins, so ranks that reach their first collectives in
    different orders (a pipeline stage that waits on its neighbour) wait on each other for ever."""
    for rank, f in enumerate(facts):
        assert f["missing"] == [], f"rank {rank}: no NCCL communicator at set-up for {f['missing']}"
        assert f["created_in_step"] == 0, f"rank {rank}: {f['created_in_step']} communicators made mid-step"
    orders = {tuple(f["order"]) for f in facts}
    assert orders == {("dp", "pp", "mp", "embd", "pp 0->1", "pp 1->0")}, orders


def test_no_device_wide_synchronize_during_a_timed_step(facts):
    """Timers synchronised the device at every start and stop; a device synchronisation also
    waits for the DP all-reduce on its stream, which waits for the other replicas."""
    syncs = [f["device_syncs"] for f in facts]
    assert syncs == [0, 0, 0, 0], f"device-wide synchronisations during the step per rank: {syncs}"


def test_dp_all_reduces_overlap_backward_under_the_interleaved_schedule(facts):
    """Buckets started only with the rank's last backward, and the last virtual stage's buckets,
    first in launch order, could not even start then: no DP reduction overlapped backward."""
    for rank, f in enumerate(facts):
        before = f["dp_before_backward"]
        assert len(before) == 8, before                 # 4 micro-batches x 2 virtual stages
        assert before[-1] > 0, f"rank {rank}: DP all-reduces issued before each backward: {before}"
        assert before[-1] < f["buckets"], before        # the first stage's buckets wait for it


def test_communication_is_timed_by_events_on_the_gpu(facts):
    """comm.stats() and the dp-comm timer measured the host's time to enqueue the NCCL calls."""
    for rank, f in enumerate(facts):
        stats = f["timings"]["stats"]
        assert "all_reduce[dp]" in stats and ("send[pp]" in stats or "recv[pp]" in stats), stats
        for name, (count, seconds) in stats.items():
            assert seconds == pytest.approx(count * ELAPSED_S), (rank, name, count, seconds)
        count, seconds = f["timings"]["dp_comm"]
        assert count == 1 and seconds == pytest.approx(ELAPSED_S), (rank, count, seconds)


def test_a_bucket_being_reduced_is_never_written():
    """A gradient that reaches a bucket after its reduction started would make ranks average
    different numbers (on a GPU the all-reduce reads the bucket on its own stream): refused."""
    w = Tensor(numpy.ones(4), requires_grad=True)
    buckets = ShardedGradientBuckets([w], Group.single("dp"))      # one rank: reduced at once
    buckets.zero_grad()
    buckets.start_sync()
    (w * w).sum().backward()                    # the bucket is complete: its reduction starts
    assert buckets.buckets[0].request is not None
    with pytest.raises(BucketWrittenError, match="bucket 0"):
        (w * 3.0).sum().backward()              # a late contribution into the same bucket
    with pytest.raises(BucketWrittenError):
        buckets.zero_grad()
    buckets.finish_sync()
    buckets.zero_grad()                         # reduced and waited on: writable again
