"""Loss scaling for --fp16 (Micikevicius et al. 2018, "Mixed Precision Training"; Megatron's
ConstantGradScaler and DynamicGradScaler, whose rules these follow).

backward starts from the loss times `scale`, so that small gradients stay above float16's
smallest numbers; the optimizer step divides it out again. A step whose gradients overflowed
(their norm is inf or NaN) is skipped, not applied, and not fatal. Dynamic scaling then lowers the
scale: after `hysteresis` overflowing steps it halves each time (never below `min_scale`), and
after `window` steps in a row without overflow it doubles and the hysteresis count starts again.
"""


class LossScale:
    """A fixed scale (--loss-scale): overflowing steps are skipped, the scale stays."""

    def __init__(self, scale):
        self.scale = float(scale)

    def update(self, overflow):
        pass

    def state_dict(self):
        return {"scale": self.scale}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])


class DynamicLossScale(LossScale):
    def __init__(self, initial_scale=2.0 ** 32, min_scale=1.0, window=1000, hysteresis=2,
                 growth=2.0, backoff=0.5):
        super().__init__(initial_scale)
        self.min_scale, self.window, self.hysteresis = float(min_scale), window, hysteresis
        self.growth, self.backoff = growth, backoff
        self.good_steps = 0                  # steps without overflow since the last one
        self.overflows_left = hysteresis     # overflows still allowed before the scale halves

    def update(self, overflow):
        if overflow:
            self.good_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return
        self.good_steps += 1
        if self.good_steps == self.window:
            self.good_steps, self.overflows_left = 0, self.hysteresis
            self.scale *= self.growth

    def state_dict(self):
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows_left": self.overflows_left}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        # A fixed scale's state has neither: the dynamic scale then starts its counts afresh.
        self.good_steps = state.get("good_steps", 0)
        self.overflows_left = state.get("overflows_left", self.hysteresis)


def build_loss_scale(config):
    """The run's loss scaling: dynamic for --fp16, fixed with --loss-scale (also for --bf16),
    None otherwise (bfloat16 has float32's range: Megatron does not scale it)."""
    if config.loss_scale:
        return LossScale(config.loss_scale)
    if config.model.fp16:
        return DynamicLossScale(config.initial_loss_scale, config.min_loss_scale,
                                config.loss_scale_window, config.hysteresis)
    return None
