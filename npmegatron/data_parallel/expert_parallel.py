"""Gradients and the optimizer under expert parallelism (--expert-model-parallel-size EP): the
experts are split over EP of the data-parallel ranks (npmegatron/moe/expert_parallel.py), so an
expert's weight lives on one rank of each EP group, and its gradient there is already the sum
over that group's tokens. Summed over the expert-data-parallel ranks (those holding the same
experts) and divided by the data-parallel size, it is the average every other weight gets over
DP, Megatron-Core's expert gradient scaling. The gradient norm counts every expert once: the
experts' squares are summed over the EP group (and, as every weight's, over the TP ranks that split
it), the dense weights' are not."""
from ..optim.adamw import AdamW, all_reduced, float64_total, grad_norm_squared, sum_of_squares
from .buckets import GradientBuckets


class ExpertParallelBuckets:
    """The dense weights' buckets over DP (their average) and the experts' over the expert-data-
    parallel group (their sum over it, divided by DP), behind GradientBuckets' calls."""

    def __init__(self, params, experts, grid, bucket_size, storage=None):
        dense = [p for p in params if id(p) not in experts]
        mine = [p for p in params if id(p) in experts]
        self.dp_size = grid.dp_cp_group.size
        self.dense = GradientBuckets(dense, grid.dp_cp_group, bucket_size, storage=storage) if dense else None
        # (a pipeline stage without MoE layers holds no expert)
        self.experts = GradientBuckets(mine, grid.expert_dp_group, bucket_size, storage=storage,
                                       divisor=self.dp_size) if mine else None
        self.parts = [part for part in (self.dense, self.experts) if part is not None]
        self.layout = None      # two layouts: the optimizer updates parameter by parameter

    def zero_grad(self):
        for part in self.parts:
            part.zero_grad()

    def start_sync(self, params=None):
        for part in self.parts:
            part.start_sync(params)

    def finish_sync(self, timers=None):
        for part in self.parts:
            part.finish_sync(timers)
        if self.experts is not None and not self.experts.buckets and self.dp_size > 1:
            # one rank holds each expert (EP = DP): no reduction, but still the DP average's scale
            for p in self.experts.params:
                grad = p.grad if p.grad is not None else p.main_grad
                if grad is not None:
                    grad *= grad.dtype.type(1.0 / self.dp_size)


class ExpertParallelAdamW(AdamW):
    """AdamW whose gradient norm sums the experts' squares over the EP group too."""

    def __init__(self, params, experts, **settings):
        super().__init__(params, **settings)
        self.expert_ids = experts

    def grad_norm_squared(self, grid, skip=()):
        dense = [p for p in self.params if id(p) not in self.expert_ids]
        total = grad_norm_squared(dense, grid.mp_group, skip)
        grads = [p.grad for p in self.params if id(p) in self.expert_ids and p.grad is not None
                 and id(p) not in skip]     # a whole expert's on TP ranks other than 0
        xp = self.params[0].xp
        experts = all_reduced(float64_total(xp, [sum_of_squares(xp, g) for g in grads]), [grid.ep_group, grid.mp_group])
        return total + experts
