"""One way to build: the process grid (one process, or the ranks mpirun started) and the model of
any pipeline layout. Training, the benchmarks, generation and the tests all build through here."""
from . import comm
from .pipeline import PipelineModel
from .pipeline_layout import default_layout, parse_layout, plan_stages


def build_grid(tp=1, pp=1):
    """A grid of TP x PP x DP ranks under mpirun (DP = world / (TP x PP)); one rank without it."""
    if not comm.launched_by_mpi():
        return comm.ProcessGrid.single()
    comm.init()
    return comm.ProcessGrid(tp=tp, pp=pp)


def build_model(cfg, grid, layout=None):
    """The stages of `layout` (Megatron's layout string; default: the layers split evenly over
    the pipeline ranks) that this rank holds, as one model."""
    layout = layout or default_layout(cfg.num_layers, grid.pp_size)
    return PipelineModel(cfg, grid, plan_stages(parse_layout(layout), cfg.num_layers, grid.pp_size, layout))
