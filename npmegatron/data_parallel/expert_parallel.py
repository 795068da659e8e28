"""Gradients and the optimizer under expert parallelism (--expert-model-parallel-size EP): the
experts are split over EP of the DP x CP ranks (npmegatron/moe/expert_parallel.py), so an
expert's weight lives on one rank of each EP group, and its gradient there is already the sum
over that group's tokens. Summed over the expert-data-parallel ranks (those holding the same
experts) and divided by the data-parallel size, it is the average every other weight gets over
DP, Megatron-Core's expert gradient scaling. The gradient norm counts every expert once: the
experts' squares are summed over the EP group (and, as every weight's, over the TP ranks that split
it), the dense weights' are not.

With --use-distributed-optimizer each half is sharded over its own group: the dense weights'
AdamW state over DP x CP, the experts' over the expert-data-parallel ranks (Megatron-Core's
expert distributed optimizer)."""
from ..optim.adamw import AdamW, all_reduced, float64_total, grad_norm_squared, sum_of_squares
from .buckets import GradientBuckets
from .distributed_optimizer import DistributedAdamW, ShardedGradientBuckets


class ExpertParallelBuckets:
    """The dense weights' buckets over DP (their average) and the experts' over the expert-data-
    parallel group (their sum over it, divided by DP), behind GradientBuckets' calls."""

    def __init__(self, params, experts, grid, bucket_size, storage=None, sharded=False, alone=()):
        """sharded: the distributed optimizer's reduce-scattered buckets; alone: parameters with a
        bucket of their own (ShardedGradientBuckets)."""
        dense = [p for p in params if id(p) not in experts]
        mine = [p for p in params if id(p) in experts]
        self.dp_size = grid.dp_cp_group.size
        buckets = ShardedGradientBuckets if sharded else GradientBuckets
        self.dense = buckets(dense, grid.dp_cp_group, bucket_size, alone=alone, storage=storage) if dense else None
        # (a pipeline stage without MoE layers holds no expert)
        self.experts = buckets(mine, grid.expert_dp_group, bucket_size, storage=storage,
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
            # one rank holds each expert (EP = DP x CP): no reduction, but still the DP average's scale
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


class _BlocksOver(DistributedAdamW):
    """A DistributedAdamW whose gradient norm sums over `groups` only; the caller adds the halves
    and sums over the model-parallel ranks once (every stage calls it, with experts or without)."""

    def __init__(self, buckets, groups, **settings):
        super().__init__(buckets, **settings)
        self.groups = groups    # before the sum over the model-parallel ranks

    def norm_groups(self, grid):
        return self.groups


class ExpertParallelDistributedAdamW:
    """The distributed optimizer under expert parallelism: a DistributedAdamW over the dense
    weights' buckets (blocks over DP x CP) and one over the experts' (blocks over the expert-data-
    parallel ranks), behind AdamW's calls. The state a checkpoint keeps is whole per parameter, in
    the order of `params`, as AdamW's."""

    def __init__(self, params, buckets, grid, **settings):
        self.params = list(params)
        self.parts = []
        if buckets.dense is not None:
            self.parts.append(_BlocksOver(buckets.dense, [grid.dp_cp_group], **settings))
        self.experts = None
        if buckets.experts is not None:
            self.experts = _BlocksOver(buckets.experts, [grid.expert_dp_group, grid.ep_group], **settings)
            self.parts.append(self.experts)
        self.grid = grid

    def step(self, lr=None):
        for part in self.parts:
            part.step(lr)

    def scale_gradients(self, factor):
        for part in self.parts:
            part.scale_gradients(factor)

    def hyperparameters(self):
        return self.parts[0].hyperparameters()

    def grad_norm_squared(self, grid, skip=()):
        # (the expert groups lie inside a pipeline stage: a stage without experts has no sum to join)
        total = sum(part.grad_norm_squared(grid, skip) for part in self.parts)
        return all_reduced(total, [grid.mp_group])

    def state_dict(self):
        """Collective over each part's group: every parameter's state whole, in `params` order."""
        states = [part.state_dict() for part in self.parts]
        merged = {"hyperparameters": self.hyperparameters()}
        for kind in states[0]:
            if kind != "hyperparameters":
                whole = {id(p): value for part, state in zip(self.parts, states)
                         for p, value in zip(part.params, state[kind])}
                merged[kind] = [whole[id(p)] for p in self.params]
        return merged

    def load_state_dict(self, state):
        for part in self.parts:
            part.load_state_dict(self._share(part, state))

    def load_weights(self, weights):
        for part in self.parts:
            part.load_weights(self._share(part, {"weights": weights})["weights"])

    def _share(self, part, state):
        """A whole-model state's entries for `part`'s parameters."""
        index = {id(p): i for i, p in enumerate(self.params)}
        return {kind: (value if kind == "hyperparameters" or value is None
                       else [value[index[id(p)]] for p in part.params]) for kind, value in state.items()}
