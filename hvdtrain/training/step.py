"""One optimizer step and one evaluation step: the math both training paths share.

Loss scaling: each example's weight is 1/(examples in its global batch, or in its group of
accumulated batches) (see the pipeline), times the user's sample weight, so
``sum(weight * loss)`` on every rank, summed across ranks by the allreduce, is the mean over the
global batch; regularisation losses are divided by the world size (and the accumulation steps)
because every rank (and micro-step) adds them. The gradients are therefore summed, not averaged,
across ranks, and N ranks with batch b make the same update as one process with batch N*b,
including the short last batch of an epoch. A source that cannot know the global batch in
advance (a user's tf.data pipeline, ``normalised`` false) gives weight 1 to real examples; the
step then sums the real examples across ranks first and divides by that count.

The loss of each example and the metrics come from the model's objective (its compiled loss
and metrics, or hvdtrain's default): see ``hvdtrain.training.objective``.

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

Metrics are Keras metric objects updated locally and reduced across ranks once per epoch by
summing their state variables: every metric is exact over the global data, not a mean of
per-rank means.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import tensorflow as tf

from hvdtrain.training.objective import MetricState, Objective
from hvdtrain.world import Collectives, GradientReduction


@dataclass(frozen=True)
class StepOptions:
    """How gradients travel (accumulation steps, Adasum or mean, fp16 on the wire) and whether
    the data's weights already divide by the global batch."""

    accumulation_steps: int = 1
    adasum: bool = False
    fp16_compression: bool = False
    normalised: bool = True

    def reduction(self, world_size: int) -> GradientReduction:
        """Gradients weighted by the global batch are summed; Adasum combines each rank's own
        mean gradient (its weighted sum times the world size), as Horovod's Adasum expects."""
        if self.adasum:
            return GradientReduction("adasum", self.fp16_compression, prescale=world_size)
        return GradientReduction("sum", self.fp16_compression)


class StepMath:
    """Forward, weighted loss, gradients reduced across ranks, optimizer update, metric sums."""

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer,
                 collectives: Collectives, objective: Objective,
                 options: StepOptions = StepOptions(),
                 train_metrics: MetricState | None = None) -> None:
        """``train_metrics``: built metric state to keep (elastic training makes a step per
        world and keeps one state); a new one otherwise."""
        self.model = model
        self.optimizer = optimizer
        self.collectives = collectives
        self.objective = objective
        self.options = options
        self.train_metrics = train_metrics or objective.new_metrics()
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

    def _apply(self, gradients: list[tf.Tensor], loss: tf.Tensor) -> None:
        """Reduce across ranks and update, unless the global loss is not finite: then the
        update is skipped on every rank and ``global_loss`` tells the caller to stop."""
        scalars = [tf.cast(loss, tf.float32), tf.identity(self.stop_vote)]
        if self.options.adasum or self.options.fp16_compression:
            global_loss, votes = self.collectives.allreduce_sum(scalars)
            gradients = self.collectives.reduce_gradients(
                gradients, self.options.reduction(self.collectives.world.size))
        else:   # one collective per step: loss and stop vote ride in the gradients' allreduce
            *gradients, global_loss, votes = self.collectives.reduce_gradients(
                [*gradients, *scalars])
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

    @property
    def epoch_state_variables(self) -> list:
        """The epoch's running metric state (saved by mid-epoch checkpoints)."""
        return self.train_metrics.variables

    def _global_weights(self, weights: tf.Tensor) -> tf.Tensor:
        """Weights that divide by the real examples of the global batch (see the module doc)."""
        if self.options.normalised:
            return weights
        count = self.collectives.allreduce_sum([tf.reduce_sum(weights)])[0]
        return weights / tf.maximum(count, 1.0)

    def train_step(self, x, y, sample_weight: tf.Tensor,
                   weights: tf.Tensor) -> dict[str, tf.Tensor]:
        variables = self.model.trainable_variables
        weights = self._global_weights(weights)
        with tf.GradientTape() as tape:
            predictions = self.model(x, training=True)
            total, parts = self.objective.per_example_losses(y, predictions)
            loss = tf.reduce_sum(total * sample_weight * weights)
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
        self.train_metrics.update(y, predictions, total, parts, sample_weight, weights > 0)
        return self.train_metrics.local_results()


class Evaluation:
    """Exact distributed evaluation: local metric state over this rank's shard, reduced once."""

    def __init__(self, model: keras.Model, collectives: Collectives,
                 objective: Objective) -> None:
        self.model = model
        self.collectives = collectives
        self.objective = objective
        self.metrics = objective.new_metrics()
        self._step = tf.function(self._eval_step, jit_compile=False)

    def _eval_step(self, x, y, sample_weight: tf.Tensor, weights: tf.Tensor) -> None:
        predictions = self.model(x, training=False)
        total, parts = self.objective.per_example_losses(y, predictions)
        self.metrics.update(y, predictions, total, parts, sample_weight, weights > 0)

    def run(self, dataset: tf.data.Dataset, prefix: str = "val_") -> dict[str, float]:
        self.metrics.reset()
        for batch in dataset:
            self._step(*batch)
        return {prefix + name: value
                for name, value in self.metrics.global_results(self.collectives).items()}
