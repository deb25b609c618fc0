"""Learning rate: scaled with the world size, reached by a linear warmup, then a schedule.

A global batch N times larger wants an N times larger rate (linear scaling) or sqrt(N) (square
root scaling); jumping there at step 0 destabilises early training, so the rate ramps linearly
from the single-rank rate to the scaled one over the first ``warmup_epochs`` (Goyal et al.,
2017). After warmup it stays constant, follows a cosine to zero at the last step, decays by a
factor every few epochs, or decays by a factor when the averaged validation loss stalls.

The rate is a function of the optimizer's step counter (and, for plateau decay, of a scale
that is saved in checkpoints), so a resumed run continues at the right rate. With gradient
accumulation the counter advances once per update, not once per batch.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from hvdtrain.config import OptimConfig
from hvdtrain.errors import UserError
from hvdtrain.plugins import is_plugin, load_callable


def scale_factor(policy: str, world_size: int) -> float:
    """How much larger the rate is for ``world_size`` ranks than for one."""
    if policy == "linear":
        return float(world_size)
    if policy == "sqrt":
        return math.sqrt(world_size)
    return 1.0


class WarmupScaledRate(keras.optimizers.schedules.LearningRateSchedule):
    """``base`` at step 0, linearly to ``base * scale`` at ``warmup_steps``, then ``decay``."""

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
        self.plateau_scale = tf.Variable(1.0, trainable=False, dtype=tf.float32,
                                         name="plateau_scale")
        # The world-size factor as a variable: elastic training changes it without retracing.
        self.world_scale = tf.Variable(self.scale, trainable=False, dtype=tf.float32,
                                       name="world_scale")

    def set_world_scale(self, scale: float) -> None:
        self.scale = float(scale)
        self.world_scale.assign(self.scale)

    def _after_warmup(self, step: tf.Tensor) -> tf.Tensor:
        target = self.base * self.world_scale
        if self.decay == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = tf.clip_by_value((step - self.warmup_steps) / span, 0.0, 1.0)
            return target * 0.5 * (1.0 + tf.cos(math.pi * progress))
        if self.decay == "step" and self.decay_steps > 0:
            return target * tf.pow(self.decay_factor, tf.floor(step / self.decay_steps))
        return target

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        if self.warmup_steps > 0:
            progress = tf.minimum(1.0, step / self.warmup_steps)
            warm = self.base + (self.base * self.world_scale - self.base) * progress
            rate = tf.where(step < self.warmup_steps, warm, self._after_warmup(step))
        else:
            rate = self._after_warmup(step)
        return rate * self.plateau_scale

    def get_config(self) -> dict:
        return {"base": self.base, "scale": self.scale, "warmup_steps": self.warmup_steps,
                "decay": self.decay, "total_steps": self.total_steps,
                "decay_steps": self.decay_steps, "decay_factor": self.decay_factor}


def world_scale(config: OptimConfig, world_size: int) -> float:
    """The rate's factor for this world. Adasum combines gradients so that the single-rank rate
    stays right (Horovod's guidance), so it is never scaled."""
    return scale_factor("none" if config.reduction == "adasum" else config.lr_scaling,
                        world_size)


def make_schedule(config: OptimConfig, world_size: int, updates_per_epoch: int,
                  epochs: int) -> WarmupScaledRate:
    return WarmupScaledRate(
        base=config.learning_rate,
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
    """The configured optimizer driven by ``schedule`` (scaled and warmed up): a Keras optimizer
    by name with its defaults, or a user's ``package.module:fn(learning_rate)``."""
    if is_plugin(config.optimizer):
        optimizer = load_callable(config.optimizer, "optimizer")(schedule)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise UserError(f"'{config.optimizer}' returned {type(optimizer).__name__}, not a "
                            "keras.optimizers.Optimizer; build it with learning_rate=the "
                            "schedule it receives and return it")
        return optimizer
    arguments = {"learning_rate": schedule}
    if config.optimizer in WITH_MOMENTUM:
        arguments["momentum"] = config.momentum
    return keras_optimizer_classes()[config.optimizer](**arguments)


def keras_optimizer_classes() -> dict[str, type]:
    """Keras' optimizers by lower-case class name (``keras.optimizers.get`` knows only some)."""
    return {name.lower(): value for name, value in vars(keras.optimizers).items()
            if isinstance(value, type) and issubclass(value, keras.optimizers.Optimizer)}
