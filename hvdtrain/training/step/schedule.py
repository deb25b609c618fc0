"""Learning rate: scaled with the world size, reached by a linear warmup, then a schedule.

An N-times larger global batch wants an N (or sqrt(N)) times larger rate, and jumping there at
step 0 destabilises early training, so the rate ramps up over ``warmup_epochs`` (Goyal et al.,
2017), then stays constant, follows a cosine, steps down or decays on a plateau. The rate is a
function of the optimizer's step counter (and a checkpointed plateau scale), so a resumed run
continues at the right rate. ``RateControl`` sets the optimizer's plain ``learning_rate``
variable before every step, so Keras callbacks that set the rate keep working, their change
kept as a factor on top.
"""

from __future__ import annotations

import math

import keras

from hvdtrain.config import DEFAULT_LEARNING_RATE, OptimConfig
from hvdtrain.errors import UserError
from hvdtrain.keras_internals import remember_rates
from hvdtrain.plugins import is_plugin, load_callable


def scale_factor(policy: str, world_size: int) -> float:
    """How much larger the rate is for ``world_size`` ranks than for one."""
    if policy == "linear":
        return float(world_size)
    if policy == "sqrt":
        return math.sqrt(world_size)
    return 1.0


class WarmupScaledRate:
    """``base`` at step 0, linearly to ``base * scale`` at ``warmup_steps``, then ``decay``;
    ``multiplier(step)`` is the same curve for a base of 1 (what other optimizers follow)."""

    def __init__(self, base: float, scale: float, warmup_steps: int, decay: str = "constant",
                 total_steps: int = 0, decay_steps: int = 0, decay_factor: float = 1.0) -> None:
        self.base = float(base)
        self.scale = float(scale)
        self.warmup_steps = int(warmup_steps)
        self.decay = decay
        self.total_steps = int(total_steps)
        self.decay_steps = int(decay_steps)
        self.decay_factor = float(decay_factor)
        # Multiplied in by plateau decay; saved with checkpoints.
        self.plateau_scale = 1.0

    def set_world_scale(self, scale: float) -> None:
        """Elastic training changes the world-size factor when the world changes."""
        self.scale = float(scale)

    def _after_warmup(self, step: float) -> float:
        if self.decay == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(max((step - self.warmup_steps) / span, 0.0), 1.0)
            return self.scale * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.decay == "step" and self.decay_steps > 0:
            return self.scale * self.decay_factor ** math.floor(step / self.decay_steps)
        return self.scale

    def multiplier(self, step: float) -> float:
        step = float(step)
        if step < self.warmup_steps:
            rate = 1.0 + (self.scale - 1.0) * step / self.warmup_steps
        else:
            rate = self._after_warmup(step)
        return rate * self.plateau_scale

    def __call__(self, step: int) -> float:
        return self.base * self.multiplier(step)


def world_scale(config: OptimConfig, world_size: int) -> float:
    """The rate's factor for this world. Adasum combines gradients so that the single-rank rate
    stays right (Horovod's guidance), so it is never scaled."""
    return scale_factor("none" if config.reduction == "adasum" else config.lr_scaling,
                        world_size)


def make_schedule(config: OptimConfig, world_size: int, updates_per_epoch: int,
                  epochs: int, base: float | None = None) -> WarmupScaledRate:
    """The run's schedule from ``base`` (default: ``--learning-rate``, else hvdtrain's)."""
    if base is None:
        base = DEFAULT_LEARNING_RATE if config.learning_rate is None else config.learning_rate
    return WarmupScaledRate(
        base=base,
        scale=world_scale(config, world_size),
        warmup_steps=int(round(config.warmup_epochs * updates_per_epoch)),
        decay=config.lr_schedule,
        total_steps=epochs * updates_per_epoch,
        decay_steps=int(round(config.lr_decay_epochs * updates_per_epoch)),
        decay_factor=config.lr_decay_factor,
    )


# Optimizers whose constructor takes a ``momentum`` argument (``--momentum`` goes to them).
WITH_MOMENTUM = ("sgd", "rmsprop")


