"""The training step: forward and backward of one global batch's micro-batches on this rank,
then every gradient made whole. One function, used by the trainer, the benchmarks and the tests."""
from ..pipeline import run_schedule
from .timers import FINALIZE_GRADS, NO_TIMERS


def schedule_options(parallel):
    """run_schedule's options from a ParallelConfig."""
    return {"deallocate_outputs": parallel.deallocate_pipeline_outputs,
            "overlap": parallel.overlap_p2p_communication}


def train_step(model, exchange, batches, buckets, schedule="1f1b", timers=None, **options):
    """Run the pipeline schedule over `batches` (this DP rank's M micro-batches), the DP bucket
    all-reduces starting with this rank's last backward, then the tied embedding's gradient summed
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
    return loss_sum
