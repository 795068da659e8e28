"""The training step: forward and backward of one global batch's micro-batches on this rank,
then every gradient made whole. One function, used by the trainer, the benchmarks and the tests."""
import contextlib
import gc
import math

from .. import comm
from ..autograd.backend import to_numpy
from ..moe import update_expert_biases
from ..pipeline import run_schedule
from ..optim.adamw import clip_gradients, grad_norm_squared
from ..timers import FINALIZE_GRADS, NO_TIMERS


@contextlib.contextmanager
def setup_objects_frozen():
    """Exempt everything built so far (modules, model, optimizer: about 10^5 objects) from Python's
    cyclic garbage collector while the steps run. Its full collections otherwise scan them all (52
    ms measured with the reference model) at moments that differ from rank to rank, and the others
    wait at the next collective. The tape frees itself by reference counting (it holds no cycles),
    and collection stays on for what the steps create. The objects are released again on exit."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def schedule_options(parallel):
    """run_schedule's options from a ParallelConfig."""
    return {"deallocate_outputs": parallel.deallocate_pipeline_outputs,
            "overlap": parallel.overlap_p2p_communication}


def train_step(model, exchange, batches, buckets, schedule="1f1b", timers=None, **options):
    """Run the pipeline schedule over `batches` (this DP rank's M micro-batches), the DP bucket
    all-reduces starting with each virtual stage's last backward, then the tied embedding's gradient summed
    over the pipeline ends. Returns the sum of the micro-batch losses, a float64 array of shape ()
    on the model's device (zero off the last stage). `timers` (timers.py; default: off) times the
    phases: compute, TP communication, pipeline waits, the DP wait not hidden by backward."""
    timers = timers or NO_TIMERS
    buckets.zero_grad()
    loss_sum = run_schedule(model, exchange, batches, schedule, on_last_backward=buckets.start_sync,
                            timers=timers, **options)
    buckets.finish_sync(timers)
    with timers(FINALIZE_GRADS):    # SP partial gradients over TP, the tied embedding over PP ends
        model.finalize_grads()
    update_expert_biases(model, model.grid.dp_cp_group)   # MoE routers' (none without them)
    return loss_sum


def sum_losses(model, loss_sum):
    """Losses summed on the last stage, then over the pipeline and the DP replicas: a float64
    array of shape (1,), left on the device. Under context parallelism each rank's loss is the mean
    over its share of the tokens (equal shares), so a sample's is the mean over the CP group."""
    grid = model.grid
    total = comm.all_reduce(comm.all_reduce(model.xp.asarray(loss_sum).reshape(1), grid.pp_group),
                            grid.dp_cp_group)
    return total / grid.cp_size if grid.cp_size > 1 else total


def clip_after_step(model, params, loss_sum, norm_skip, max_norm, optimizer=None, loss_scale=1.0):
    """(summed loss, gradient norm before clipping) as host floats, the gradients unscaled (from
    a loss scaled by `loss_scale`) and clipped to max_norm, by the optimizer's next update where it
    can (AdamW.scale_gradients). Both numbers reach the host together:
    the step's one synchronisation. A norm that is not finite (a 16-bit overflow) leaves the
    gradients as they are. The optimizer measures the gradients as it holds them (AdamW: one
    reduction a flat buffer; the distributed optimizer: its blocks)."""
    squared = (optimizer.grad_norm_squared(model.grid, norm_skip) if optimizer is not None
               else grad_norm_squared(params, model.grid.mp_group, norm_skip))
    both = model.xp.concatenate([sum_losses(model, loss_sum), squared])
    loss_total, norm_squared = (float(v) for v in to_numpy(both))
    norm = math.sqrt(norm_squared) / loss_scale
    if math.isfinite(norm):
        clip_gradients(params, norm, max_norm, loss_scale, optimizer)
    return loss_total, norm
