"""One optimizer step and one evaluation step: the math both training paths share.

Loss scaling: each example's weight is 1/(examples in its global batch, or in its group of
accumulated batches) (see the pipeline), so ``sum(weight * loss)`` on every rank, summed across
ranks by the allreduce, is the mean over the global batch; regularisation losses are divided by
the world size (and the accumulation steps) because every rank (and micro-step) adds them. The
gradients are therefore summed, not averaged, across ranks, and N ranks with batch b make the
same update as one process with batch N*b, including the short last batch of an epoch.

Gradient accumulation: k micro-steps add their gradients locally; the k-th reduces the sum
across ranks in one allreduce and applies it. Because the weights already divide by the group's
example count, this is the update of one k-times larger batch.

Mixed precision: with ``mixed_float16`` the optimizer is a Keras ``LossScaleOptimizer``; the
scaled gradients are reduced across ranks first, so every rank sees the same sum, makes the same
finite/non-finite decision and keeps the same loss scale.

Divergence: the loss is summed across ranks in the gradients' grouped allreduce (a separate one
with fp16 compression or Adasum), so every rank knows the global batch's loss; when it is NaN or
infinite every rank skips that update and the run stops there.

Stop requests: a rank asked to stop (see ``preemption``) sets ``stop_vote``; the vote rides in
the same allreduce as the loss, and ``stop_votes`` (the global sum) tells every rank, after the
same update, that the job stops there.

Metrics are kept as local sums (loss, correct, count) and reduced across ranks once per epoch:
the global accuracy is exactly global-correct / global-count, not a mean of per-rank means.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def per_example_outputs(model: keras.Model, x: tf.Tensor, y: tf.Tensor,
                        training: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-example cross-entropy (in float32, whatever the compute precision) and correctness."""
    probabilities = tf.cast(model(x, training=training), tf.float32)
    per_example = keras.losses.sparse_categorical_crossentropy(y, probabilities)
    predicted = tf.argmax(probabilities, axis=-1, output_type=y.dtype)
    return per_example, tf.cast(tf.equal(predicted, y), tf.float32)


@dataclass(frozen=True)
class StepOptions:
    """How gradients travel: accumulation steps, Adasum or mean, fp16 on the wire."""

    accumulation_steps: int = 1
    adasum: bool = False
    fp16_compression: bool = False


class StepMath:
    """Forward, weighted loss, gradients reduced across ranks, optimizer update, metric sums."""

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer,
                 collectives: Collectives, options: StepOptions = StepOptions()) -> None:
        self.model = model
        self.optimizer = optimizer
        self.collectives = collectives
        self.options = options
        self.train_sums = MetricSums("train")
        self.loss_scaling = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        # The last update's loss over the whole global batch: equal on every rank, so every
        # rank makes the same decision when it stops being finite.
        self.global_loss = tf.Variable(0.0, trainable=False, dtype=tf.float32)
        self.stop_vote = tf.Variable(0.0, trainable=False, dtype=tf.float32)
        self.stop_votes = tf.Variable(0.0, trainable=False, dtype=tf.float32)
        self.accumulated: list[tf.Variable] = []
        if options.accumulation_steps > 1:
            self.accumulated = [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False)
                                for v in model.trainable_variables]
            self.accumulated_loss = tf.Variable(0.0, trainable=False, dtype=tf.float32)
            self.micro_steps = tf.Variable(0, trainable=False, dtype=tf.int64)

    @property
    def epoch_state_variables(self) -> list[tf.Variable]:
        """The epoch's running metric state (summed across ranks when the epoch ends): what a
        mid-epoch checkpoint saves so the resumed epoch reports an uninterrupted run's values."""
        return self.train_sums.variables

    def _apply(self, gradients: list[tf.Tensor], loss: tf.Tensor) -> None:
        """Reduce across ranks and update, unless the global loss is not finite: then the
        update is skipped on every rank and ``global_loss`` tells the caller to stop."""
        scalars = [tf.cast(loss, tf.float32), tf.identity(self.stop_vote)]
        if self.options.adasum or self.options.fp16_compression:
            global_loss, votes = self.collectives.allreduce_sum(scalars)
            gradients = self.collectives.reduce_gradients(
                gradients, adasum=self.options.adasum, fp16=self.options.fp16_compression)
        else:   # one collective per step: loss and stop vote ride in the gradients' allreduce
            *gradients, global_loss, votes = self.collectives.reduce_gradients(
                [*gradients, *scalars], adasum=False, fp16=False)
        self.global_loss.assign(global_loss)
        self.stop_votes.assign(votes)

        def update() -> tf.Tensor:
            self.optimizer.apply(gradients, self.model.trainable_variables)
            return tf.constant(True)

        tf.cond(tf.math.is_finite(self.global_loss), update, lambda: tf.constant(False))

    def _accumulate(self, gradients: list[tf.Tensor], loss: tf.Tensor) -> None:
        for total, gradient in zip(self.accumulated, gradients):
            total.assign_add(tf.cast(gradient, tf.float32))
        self.accumulated_loss.assign_add(loss)
        self.micro_steps.assign_add(1)

        def apply_and_reset() -> tf.Tensor:
            self._apply([tf.identity(total) for total in self.accumulated],
                        tf.identity(self.accumulated_loss))
            for total in self.accumulated:
                total.assign(tf.zeros_like(total))
            self.accumulated_loss.assign(0.0)
            return tf.constant(True)

        tf.cond(self.micro_steps % self.options.accumulation_steps == 0, apply_and_reset,
                lambda: tf.constant(False))

    def train_step(self, x: tf.Tensor, y: tf.Tensor, weights: tf.Tensor) -> dict[str, tf.Tensor]:
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            per_example, correct = per_example_outputs(self.model, x, y, training=True)
            loss = tf.reduce_sum(per_example * weights)
            if self.model.losses:
                shares = self.collectives.world.size * self.options.accumulation_steps
                loss += tf.cast(tf.add_n(self.model.losses), tf.float32) / shares
            scaled = self.optimizer.scale_loss(loss) if self.loss_scaling else loss
        gradients = tape.gradient(scaled, variables)
        gradients = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                     for g, v in zip(gradients, variables)]
        if self.accumulated:
            self._accumulate(gradients, loss)
        else:
            self._apply(gradients, loss)
        self.train_sums.add(per_example, correct, tf.cast(weights > 0, tf.float32))
        return self.train_sums.local_means()


class Evaluation:
    """Exact distributed evaluation: local sums over this rank's shard, reduced once."""

    def __init__(self, model: keras.Model, collectives: Collectives) -> None:
        self.model = model
        self.collectives = collectives
        self.sums = MetricSums("eval")
        self._step = tf.function(self._eval_step, jit_compile=False)

    def _eval_step(self, x: tf.Tensor, y: tf.Tensor, weights: tf.Tensor) -> None:
        per_example, correct = per_example_outputs(self.model, x, y, training=False)
        self.sums.add(per_example, correct, tf.cast(weights > 0, tf.float32))

    def run(self, dataset: tf.data.Dataset, prefix: str = "val_") -> dict[str, float]:
        self.sums.reset()
        for features, labels, weights in dataset:
            self._step(features, labels, weights)
        return self.sums.global_means(self.collectives, prefix=prefix)