def make_optimizer(config: OptimConfig, schedule: WarmupScaledRate) -> keras.optimizers.Optimizer:
    """The configured optimizer at the schedule's starting rate (``RateControl`` moves it): a
    Keras optimizer by name with its defaults (``auto``, with no compiled optimizer to take:
    sgd), or a user's ``package.module:fn(learning_rate)`` called with the base rate."""
    if is_plugin(config.optimizer):
        optimizer = load_callable(config.optimizer, "optimizer")(schedule.base)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise UserError(f"'{config.optimizer}' returned {type(optimizer).__name__}, not a "
                            "keras.optimizers.Optimizer; build it with the learning rate it "
                            "receives and return it")
        return optimizer
    name = "sgd" if config.optimizer == "auto" else config.optimizer   # nothing compiled
    arguments = {"learning_rate": schedule.base}
    if name in WITH_MOMENTUM:
        arguments["momentum"] = config.momentum
    return keras_optimizer_classes()[name](**arguments)


def keras_optimizer_classes() -> dict[str, type]:
    """Keras' optimizers by lower-case class name (``keras.optimizers.get`` knows only some)."""
    return {name.lower(): value for name, value in vars(keras.optimizers).items()
            if isinstance(value, type) and issubclass(value, keras.optimizers.Optimizer)}


class PlateauDecay(keras.callbacks.Callback):
    """Multiply the rate by ``factor`` when the averaged val_loss has not improved for
    ``patience`` epochs. Every rank sees the same reduced val_loss, so all decide alike."""

    def __init__(self, schedule: WarmupScaledRate, factor: float, patience: int) -> None:
        super().__init__()
        self.schedule = schedule
        self.factor = factor
        self.patience = patience
        self.best = float("inf")
        self.wait = 0

    def state(self) -> dict[str, float]:
        return {"best": self.best, "wait": self.wait, "scale": self.schedule.plateau_scale}

    def load(self, state: dict[str, float]) -> None:
        self.best, self.wait = state["best"], int(state["wait"])
        self.schedule.plateau_scale = float(state["scale"])

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        assert logs is not None   # Keras hands every epoch end its logs
        if logs["val_loss"] < self.best:
            self.best, self.wait = logs["val_loss"], 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.schedule.plateau_scale *= self.factor
            self.wait = 0


class RateControl(keras.callbacks.Callback):
    """Before every step, set each optimizer's rate: its base rate times the schedule's
    multiplier at its own step counter, times whatever other callbacks did to it.

    A callback that sets the rate (Keras' ``ReduceLROnPlateau``, ``LearningRateScheduler``)
    is seen as a change since the rate last set here; the ratio is kept as a factor, so the
    change lasts and the schedule goes on from it. Factors are saved in checkpoints.
    """

    def __init__(self, schedule: WarmupScaledRate,
                 bases: dict[str, tuple[keras.optimizers.Optimizer, float]]) -> None:
        """``bases``: attribute name -> (optimizer, its base rate for one rank)."""
        super().__init__()
        self.schedule = schedule
        self.bases = bases
        self.factors = {name: 1.0 for name in bases}
        self.last_set: dict[str, float | None] = {name: None for name in bases}

    def state(self) -> dict[str, float]:
        return dict(self.factors)

    def load(self, factors: dict[str, float]) -> None:
        self.factors.update({name: float(f) for name, f in factors.items() if name in self.bases})

    def set_rates(self) -> None:
        for name, (optimizer, base) in self.bases.items():
            current = float(optimizer.learning_rate)
            last = self.last_set[name]
            if last is not None and last > 0 and current != last:
                self.factors[name] *= current / last
            step = int(optimizer.iterations.numpy())
            optimizer.learning_rate = base * self.schedule.multiplier(step) * self.factors[name]
            self.last_set[name] = float(optimizer.learning_rate)

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Set the rates for the coming step at once (an elastic segment that starts at an
        epoch's end runs no step, yet logs its world's rate), and note them, so a change a
        callback makes before the first step (at the first epoch's begin) is seen as one."""
        for name in self.bases:
            self.last_set[name] = None
        self.set_rates()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.set_rates()

    def on_train_end(self, logs: dict | None = None) -> None:
        """Remember each optimizer's base rate and the rate last set, so a next ``fit`` of the
        same model (a notebook) starts from the base again, not from the scaled rate."""
        for name, (optimizer, base) in self.bases.items():
            remember_rates(optimizer, base, float(optimizer.learning_rate))
