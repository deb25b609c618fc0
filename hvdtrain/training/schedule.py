"""Learning rate: scaled with the world size, reached by a linear warmup (Goyal et al., 2017).

A global batch N times larger wants an N times larger rate (linear scaling) or sqrt(N) (square
root scaling); jumping there at step 0 destabilises early training, so the rate ramps linearly
from the single-rank rate to the scaled one over the first ``warmup_epochs``. The rate is a
function of the optimizer's step counter, so a resumed run continues at the right rate.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from hvdtrain.config import OptimConfig


def scale_factor(policy: str, world_size: int) -> float:
    """How much larger the rate is for ``world_size`` ranks than for one."""
    if policy == "linear":
        return float(world_size)
    if policy == "sqrt":
        return math.sqrt(world_size)
    return 1.0


class WarmupScaledRate(keras.optimizers.schedules.LearningRateSchedule):
    """``base`` at step 0, rising linearly to ``base * scale`` at ``warmup_steps``, then flat."""

    def __init__(self, base: float, scale: float, warmup_steps: int) -> None:
        self.base = float(base)
        self.scale = float(scale)
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        target = self.base * self.scale
        if self.warmup_steps <= 0:
            return tf.constant(target, tf.float32)
        progress = tf.minimum(1.0, tf.cast(step, tf.float32) / self.warmup_steps)
        return self.base + (target - self.base) * progress

    def get_config(self) -> dict:
        return {"base": self.base, "scale": self.scale, "warmup_steps": self.warmup_steps}


def make_schedule(config: OptimConfig, world_size: int, steps_per_epoch: int) -> WarmupScaledRate:
    warmup_steps = int(round(config.warmup_epochs * steps_per_epoch))
    return WarmupScaledRate(config.learning_rate, scale_factor(config.lr_scaling, world_size),
                            warmup_steps)


def make_optimizer(config: OptimConfig, schedule: WarmupScaledRate) -> keras.optimizers.Optimizer:
    if config.optimizer == "adam":
        return keras.optimizers.Adam(learning_rate=schedule)
    return keras.optimizers.SGD(learning_rate=schedule, momentum=config.momentum)
