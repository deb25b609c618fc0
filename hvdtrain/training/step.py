"""One optimizer step and one evaluation step: the math both training paths share.

Loss scaling: each example's weight is 1/(examples in its global batch) (see the pipeline), so
``sum(weight * loss)`` on every rank, summed across ranks by the allreduce, is the mean over the
global batch; regularisation losses are divided by the world size because every rank adds them.
The gradients are therefore summed, not averaged, across ranks, and N ranks with batch b make the
same update as one process with batch N*b, including the short last batch of an epoch.

Metrics are kept as local sums (loss, correct, count) and reduced across ranks once per epoch:
the global accuracy is exactly global-correct / global-count, not a mean of per-rank means.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from hvdtrain.world import Collectives

SUM_NAMES = ("loss_sum", "correct", "count")


class MetricSums:
    """Local running sums of (loss, correct predictions, examples), reduced exactly on demand."""

    def __init__(self, name: str) -> None:
        self.variables = [tf.Variable(0.0, trainable=False, dtype=tf.float64,
                                      name=f"{name}_{part}") for part in SUM_NAMES]

    def reset(self) -> None:
        for variable in self.variables:
            variable.assign(0.0)

    def add(self, per_example_loss: tf.Tensor, correct: tf.Tensor, valid: tf.Tensor) -> None:
        parts = (per_example_loss * valid, correct * valid, valid)
        for variable, part in zip(self.variables, parts):
            variable.assign_add(tf.reduce_sum(tf.cast(part, tf.float64)))

    def local_means(self) -> dict[str, tf.Tensor]:
        loss_sum, correct, count = self.variables
        count = tf.maximum(count, 1.0)
        return {"loss": loss_sum / count, "accuracy": correct / count}

    def global_means(self, collectives: Collectives, prefix: str = "") -> dict[str, float]:
        loss_sum, correct, count = (float(v) for v in collectives.allreduce_sum(
            [tf.identity(v) for v in self.variables]))
        count = max(count, 1.0)
        return {f"{prefix}loss": loss_sum / count, f"{prefix}accuracy": correct / count}


class StepMath:
    """Forward, weighted loss, gradients summed across ranks, optimizer update, metric sums."""

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer,
                 collectives: Collectives) -> None:
        self.model = model
        self.optimizer = optimizer
        self.collectives = collectives
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction=None)
        self.train_sums = MetricSums("train")
        self.eval_sums = MetricSums("eval")

    def _per_example(self, x: tf.Tensor, y: tf.Tensor, training: bool):
        probabilities = self.model(x, training=training)
        per_example = self.loss_fn(y, probabilities)
        predicted = tf.argmax(probabilities, axis=-1, output_type=y.dtype)
        return per_example, tf.cast(tf.equal(predicted, y), tf.float32)

    def train_step(self, x: tf.Tensor, y: tf.Tensor, weights: tf.Tensor) -> dict[str, tf.Tensor]:
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            per_example, correct = self._per_example(x, y, training=True)
            loss = tf.reduce_sum(per_example * weights)
            if self.model.losses:
                loss += tf.add_n(self.model.losses) / self.collectives.world.size
        gradients = tape.gradient(loss, variables)
        gradients = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                     for g, v in zip(gradients, variables)]
        gradients = self.collectives.allreduce_sum(gradients)
        self.optimizer.apply(gradients, variables)
        self.train_sums.add(per_example, correct, tf.cast(weights > 0, tf.float32))
        return self.train_sums.local_means()

    def eval_step(self, x: tf.Tensor, y: tf.Tensor, weights: tf.Tensor) -> None:
        per_example, correct = self._per_example(x, y, training=False)
        self.eval_sums.add(per_example, correct, tf.cast(weights > 0, tf.float32))
