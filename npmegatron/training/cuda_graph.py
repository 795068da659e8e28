"""--cuda-graph: the whole training step (forward, backward, gradient reduction, clipping and the
optimizer's update) captured as one CUDA graph after a few eager steps, then replayed, as
Megatron-LM's full-iteration CUDA graphs: the host no longer launches a step's ~200 kernels from
Python, it launches one graph.

A graph replays the same kernels with the same arguments on the same memory, so nothing a step
launches may depend on the host: the batch is copied into the graph's own input arrays, the
optimizer's scalars (learning rate, bias corrections) into a device array it reads (AdamW.load_step),
the clipping factor is computed on the device from the squared norm, the step's memory comes from a
pool of the graph's own (below), dropout's keys are made on the device from the iteration written there (random.device_draw_key), and token
ids are checked on the host before their upload. Per step the host then copies the batch, writes
the scalars and the iteration, launches the graph and reads the loss and the norm together (the
step's one synchronisation). What a graph cannot hold is refused by TrainConfig (config.py).

Memory, as PyTorch's graphs keep it: the warm-up steps and the capture allocate from a caching
pool of the graph's own (cupy.cuda.MemoryPool), so the capture finds its blocks cached (CuPy
captures in relaxed mode, where a cudaMalloc is allowed anyway) and a free during it is host
bookkeeping; once captured, the default pool serves everything else, so no array made after the
capture is given memory a replay writes. The stream-ordered pool (MemoryAsyncPool) does not do:
CUDA refuses a cudaFreeAsync inside a capture of memory allocated before it, and an allocation a
capture made and that outlives it must be freed between replays."""
import gc
import math

import numpy

from ..autograd import InputError, cublas_capture
from ..comm.backends import backend_for
from ..autograd.backend import to_numpy
from ..autograd.ops.nn import check_ids, ids_checked_on_host
from ..optim.adamw import gradient_factor_on_device
from ..timers import NO_TIMERS
from .step import schedule_options, sum_losses, train_step


class GraphedStep:
    """The trainer's step under --cuda-graph: eager for `cuda_graph_warmup_steps` steps (kernels
    compiled, cuDNN graphs built, every cache filled), then captured once and replayed."""

    def __init__(self, run, config):
        """run: what run.assemble built (a Trainer has the same attributes); config: its TrainConfig."""
        xp = run.model.xp
        if run.grid.world_size > 1 and backend_for(xp.zeros(1)).name != "nccl":
            raise InputError("--cuda-graph captures collectives through NCCL, but these ranks share GPUs, so "
                             "theirs go through MPI in host memory; give each rank a GPU of its own")
        self.pool = xp.cuda.MemoryPool()                # the graph's memory (the module's docstring)
        self.eager_allocator = xp.cuda.get_allocator()
        xp.cuda.set_allocator(self.pool.malloc)
        xp.get_default_memory_pool().free_all_blocks()  # its cache would sit unused beside the graph's pool
        self.parts, self.config, self.xp = run, config, xp
        run.model.rng.iteration_on_device()             # dropout's masks keyed by the iteration there
        self.stream = xp.cuda.Stream(non_blocking=True)
        self.inputs = None                              # [(ids, targets)] on the device: the graph's inputs
        self.result = xp.zeros(2, numpy.float64)        # (summed loss, squared gradient norm): its output
        self.graph, self.steps = None, 0

    def run(self, batches, lr, iteration, loss_scale=1.0):
        """(summed loss, gradient norm) of step `iteration` on `batches` (host arrays), the update
        applied at learning rate lr. The first steps run eagerly; the one after them is captured,
        then run."""
        with self.stream:
            # the step runs after what the default stream was given (initialisation, a loaded
            # checkpoint, an evaluation): the graph's stream does not wait for it by itself
            self.stream.wait_event(self.xp.cuda.Stream.null.record())
            self._load(batches)
            self.parts.optimizer.load_step(lr)
            self.parts.model.rng.set_iteration(iteration)
            if self.graph is None and self.steps >= self.config.cuda_graph_warmup_steps:
                self.graph = self._capture(loss_scale)
            if self.graph is not None:
                self.graph.launch(self.stream)
            else:
                self._body(loss_scale)
            self.steps += 1
            loss_total, norm_squared = (float(v) for v in to_numpy(self.result))
        return loss_total, math.sqrt(norm_squared) / loss_scale

    def _capture(self, loss_scale):
        # a collection inside the capture would free earlier steps' garbage there, which CUDA
        # refuses for memory allocated outside the capture
        gc.collect()
        gc.disable()
        cublas_capture.workspace(self.xp)               # the captured GEMMs' workspace, made before
        self.stream.begin_capture()
        try:
            self._body(loss_scale)
        except BaseException:
            try:
                self.stream.end_capture()   # leave capture mode; the body's error is the one to report
            except Exception:
                pass
            raise
        finally:
            gc.enable()
        graph = self.stream.end_capture()
        self.xp.cuda.set_allocator(self.eager_allocator)    # the pool is the graph's from now on
        return graph

    def _load(self, batches):
        """Check the batch on the host and copy it into the graph's input arrays."""
        vocab = self.parts.cfg.vocab_size
        for ids, targets in batches:
            check_ids(ids, vocab, "token id", "tokenize with the model's vocabulary")
            check_ids(targets, vocab, "target id", "targets must be token ids of the model's vocabulary")
        shapes = [(numpy.shape(ids), numpy.shape(targets)) for ids, targets in batches]
        if self.inputs is None:
            self.inputs = [(self.xp.empty(a, numpy.int64), self.xp.empty(b, numpy.int64)) for a, b in shapes]
        if shapes != [(ids.shape, targets.shape) for ids, targets in self.inputs]:
            raise InputError(f"--cuda-graph replays one batch shape, but this batch is {shapes} and the graph's "
                             f"{[(i.shape, t.shape) for i, t in self.inputs]}; keep --seq-length and the batch fixed")
        for (ids, targets), (host_ids, host_targets) in zip(self.inputs, batches):
            ids.set(numpy.asarray(host_ids, numpy.int64))
            targets.set(numpy.asarray(host_targets, numpy.int64))

    def _body(self, loss_scale):
        """The device work of one step, with nothing in it from the host that changes."""
        t = self.parts
        with ids_checked_on_host():
            loss_sum = train_step(t.model, t.exchange, self.inputs, t.buckets, t.schedule, NO_TIMERS,
                                  loss_scale=loss_scale, **schedule_options(self.config.parallel))
        squared = t.optimizer.grad_norm_squared(t.model.grid, t.norm_skip)
        self.xp.concatenate([sum_losses(t.model, loss_sum), squared], out=self.result)
        max_norm = self.config.clip_grad or math.inf
        factor = gradient_factor_on_device(squared, 1.0 / loss_scale, loss_scale, max_norm)
        t.optimizer.step_on_device(factor.reshape(()))
