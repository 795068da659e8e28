"""Pipeline parallelism: the model split by depth into stages (the layout string, parsed by
npmegatron/pipeline_layout.py and re-exported here), the stages one rank
holds (stages.py), the point-to-point exchange between neighbours (exchange.py), the order in
which each neighbour sends (order.py: receives are posted in it, as NCCL matches without tags)
and the schedules that order forward and backward passes over micro-batches (schedules.py)."""
from ..pipeline_layout import StageSpec, default_layout, parse_layout, plan_stages
from .exchange import StageExchange
from .schedules import SCHEDULES, MemoryProbe, build_actions, run_schedule
from .stages import PipelineModel

__all__ = ["StageExchange", "StageSpec", "default_layout", "parse_layout", "plan_stages",
           "SCHEDULES", "MemoryProbe", "build_actions", "run_schedule", "PipelineModel"]
