"""The AdamW optimizer, the learning-rate schedule and global-norm gradient clipping,
as in Megatron's training loop (paper §4.2: warmup, cosine decay to a minimum)."""
import math

import numpy

from .. import comm
from ..autograd import cpu_blocks, get_array_module, precision
from ..autograd.fusion import fused, fused_reduction
from ..module import weight_decayed
from .flat import FlatLayout


@fused
def adamw_update_(xp, p, g, m, v, decayed, grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
                  rsqrt_bias2, eps, step_size):
    """One AdamW step, in place on p, m and v (one kernel on the GPU, however many parameters the
    arrays hold end to end): p = decay p - step_size m / (sqrt(v) / sqrt(bias2) + eps) after the
    moment updates, with the gradient times grad_scale (unscaling and clipping, applied here rather
    than in a pass of their own over the gradients), and decay only where `decayed` (matrices).
    Every scalar is computed on the host (see fusion.py)."""
    g = g * grad_scale
    t = g * one_minus_beta1
    m *= beta1
    m += t
    xp.multiply(g, g, out=t)
    t *= one_minus_beta2
    v *= beta2
    v += t
    xp.sqrt(v, out=t)
    t *= rsqrt_bias2
    t += eps
    xp.divide(m, t, out=t)
    t *= step_size
    # p times decay where decayed, p itself elsewhere: each element's numbers are those of a
    # per-parameter update with decay `decay` or 1
    xp.subtract(xp.where(decayed, p * decay, p), t, out=p)


#: float32 arrays at least this large are updated by the numba kernel on the CPU (_adamw_cpu.py);
#: below that, importing numba costs more than it saves.
COMPILED_UPDATE_SIZE = 1 << 16


