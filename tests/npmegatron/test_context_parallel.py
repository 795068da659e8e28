"""Context parallelism: sequences split over a CP group in the balanced causal way, attention as
ring attention, equal to the serial model in float64 (loss, logits, every gradient) for GPT-2 and
the Llama family, alone and with TP (and SP), PP and DP; the ring's messages counted, and correct
when a pair's messages match in posting order (NCCL's rule)."""
import json

import numpy as np
import pytest

from npmegatron.autograd import InputError
from npmegatron.config import TrainConfig
from npmegatron.context_parallel import local_positions

CP_RANKS = "ranks/context_parallel.py"
PIPELINE_RANKS = "ranks/pipeline_parallel.py"


def reports(result):
    return [json.loads(l) for l in result.stdout.splitlines() if l.startswith("{")]


@pytest.mark.quick_variants("2-1")
@pytest.mark.parametrize("cp, tp", [(2, 1), (4, 1), (2, 2)])
def test_equals_serial_loss_logits_and_every_gradient(mpirun, cp, tp):
    rows = reports(mpirun(cp * tp, CP_RANKS, args=["equals-serial", cp, tp], timeout=180))
    assert {r["family"] for r in rows} == {"gpt2", "llama"}
    assert len(rows) == (4 if tp > 1 else 2) + 2          # with TP: without and with SP; recomputed
    assert all(r["max_rel_error"] < 1e-10 for r in rows)


def cases(**grid):
    return [dict(m=4, seq=16, family=family, **grid) for family in ("gpt2", "llama")]


def worst(result):
    return float(result.stdout.split("worst relative error")[1].split()[0])


def test_with_pipeline_schedules_and_data_parallelism(mpirun):
    """Through the training step (pipeline schedule, DP x CP gradient buckets): CP 2 with PP 2
    (1F1B, interleaved) and with DP 2, on 4 ranks."""
    grid = cases(tp=1, pp=2, cp=2, schedule="1f1b") + cases(tp=1, pp=2, cp=2, schedule="interleaved",
                                                             virtual=2, layers=8)
    grid += cases(tp=1, pp=1, cp=2, schedule="1f1b")                     # 4 ranks: DP 2
    assert worst(mpirun(4, PIPELINE_RANKS, args=["check", json.dumps(grid)], timeout=300)) < 1e-10


@pytest.mark.slow
def test_eight_ranks_tp2_cp2_pp2_and_cp2_pp2_dp2(mpirun):
    grid = cases(tp=2, pp=2, cp=2, schedule="1f1b", sp=True) + cases(tp=1, pp=2, cp=2, schedule="afab")
    assert worst(mpirun(8, PIPELINE_RANKS, args=["check", json.dumps(grid)], timeout=300)) < 1e-10


def test_ring_is_correct_when_messages_match_in_posting_order(mpirun):
    """NPMEGATRON_P2P_ORDERED=1: the MPI backend ignores tags as NCCL does."""
    grid = cases(tp=1, pp=1, cp=4, schedule="1f1b") + cases(tp=1, pp=2, cp=2, schedule="1f1b")
    result = mpirun(4, PIPELINE_RANKS, args=["check", json.dumps(grid)], timeout=300,
                    env={"NPMEGATRON_P2P_ORDERED": "1"})
    assert worst(result) < 1e-10


@pytest.mark.quick_variants("2")
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_messages_per_layer(mpirun, cp):
    """Forward: each other rank's key/value block once (CP - 1 sends); backward: the blocks again
    and their gradients one step further, home (2 CP - 1). Blocks carry the key/value groups only
    (2 of the 8 query heads' worth here)."""
    row = reports(mpirun(cp, CP_RANKS, args=["counts"]))[0]
    block = 2 * 2 * 2 * (16 // cp) * 4 * 8     # (k and v, batch, groups, local tokens, head dim) float64
    assert row["per_layer"] == [cp - 1, 2 * cp - 1, (cp - 1) * block]


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_balanced_split_gives_every_rank_the_same_causal_work(cp):
    t = 64
    held = [local_positions(t, r, cp) for r in range(cp)]
    assert sorted(np.concatenate(held).tolist()) == list(range(t))
    work = {int((positions + 1).sum()) for positions in held}      # keys each rank's queries see
    assert len(work) == 1


@pytest.mark.parametrize("options, words", [
    (dict(context_parallel_size=2, seq_length=10), "sequence length 10 is not divisible by 2 x context-parallel size 2"),
    (dict(context_parallel_size=2, hidden_dropout=0.1), "--cp 2 runs without dropout, but --hidden-dropout is 0.1"),
    (dict(context_parallel_size=2), "--tp 1 x --pp 1 x --cp 2 needs 2 ranks"),
    (dict(context_parallel_size=2, tensor_model_parallel_size=2, world=6), "world size 6 is not divisible"),
])
def test_bad_context_parallel_settings_are_one_sentence(options, words):
    world = options.pop("world", 4 if "hidden_dropout" in options or "seq_length" in options else 1)
    with pytest.raises(InputError, match=words.replace("(", r"\(")):
        TrainConfig.from_flat(**options).plan(world)
