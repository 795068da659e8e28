"""The auxiliary losses of the MoE layers in the training objective, as Megatron-Core's
MoEAuxLossAutoScaler adds them: a layer's loss rides on one of its activations, whose backward
seeds the loss with the main loss's own scale (the loss scale over the micro-batches), so each
pipeline stage adds its layers' losses where they are, with no loss to send to the last stage.
The values are kept per step for the log (`take_values`)."""
from .. import autograd as ag
from ..autograd import Function

#: what backward seeds every auxiliary loss with: the main loss's seed (loss scale / micro-batches),
#: set by the schedule before each step's backward passes (npmegatron/pipeline/schedules.py)
_scale = {"value": 1.0}

#: name -> layer -> [sum of the values, how many] since the last take_values(): a running sum
#: on the device, so recording costs no synchronisation and no memory that grows with the steps
_values = {}


def set_scale(value):
    _scale["value"] = float(value)


class _AuxLoss(Function):
    """Forward: x as it is. Backward: x's gradient passes on, and the loss gets the main loss's
    seed (a loss that is part of the objective, at the main loss's scale)."""
    reads_16_bit = True
    reads_16_bit_grads = True
    float32_output = True

    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return x

    @staticmethod
    def backward(ctx, g):
        xp = ag.get_array_module(g)
        return g, xp.full(ctx.loss_shape, _scale["value"], ctx.loss_dtype)


def attach(x, loss, name, layer, coeff):
    """x, carrying coeff x `loss` (a scalar Tensor) into the objective; the loss without its
    coefficient recorded under name, as Megatron logs it."""
    entry = _values.setdefault(name, {}).get(layer)
    _values[name][layer] = [loss.data.copy(), 1] if entry is None else [entry[0] + loss.data, entry[1] + 1]
    loss = loss * coeff
    if not loss.requires_grad:
        return x
    return _AuxLoss.apply(x, loss)


def take_values():
    """{name: {layer: mean of the values}} recorded since the last call, then forgotten."""
    taken = {name: {layer: float(total) / count for layer, (total, count) in layers.items()}
             for name, layers in _values.items()}
    _values.clear()
    return taken