def run_update(p, g, m, v, decayed, *scalars):
    """adamw_update_ on these arrays: the chain (on the CPU, a flat array's pieces shared among
    threads, as cpu_blocks does with rows), or the compiled CPU kernel for large float32 arrays."""
    if get_array_module(p) is not numpy:
        return adamw_update_(p, g, m, v, decayed, *scalars)
    if (p.dtype == numpy.float32 and g.dtype == numpy.float32 and p.size >= COMPILED_UPDATE_SIZE
            and p.flags.c_contiguous and g.flags.c_contiguous):
        from ._adamw_cpu import adamw_update_ as compiled   # numba is imported for large arrays only
        return compiled(p, g, m, v, decayed, *scalars)
    if p.ndim != 1 or p.size < cpu_blocks.MIN_BLOCKED_ELEMENTS:
        return adamw_update_(p, g, m, v, decayed, *scalars)
    piece = cpu_blocks.BLOCK_ELEMENTS

    def work(start, stop):
        part = slice(start * piece, stop * piece)
        adamw_update_(p[part], g[part], m[part], v[part], decayed[part], *scalars)

    cpu_blocks.for_row_blocks(-(-p.size // piece), piece, work)


class AdamW:
    """Adam with decoupled weight decay. Biases and LayerNorm parameters (the 1-D ones) are not
    decayed, as in Megatron and nanoGPT.

    The moments (and master weights) of all parameters live in flat arrays laid out as `layout`
    (optim/flat.py; by default the parameters end to end). Where the layout also holds the
    parameters and their gradients (the data-parallel buckets' buffers), a step is one update
    kernel for all of them, and the gradient norm one reduction; otherwise one of each a parameter.

    Under mixed precision (`storage` 'fp16' or 'bf16', autograd/precision.py) the parameters hold
    16-bit values and the optimizer keeps float32 master weights (`master`): each step updates the
    master and writes it back rounded, so updates smaller than a 16-bit step still accumulate."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, storage=None,
                 layout=None):
        self.params = list(params)
        self._settings(lr, betas, eps, weight_decay, storage)
        self.layout = layout or FlatLayout([self.params])
        # (layout slice, state slice) pairs the flat update covers: here all of it, state and
        # layout alike
        self.regions = [(slice(0, self.layout.size), slice(0, self.layout.size))]
        self.regions_are_parameters = True      # the distributed optimizer's are blocks
        self._make_state(self.layout.size)
        self.exp_avg, self.exp_avg_sq = ([self.layout.view(flat, p) for p in self.params]
                                         for flat in (self._m, self._v))
        if storage:
            self.master = [self.layout.view(self._master, p) for p in self.params]
            self._master_from_parameters()

    def _settings(self, lr, betas, eps, weight_decay, storage=None):
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.storage = storage
        self.step_count = 0
        self.grad_scale = 1.0       # what the next step multiplies the gradients by (scale_gradients)

    def _make_state(self, size):
        """Flat moments (and float32 masters under mixed precision) of `size` elements, and which
        elements of the layout are decayed."""
        xp, dtype = self.layout.xp, self.layout.dtype
        self._m, self._v = xp.zeros(size, dtype), xp.zeros(size, dtype)
        self._master = xp.zeros(size, dtype) if self.storage else None
        self.master = None
        self.decayed = self.layout.mask(weight_decayed)

    def scale_gradients(self, factor):
        """Multiply the gradients by `factor` in the next step's update itself (clip_gradients):
        the same numbers as scaling them first, without a kernel a parameter to do it."""
        self.grad_scale *= factor

    def hyperparameters(self):
        """Step count and settings, JSON-able (the checkpoint manifest's "optimizer")."""
        return {"step": self.step_count, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay}

    def state_dict(self):
        """The state a checkpoint keeps: the hyperparameters and the two moments, each a list in
        the order of the parameters the optimizer was given; under mixed precision also the
        master weights ("master"), which the checkpoint stores as the model's weights."""
        state = {"hyperparameters": self.hyperparameters(), "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.master is not None:
            state["master"] = self.master
        return state

    def load_state_dict(self, state):
        """Restore a state_dict (moments copied in place, onto this optimizer's device). Under
        mixed precision the loaded weights at full precision (state["weights"], one array a
        parameter; else the parameters' values) become the master weights, and the parameters
        their 16-bit rounding."""
        self.step_count = state["hyperparameters"]["step"]
        for kind in ("exp_avg", "exp_avg_sq"):
            for mine, saved in zip(getattr(self, kind), state[kind]):
                mine[...] = get_array_module(mine).asarray(saved)
        if self.master is not None:
            self._masters_from_loaded_weights(state.get("weights"))

    def load_weights(self, weights):
        """Take loaded weights (full precision, one array a parameter, already in the parameters)
        without the rest of a checkpoint's optimizer state: under --fp16/--bf16 they become the
        masters and the parameters their rounding; the moments and the step count stay fresh."""
        if self.master is not None:
            self._masters_from_loaded_weights(weights)

    def _masters_from_loaded_weights(self, weights=None):
        """The loaded weights (or, without them, the parameters, holding them at full precision)
        become the master weights, and the parameters their 16-bit rounding. A GPU's 16-bit
        parameters were rounded as they were loaded, so the masters come from `weights`."""
        if weights is None:
            self._master_from_parameters()
        else:
            full = self.layout.zeros()
            for p, w in zip(self.params, weights):
                self.layout.view(full, p)[...] = self.layout.xp.asarray(w)
            for where, state in self.regions:
                self._master[state] = full[where]
        for p in self.params:
            precision.round_(p.data, self.storage)

    def _master_from_parameters(self):
        for p, master in zip(self.params, self.master):
            master[...] = p.data

    def step(self, lr=None):
        lr = self._advance(lr)
        grad_scale, self.grad_scale = self.grad_scale, 1.0
        self._apply((grad_scale,) + self._scalars(lr))

    # --cuda-graph: a captured step's update reads its scalars from device memory, which the host
    # writes before each replay (load_step), and its gradient factor from a device array
    def load_step(self, lr):
        """Count a step and write its update's scalars (learning rate, bias corrections, decay) into
        the device array a captured update reads: one upload, before the graph runs. As float32,
        the precision the update's arithmetic takes them in (weak scalars), so the numbers are
        step()'s."""
        values = numpy.asarray(self._scalars(self._advance(lr)), numpy.float32)
        if getattr(self, "_device_scalars", None) is None:
            self._device_scalars = self.layout.xp.zeros(values.size, numpy.float32)
        self._device_scalars.set(values)

    def step_on_device(self, grad_scale):
        """step() with load_step's scalars and `grad_scale` (a 0-d float32 device array, see
        gradient_factor_on_device) read from device memory: nothing of the host's in its launches."""
        scalars = self._device_scalars
        self._apply((grad_scale,) + tuple(scalars[i] for i in range(scalars.size)))

    def _apply(self, scalars):
        """Update every parameter with adamw_update_'s scalars."""
        layout = self.layout
        if layout.grad is None:         # parameters and gradients apart: one update each
            for p in self.params:
                if p.grad is not None:
                    where = layout.where[id(p)]
                    self._update(p.data, p.grad, where, where, scalars)
            return
        layout.gather_grads()
        for where, state in self.regions:
            # on the CPU one update a parameter (a piece of it, in a block), the numbers as ever
            for piece in layout.counted_runs(where, split=True) if layout.xp is numpy else [where]:
                at = slice(state.start + piece.start - where.start, state.start + piece.stop - where.start)
                self._update(layout.data[piece], layout.grad[piece], piece, at, scalars)

    def _advance(self, lr):
        """Count the step; the learning rate it uses."""
        self.step_count += 1
        return self.lr if lr is None else lr

    def _scalars(self, lr):
        """adamw_update_'s scalars after grad_scale, computed on the host."""
        beta1, beta2 = self.betas
        bias1, bias2 = 1 - beta1 ** self.step_count, 1 - beta2 ** self.step_count
        decay = 1 - lr * self.weight_decay if self.weight_decay else 1.0
        return decay, beta1, 1 - beta1, beta2, 1 - beta2, 1 / math.sqrt(bias2), self.eps, lr / bias1

    def _update(self, data, grad, where, state, scalars):
        """Update `data` (parameters at `where` in the layout, any shape) from `grad`, with the
        state at `state` in the flat state arrays; under mixed precision the master is updated
        and `data` becomes its 16-bit rounding."""
        shape = data.shape
        m, v = self._m[state].reshape(shape), self._v[state].reshape(shape)
        target = data if self._master is None else self._master[state].reshape(shape)
        run_update(target, grad, m, v, self.decayed[where].reshape(shape), *scalars)
        if self._master is not None:
            publish_rounded(data, target, self.storage)

    def grad_norm_squared(self, grid, skip=()):
        """The squared global gradient norm (as grad_norm_squared below): one sum of squares a
        stretch of the flat gradients that holds no parameter of `skip`, where the layout holds
        the gradients."""
        grad, xp = self.layout.grad, self.layout.xp
        if grad is None or (xp is numpy and self.regions_are_parameters):
            return grad_norm_squared(self.params, grid.mp_group, skip)
        self.layout.gather_grads()
        # on the CPU a sum a parameter (or a parameter's piece of a block), the numbers as ever
        parts = [sum_of_squares(xp, grad[run]) for where, _ in self.regions
                 for run in self.layout.counted_runs(where, skip, split=xp is numpy)]
        return all_reduced(float64_total(xp, parts), self.norm_groups(grid))

    def norm_groups(self, grid):
        """The groups whose ranks hold other parts of the gradients: the model-parallel one."""
        return [grid.mp_group]


def publish_rounded(param, master, storage):
    """The parameter becomes the master weight rounded to the 16-bit grid (in place): a 16-bit
    array (a GPU's flat buffer) takes it in one kernel, a float32 one is rounded in place."""
    if param.dtype != master.dtype:
        precision.to_16_bit(master, storage, out=param)
        return
    param[...] = master
    precision.round_(param, storage)


def learning_rate(step, lr, min_lr, warmup_iters, decay_iters, style="cosine", wsd_decay_iters=None,
                  wsd_style="linear", init_lr=0.0, global_batch=1):
    """The learning rate of update `step` (from 0), as Megatron's OptimizerParamScheduler gives it:
    the scheduler is built at step 0 and steps after each applied update, so update k + 1 reads
    get_lr() at step k. It counts samples (steps x global_batch): the same ratios, but the clamps
    of inverse-square-root's max(., 1) are in samples, and a warmup of --lr-warmup-fraction x the
    decay's samples needs no whole number of steps.
      warmup: init_lr + (lr - init_lr) x step / warmup, up to and including step = warmup (the
        first update at init_lr, lr reached at update warmup + 1);
      then 'constant': lr; past decay_iters: min_lr; 'inverse-square-root': lr x sqrt(warmup /
        step), not below min_lr; else min_lr + coefficient x (lr - min_lr), the coefficient of the
        decay's progress (step - warmup) / (decay - warmup): 'linear' 1 - p, 'cosine'
        (1 + cos(pi p)) / 2, or 'WSD' (1 until the last wsd_decay_iters steps before decay_iters,
        then `wsd_style` of their progress: 'linear', 'cosine', 'exponential' 2 x 0.5^p - 1 or
        'minus_sqrt' 1 - sqrt(p))."""
    step, warmup, decay = step * global_batch, warmup_iters * global_batch, decay_iters * global_batch
    if warmup > 0 and step <= warmup:
        return init_lr + (lr - init_lr) * float(step) / float(warmup)
    if style == "constant":
        return lr
    if step > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, lr * max(warmup, 1) ** 0.5 / max(step, 1) ** 0.5)
    if style == "WSD":
        start = decay - wsd_decay_iters * global_batch
        progress = float(step - start) / float(wsd_decay_iters * global_batch)
        coefficient = 1.0 if step <= start else {
            "linear": 1.0 - progress, "cosine": 0.5 * (math.cos(math.pi * progress) + 1.0),
            "exponential": 2.0 * math.pow(0.5, progress) - 1.0, "minus_sqrt": 1.0 - math.sqrt(progress)}[wsd_style]
        return min_lr + coefficient * (lr - min_lr)
    progress = float(step - warmup) / float(decay - warmup)
    coefficient = 1.0 - progress if style == "linear" else 0.5 * (math.cos(math.pi * progress) + 1.0)
    return min_lr + coefficient * (lr - min_lr)


def scheduled_learning_rate(config, step, global_batch=1):
    """The learning rate of applied optimizer step `step` (from 0) under a TrainConfig's schedule;
    global_batch: the samples a step counts (Megatron's scheduler steps in samples)."""
    return learning_rate(step, config.lr, config.min_lr, config.warmup_iters, config.decay_iters,
                         config.lr_decay_style, config.lr_wsd_decay_iters, config.lr_wsd_decay_style,
                         config.lr_warmup_init, global_batch)


def grad_norm_squared(params, group=None, skip=()):
    """The squared global L2 norm of the gradients as a float64 array of shape (1,), left on the
    device: summed per parameter in its own dtype, then in float64 over parameters and over the
    model-parallel `group`. `skip` holds the ids of replicated parameters this rank must not
    count (they are counted once, on TP rank 0)."""
    grads = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    xp = params[0].xp if params else numpy
    return all_reduced(float64_total(xp, [sum_of_squares(xp, g) for g in grads]), [group])


def float64_total(xp, parts):
    """The sum of 0-d partial sums in float64, as an array of shape (1,)."""
    if not parts:
        return xp.zeros(1, numpy.float64)
    if len(parts) == 1:         # one flat buffer: no stack and sum to launch
        return parts[0].astype(numpy.float64).reshape(1)
    return xp.stack(parts).astype(numpy.float64).sum().reshape(1)


def all_reduced(total, groups):
    """total summed over each group of more than one rank, in order."""
    for group in groups:
        if group is not None and group.size > 1:
            total = comm.all_reduce(total, group)
    return total


def sum_of_squares(xp, g):
    """sum(g * g) in g's dtype, as a 0-d array: a BLAS dot product for contiguous float32 and
    float64 (no temporary: 4.0 against 6.9 ms for the reference model's 12.9 M float32 gradients
    on one core), else one fused kernel (a strided gradient, e.g. LayerNorm's two halves of one
    complex sum on a GPU, or the 16-bit types)."""
    if g.dtype in (numpy.float32, numpy.float64) and g.flags.c_contiguous:
        flat = g.reshape(-1)
        return xp.asarray(xp.vdot(flat, flat))
    return xp.asarray(square_sum(g))


@fused_reduction
def square_sum(xp, g):
    """sum(g * g) over every element, in one kernel."""
    return xp.sum(g * g)


def gradient_factor(norm, max_norm, loss_scale=1.0):
    """What to multiply the gradients by, or None for nothing: 1 / loss_scale to undo loss scaling
    (norm is already the unscaled one), times max_norm / (norm + 1e-6) whenever that is below 1
    (Megatron's clip_grad_norm_fp32, PyTorch's clip_grad_norm_). One pass over the gradients does
    both."""
    factor = 1.0 / loss_scale
    clip = max_norm / (norm + 1e-6) if max_norm else 1.0      # Megatron's and torch's clip_grad_norm_
    if clip < 1.0:
        factor *= clip
    return None if factor == 1.0 else factor


@fused
def gradient_factor_on_device(xp, norm_squared, inverse_scale, loss_scale, max_norm):
    """gradient_factor with clip_gradients' rule for a norm that is not finite (factor 1), on the
    device, from the squared norm (float64): --cuda-graph's step never shows the host its norm
    before the update. The same double operations in gradient_factor's order, then float32, the
    precision the update takes its factor in: the same number as the host's. max_norm: inf for
    no clipping; inverse_scale: 1 / loss_scale, computed on the host."""
    norm = xp.sqrt(norm_squared) / loss_scale
    clip = max_norm / (norm + 1e-6)
    factor = xp.where(clip < 1.0, inverse_scale * clip, inverse_scale)
    return xp.where(xp.isfinite(norm), factor, 1.0).astype(xp.float32)


def clip_gradients(params, norm, max_norm, loss_scale=1.0, optimizer=None):
    """Unscale the gradients and clip them to max_norm (norm: their unscaled norm, a host float):
    inside the next update of an optimizer that can (AdamW.scale_gradients), else in place."""
    factor = gradient_factor(norm, max_norm, loss_scale)
    if factor is not None and hasattr(optimizer, "scale_gradients"):
        optimizer.scale_gradients(factor)
    elif factor is not None:
        for p in params:
            if p.grad is not None:
                p.grad *= p.grad.dtype.type(factor)
