"""The MoE layers' figures for a training log interval, under Megatron-Core's names: the
load-balancing loss and the z-loss without their coefficients (means over the interval's
forwards and over the MoE layers, averaged over the data-parallel replicas), each layer's
busiest expert's tokens over the mean expert's (the interval's counts summed over the replicas),
averaged over the layers, and under a capacity factor the (token, expert) choices dropped in the
interval, over all layers and replicas. Collective over the pipeline and data-parallel groups: every rank
calls it at every interval."""
import numpy

from .. import comm
from . import aux_loss
from .router import TopKRouter

NAMES = ("load_balancing_loss", "z_loss")


def interval_metrics(model, grid):
    """{name: value} of the interval since the last call (empty for a model without MoE layers)."""
    if model.cfg.num_experts is None:
        return {}
    values = aux_loss.take_values()
    routers = [m for _, m in model.named_modules() if isinstance(m, TopKRouter)]
    local = []
    for name in NAMES:
        layers = values.get(name, {})
        local += [sum(layers.values()), len(layers)]
    ratios = []
    for router in routers:
        counts = router.interval_tokens_per_expert
        router.interval_tokens_per_expert = None
        counts = numpy.zeros(model.cfg.num_experts) if counts is None else numpy.asarray(counts, numpy.float64)
        counts = comm.all_reduce(counts, grid.dp_cp_group)
        ratios.append(counts.max() / counts.mean() if counts.mean() > 0 else 0.0)
    local += [sum(ratios), len(ratios), sum(router.interval_dropped for router in routers)]
    for router in routers:
        router.interval_dropped = 0
    total = comm.all_reduce(comm.all_reduce(numpy.asarray(local, numpy.float64), grid.pp_group), grid.dp_cp_group)
    record = {}
    for i, name in enumerate(NAMES + ("tokens_per_expert_max_over_mean",)):
        if total[2 * i + 1] > 0:
            record[name] = float(total[2 * i] / total[2 * i + 1])
    if model.cfg.moe_expert_capacity_factor is not None:
        record["dropped_tokens"] = int(total[-1])       # (token, expert) choices, all layers and replicas
    return record
