"""Pipeline parallelism under mpiexec, float64: every (PP, TP, DP) and schedule gives the serial
model's loss and every gradient to 1e-10 relative, with custom uneven layouts and with
variable-length micro-batches; the memory of the schedules; training and resume with PP > 1."""
import json

import pytest

from test_train_mpirun import launch

CHECK = r'''
import json, sys
import numpy as np
import npmegatron.autograd as ag
from npmegatron import comm
from npmegatron.data_parallel import GradientBuckets
from npmegatron.model import GPT, GPTConfig
from npmegatron.pipeline import (PipelineModel, StageExchange, default_layout, parse_layout,
                                 plan_stages, run_schedule)

world = comm.init()
worst = 0.0
for case in json.loads(sys.argv[1]):
    grid = comm.ProcessGrid(tp=case["tp"], pp=case["pp"])
    layers = case.get("layers", 4)
    cfg = GPTConfig(num_layers=layers, hidden_size=16, num_attention_heads=4, vocab_size=50,
                    max_position_embeddings=12, dtype="float64", hidden_dropout=0.0,
                    attention_dropout=0.0, sequence_parallel=case.get("sp", False))
    m, dp = case["m"], grid.dp_size
    rng = np.random.default_rng(7)
    lengths = [4 + 2 * (i % 4) if case.get("variable") else 12 for i in range(m * dp)]
    batches = [(ids[:, :-1], ids[:, 1:]) for ids in (rng.integers(0, 50, (2, n + 1)) for n in lengths)]

    serial = GPT(cfg)
    total = 0.0
    for x, y in batches:
        _, loss = serial(x, y)
        ag.backward(loss, np.asarray(1.0 / (m * dp)))
        total += loss.item()
    reference = dict(serial.named_parameters())

    layout = case.get("layout") or default_layout(layers, case["pp"], case.get("virtual", 1))
    model = PipelineModel(cfg, grid, plan_stages(parse_layout(layout), layers, case["pp"], layout))
    exchange = StageExchange(grid, "float64", np, m, case.get("variable", False))
    buckets = GradientBuckets(model.parameters(), grid.dp_group, bucket_size=3000)
    buckets.zero_grad()
    mine = batches[grid.dp_rank * m:(grid.dp_rank + 1) * m]
    loss_sum = run_schedule(model, exchange, mine, case["schedule"], buckets=buckets)
    buckets.finish_sync()
    model.finalize_grads()
    loss = comm.all_reduce(comm.all_reduce(np.array([loss_sum]), grid.pp_group), grid.dp_group)[0] / (m * dp)
    errors = [abs(loss - total / (m * dp)) / abs(total / (m * dp))]
    for name, param, spec in model.named_specs():
        grad = param.grad
        if spec.tp_axis is not None:
            grad = comm.all_gather(grad, grid.tp_group, axis=spec.tp_axis)
        cut = tuple(slice(0, n) for n in spec.shape)
        want = reference[name].grad[cut]
        errors.append(float(np.abs(grad[cut] - want).max() / np.abs(want).max()))
    worst = max(worst, max(errors))
    assert max(errors) < 1e-10, (case, max(errors))
    comm.barrier(world)
if world.rank == 0:
    print("worst relative error " + repr(worst), flush=True)
'''


def check(mpirun, n, cases):
    result = mpirun(n, CHECK, args=[json.dumps(cases)], timeout=300)
    assert "worst relative error" in result.stdout, result
    return float(result.stdout.split("worst relative error")[1].split()[0])


SCHEDULES = [{"schedule": "afab"}, {"schedule": "1f1b"}, {"schedule": "interleaved", "virtual": 2, "layers": 8}]


def test_two_stages_every_schedule_layout_and_variable_lengths(mpirun):
    cases = [dict(tp=1, pp=2, m=4, **s) for s in SCHEDULES]
    cases += [dict(tp=1, pp=2, m=4, schedule="1f1b", layout="Et|tttL"),          # uneven
              dict(tp=1, pp=2, m=4, schedule="interleaved", layout="E|t|ttt|tL", layers=5),
              dict(tp=1, pp=2, m=4, schedule="1f1b", variable=True),
              dict(tp=1, pp=2, m=4, schedule="interleaved", virtual=2, variable=True)]
    assert check(mpirun, 2, cases) < 1e-10


def test_four_ranks_pp4_pp2xtp2_pp2xdp2(mpirun):
    cases = []
    for grid in (dict(tp=1, pp=4), dict(tp=2, pp=2), dict(tp=1, pp=2)):     # the last is DP=2
        cases += [dict(m=4, **grid, **s) for s in SCHEDULES]
    cases += [dict(tp=1, pp=4, m=4, schedule="1f1b", layout="Ettt|t|t|tL", layers=6),
              dict(tp=2, pp=2, m=4, schedule="1f1b", variable=True, sp=True),
              dict(tp=1, pp=2, m=4, schedule="afab", variable=True, layout="Ettt|tL")]
    assert check(mpirun, 4, cases) < 1e-10


def test_eight_ranks_pp4xtp2_and_pp2xtp2xdp2(mpirun):
    cases = []
    for grid in (dict(tp=2, pp=4), dict(tp=2, pp=2)):                         # the last is DP=2
        cases += [dict(m=4, **grid, **s) for s in SCHEDULES]
    cases += [dict(tp=2, pp=4, m=4, schedule="interleaved", layout="Et|t|t|t|t|t|t|tL", layers=8,
                   variable=True, sp=True)]
    assert check(mpirun, 8, cases) < 1e-10
