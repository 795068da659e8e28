"""`npmegatron plan`: memory per rank (memory.py) and step time (time_model.py) of a model on a
layout, from a machine profile (profiles.py, profiles/*.json; `plan calibrate` writes one for
this machine), and the search over layouts (search.py)."""
from .memory import Layout, memory_plan, rank_memory  # noqa: F401
from .profiles import load_profile  # noqa: F401
from .search import paper_weak_scaling, plan, search  # noqa: F401
from .time_model import step_time  # noqa: F401
