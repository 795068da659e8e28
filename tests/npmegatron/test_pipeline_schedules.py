"""Pipeline layouts and schedules without MPI: the layout language, the action order of each
schedule, and a simulation showing no schedule can wait forever on any (PP, V, M)."""
import itertools

import pytest

from npmegatron.autograd import InputError
from npmegatron.pipeline import build_actions, default_layout, parse_layout, plan_stages
from npmegatron.pipeline.schedules import BACKWARD, FORWARD


def test_layout_language():
    stages = parse_layout("Et*3|(tt|)*4,tL")
    assert stages == [["E", "t", "t", "t"]] + [["t", "t"]] * 4 + [["t", "L"]]
    specs = plan_stages(stages, 12, 3, "x")
    assert [s.layers for s in specs] == [[0, 1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11]]
    assert specs[0].pre_process and specs[-1].post_process and not specs[2].pre_process
    assert default_layout(4, 2) == "Ett|ttL"
    assert default_layout(4, 2, virtual=2) == "Et|t|t|tL"
    with pytest.raises(InputError, match="5 layers do not split evenly .*; change num_layers or give a layout string$"):
        default_layout(5, 2)


@pytest.mark.parametrize("layout,layers,pp,message", [
    ("Ett|tL", 4, 2, "has 3 transformer layers but the model has 4"),
    ("tt|ttL", 4, 2, "must start with the embedding E, once"),
    ("Ett|tt", 4, 2, "must end with the loss L, once"),
    ("Ett||ttL", 4, 3, "has an empty stage"),
    ("Ett|ttL", 4, 4, "has 2 stages, not a multiple of the pipeline size 4"),
    ("Ett|tqL", 4, 2, "unknown symbol 'q'"),
    ("E(tt|ttL", 4, 2, "unclosed '('"),
    ("Et*|tttL", 4, 2, "'*' without a count"),
])
def test_bad_layouts_are_one_sentence(layout, layers, pp, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace("*", r"\*")):
        plan_stages(parse_layout(layout), layers, pp, layout)


def test_1f1b_warms_up_pp_minus_rank_minus_one_forwards():
    for pp, m in [(4, 8), (4, 2), (2, 1)]:
        for rank in range(pp):
            actions = build_actions("1f1b", rank, pp, 1, m)
            before_first_backward = next(i for i, a in enumerate(actions) if a[0] == BACKWARD)
            warmup = min(pp - rank - 1, m)
            assert before_first_backward == warmup + (1 if m > warmup else 0), (pp, m, rank)
            assert sorted(actions) == sorted([(k, 0, i) for k in (FORWARD, BACKWARD) for i in range(m)])


def test_interleaved_needs_a_multiple_of_pp_micro_batches():
    with pytest.raises(InputError, match="micro-batches \\(3\\) to be a multiple of the pipeline size 2; "
                       "change num_micro_batches$"):
        build_actions("interleaved", 0, 2, 2, 3)
    with pytest.raises(InputError, match="use the interleaved \\(or afab\\) schedule$"):
        build_actions("1f1b", 0, 2, 2, 4)


def simulate(schedule, pp, v, m):
    """Run every rank's action list with blocking receives and non-blocking sends: an action
    may run once the stage it receives from has produced its data. Returns True if all finish."""
    actions = {r: list(build_actions(schedule, r, pp, v, m)) for r in range(pp)}
    done = set()               # (kind, global stage, micro-batch)
    stages = pp * v
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while actions[r]:
                kind, c, i = actions[r][0]
                s = c * pp + r
                if kind == FORWARD:
                    ready = s == 0 or (FORWARD, s - 1, i) in done
                else:
                    ready = (FORWARD, s, i) in done and (s == stages - 1 or (BACKWARD, s + 1, i) in done)
                if not ready:
                    break
                done.add((kind, s, i))
                actions[r].pop(0)
                progress = True
    return all(not a for a in actions.values())


def test_no_schedule_waits_forever():
    for pp, m in itertools.product([1, 2, 3, 4, 8], [1, 2, 4, 8, 12, 16]):
        assert simulate("1f1b", pp, 1, m), (pp, m)
        assert simulate("afab", pp, 1, m), (pp, m)
        for v in (1, 2, 3):
            if m % pp == 0:
                assert simulate("interleaved", pp, v, m), (pp, v, m)
            assert simulate("afab", pp, v, m), (pp, v, m)


@pytest.mark.parametrize("schedule,virtual", [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("afab", 2)])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_each_neighbour_sends_exactly_what_a_rank_receives(schedule, virtual, pp):
    """order.py's view of a neighbour's sends covers every receive a rank's actions wait for,
    each once, so posting receives in that order never skips or repeats a message."""
    from npmegatron.pipeline.exchange import ACTIVATION, GRADIENT
    from npmegatron.pipeline.order import ReceiveOrder
    m = 2 * pp

    def actions_of(rank):
        return build_actions(schedule, rank, pp, virtual, m)

    last = pp * virtual - 1
    for rank in range(pp):
        needed = []
        for kind, chunk, micro_batch in actions_of(rank):
            stage = chunk * pp + rank
            if kind == FORWARD and stage != 0:
                needed.append((ACTIVATION, stage, micro_batch))
            if kind == BACKWARD and stage != last:
                needed.append((GRADIENT, stage, micro_batch))
        order = ReceiveOrder(actions_of, rank, pp, virtual)
        sent = [key for queue in order.pending.values() for key in queue]
        assert sorted(sent) == sorted(needed)
        for key in needed:          # taken in the order they are needed, every queue empties
            if any(key in queue for queue in order.pending.values()):
                order.up_to(key)
        assert all(not queue for queue in order.pending.values())
