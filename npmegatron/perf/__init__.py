"""The performance model: memory per rank (memory.py) and step time (time_model.py) of a model on
a parallel shape, from a machine profile (profiles.py, profiles/*.json), and the search over
shapes (search.py). It sits above the model and the pipeline because it counts what they do: the
micro-batches in flight come from the schedule's own action list. `npmegatron plan` (bench/plan/)
prints it; the training run's header and its memory check use it."""
from .memory import ParallelShape, memory_plan, rank_memory  # noqa: F401
from .profiles import load_profile  # noqa: F401
from .search import paper_weak_scaling, plan, search  # noqa: F401
from .time_model import step_time  # noqa: F401
