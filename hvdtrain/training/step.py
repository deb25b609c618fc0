"""One optimizer step and one evaluation step: the math both training loops share.

Each example's loss weight is 1/(examples in its global batch, or its group of accumulated
batches) times its sample weight, and regularisation is divided by the world size, so the
gradients summed (not averaged) across ranks make the update one process with an N-times larger
batch would, the short last batch included. The gradients travel in buckets of about
``--bucket-mib`` inside the step's ``tf.function``, so each starts while the backward pass goes
on; the loss and the stop votes ride in the first bucket, so every rank skips a non-finite
update, or stops, after the same step. Metrics sum their state across ranks once per epoch.
A model with its own ``train_step`` is trained by ``own_step`` instead; both are a ``TrainingStep``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol

import keras
import tensorflow as tf

from hvdtrain.collectives import Collectives, GradientReduction
from hvdtrain.training.accumulation import Accumulation
from hvdtrain.training.memory import variable_bytes
from hvdtrain.training.objective import BatchShares, MetricState, Objective
from hvdtrain.training.zero import Sharding, gradient_bytes_kept, sharded_for_the_run


class TrainingStep(Protocol):
    """What the loops and callbacks ask of a training step, whichever code it runs."""

    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    # Every optimizer the step applies, by the model's attribute name ("optimizer" first).
    optimizers: dict[str, keras.optimizers.Optimizer]
    collectives: Collectives
    # The last step's loss over the global batch (equal on every rank): stops a diverged run.
    global_loss: tf.Variable
    # Set here, summed across ranks in the step: a stop request, and a batch hook's stop.
    stop_vote: tf.Variable
    stop_votes: tf.Variable
    callback_stop_vote: tf.Variable
    callback_stop_votes: tf.Variable
    # False when the update of a step whose loss is not finite has already been applied.
    skips_non_finite_updates: bool
    # How the step's gradients travel (buckets, their order, compression).
    reduction: GradientReduction

    def keras_step(self, data: Any) -> dict[str, Any]:
        """One step on one dataset element (graph-safe): Keras ``fit`` runs it as the model's
        ``train_step``, the custom loop in a ``tf.function``."""

    def begin_epoch(self) -> None:
        """Start the epoch's running metric state afresh."""

    def epoch_results(self, logs: dict[str, Any]) -> dict[str, float]:
        """The epoch's exact global metrics, equal on every rank (a collective)."""

    @property
    def epoch_state_variables(self) -> list[Any]:
        """The epoch's running metric state (mid-epoch checkpoints save its sum over ranks)."""

    @property
    def probed_metrics(self) -> list[Any]:
        """The metric states a probe batch must build before training (none: the model's)."""

    def validation(self) -> tuple[Callable[[Any], dict[str, float]], list[Any]]:
        """(exact validation over every rank's share of a dataset, ``val_*`` names; the metric
        states the probe batch must build for it)."""

    def training(self, end_in_pieces: bool = False) -> ContextManager[None]:
        """What must be in place while this step trains (the run enters it around the loop);
        ``end_in_pieces``: sharded optimizer state may stay in pieces after (``zero``)."""

    def gradient_bytes(self) -> int:
        """The gradient bytes this rank keeps after the exchange (``memory.HeldMemory``)."""


def vote_variables() -> tuple[tf.Variable, ...]:
    """(global loss, stop vote, stop votes, callback stop vote, callback stop votes)."""
    return tuple(tf.Variable(0.0, trainable=False, dtype=tf.float32) for _ in range(5))


@dataclass(frozen=True)
class StepOptions:
    """How gradients travel (accumulation steps, Adasum or mean, fp16 on the wire, bucket size
    and submission order),
    whether the data's weights already divide by the global batch, and whether the forward and
    backward pass are compiled with XLA (the model's ``jit_compile``), and the ZeRO stage
    (``training.zero``: 0, every rank holds the whole optimizer state)."""

    accumulation_steps: int = 1
    adasum: bool = False
    fp16_compression: bool = False
    normalised: bool = True
    bucket_bytes: int = 0
    xla: bool = False
    zero_stage: int = 0
    in_issue_order: bool = False

    def reduction(self, world_size: int) -> GradientReduction:
        """Gradients weighted by the global batch are summed; Adasum combines each rank's own
        mean gradient (its weighted sum times the world size), as Horovod's Adasum expects."""
        if self.adasum:
            return GradientReduction("adasum", self.fp16_compression, prescale=world_size,
                                     bucket_bytes=self.bucket_bytes,
                                     in_issue_order=self.in_issue_order)
        return GradientReduction("sum", self.fp16_compression, bucket_bytes=self.bucket_bytes,
                                 in_issue_order=self.in_issue_order)


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
        self.skips_non_finite_updates = True
        self.reduction = options.reduction(collectives.world.size)
        (self.global_loss, self.stop_vote, self.stop_votes, self.callback_stop_vote,
         self.callback_stop_votes) = vote_variables()
        self._forward_backward = (tf.function(self.forward_backward, jit_compile=True)
                                  if options.xla else self.forward_backward)
        self.sharding: Sharding | None = None
        shapes = [v.shape for v in model.trainable_variables]
        if options.zero_stage:
            self.sharding = Sharding(collectives, options.zero_stage, self.reduction)
            self.sharding.register(model.trainable_variables)
            if options.zero_stage == 2:    # only this rank's pieces are summed
                shapes = self.sharding.piece_shapes(model.trainable_variables)
        self.accumulation: Accumulation | None = None
        if options.accumulation_steps > 1:    # the gradients' sums, then the loss's
            self.accumulation = Accumulation(shapes + [()], [tf.float32] * (len(shapes) + 1),
                                             options.accumulation_steps)

    def reduce(self, gradients: list[Any], scalars: list[tf.Tensor]) -> tuple[list, list]:
        """The step's exchange: (the gradients combined as the options say, the float32
        ``scalars`` summed). The scalars ride in the first bucket (the list's end), so no extra
        collective; with fp16 compression or Adasum they travel in a separate allreduce, as
        they must neither be rounded to float16 nor Adasum-combined. ``hvdtrain benchmark
        --loop exchange`` times this alone."""
        reduction = self.reduction
        if self.options.adasum or self.options.fp16_compression:
            summed = self.collectives.allreduce_sum(scalars)
            return self.collectives.reduce_gradients(gradients, reduction), summed
        reduced = self.collectives.reduce_gradients([*gradients, *scalars], reduction)
        return reduced[:len(gradients)], reduced[len(gradients):]

    def _apply(self, gradients: list[tf.Tensor], loss: tf.Tensor, pieces: bool = False) -> None:
        """Reduce across ranks and update, unless the global loss is not finite: then the
        update is skipped on every rank and ``global_loss`` tells the caller to stop. Sharded
        (ZeRO), the gradients are reduce-scattered (``pieces``: they already were) and the
        scalars travel in an allreduce of their own."""
        variables = self.model.trainable_variables
        scalars = [tf.cast(loss, tf.float32), tf.identity(self.stop_vote),
                   tf.identity(self.callback_stop_vote)]
        if self.sharding is None:
            gradients, (global_loss, votes, callback_votes) = self.reduce(list(gradients),
                                                                          scalars)
        else:
            global_loss, votes, callback_votes = self.collectives.allreduce_sum(scalars)
            if not pieces:
                gradients = self.sharding.scatter(list(gradients), variables)
        self.global_loss.assign(global_loss)
        self.stop_votes.assign(votes)
        self.callback_stop_votes.assign(callback_votes)

        def update() -> tf.Tensor:
            if self.sharding is None:
                self.optimizer.apply(gradients, variables)
            else:
                self.sharding.update(self.optimizer, gradients, variables)
            return tf.constant(True)

        tf.cond(tf.math.is_finite(self.global_loss), update, lambda: tf.constant(False))

    def _accumulate(self, accumulation: Accumulation, gradients: list[tf.Tensor],
                    loss: tf.Tensor) -> None:
        """Sum micro-steps' gradients (ZeRO stage 2: this rank's pieces of their sum over
        ranks, reduce-scattered every micro-step) and apply at the last."""
        pieces = self.sharding is not None and self.sharding.stage == 2
        if pieces:
            gradients = self.sharding.scatter(gradients, self.model.trainable_variables)
        accumulation.add([*gradients, loss])
        accumulation.at_the_last_pass(
            lambda totals: self._apply(totals[:-1], totals[-1], pieces=pieces))

    @property
    def epoch_state_variables(self) -> list:
        """The epoch's running metric state (saved by mid-epoch checkpoints)."""
        return self.train_metrics.variables

    @property
    def optimizers(self) -> dict[str, keras.optimizers.Optimizer]:
        return {"optimizer": self.optimizer}

    def begin_epoch(self) -> None:
        self.train_metrics.reset()

    @property
    def probed_metrics(self) -> list[Any]:
        return [self.train_metrics]

    def validation(self) -> tuple[Callable[[Any], dict[str, float]], list[Any]]:
        evaluation = Evaluation(self.model, self.collectives, self.objective,
                                xla=self.options.xla)
        return evaluation.run, [evaluation.metrics]

    def training(self, end_in_pieces: bool = False) -> ContextManager[None]:
        """hvdtrain's step reduces gradients itself; sharded, the optimizer holds pieces."""
        if self.sharding is None:
            return contextlib.nullcontext()
        return sharded_for_the_run([self.optimizer], self.sharding,
                                   self.model.trainable_variables, end_in_pieces)

    def epoch_results(self, logs: dict[str, Any]) -> dict[str, float]:
        return self.train_metrics.global_results(self.collectives)

    def gradient_bytes(self) -> int:
        totals = self.accumulation.totals if self.accumulation is not None else []
        return (gradient_bytes_kept(self.sharding, self.model.trainable_variables)
                + variable_bytes(totals))

    def keras_step(self, data: Any) -> dict[str, tf.Tensor]:
        return self.train_step(*data)

    def _global_weights(self, weights: tf.Tensor) -> tf.Tensor:
        """Weights that divide by the real examples of the global batch (see the module doc)."""
        if self.options.normalised:
            return weights
        count = self.collectives.allreduce_sum([tf.reduce_sum(weights)])[0]
        return weights / tf.maximum(count, 1.0)

    def forward_backward(self, x, y, sample_weight: tf.Tensor, weights: tf.Tensor) -> tuple:
        """This rank's part of the step that no collective touches: the forward pass, the
        global-batch-weighted loss and its gradients (compiled with XLA when the options say
        so: collectives have no XLA kernels, so they stay outside)."""
        with tf.GradientTape() as tape:
            predictions = self.model(x, training=True)
            total, parts = self.objective.per_example_losses(y, predictions)
            loss = tf.reduce_sum(total * sample_weight * weights)
            own_losses = model_losses(self.model)
            if self.model.losses:
                shares = self.collectives.world.size * self.options.accumulation_steps
                loss += own_losses / shares
            scaled = self.optimizer.scale_loss(loss) if self.loss_scaling else loss
        gradients = tape.gradient(scaled, self.model.trainable_variables)
        return gradients, loss, predictions, total, parts, own_losses

    def train_step(self, x, y, sample_weight: tf.Tensor,
                   weights: tf.Tensor) -> dict[str, tf.Tensor]:
        variables = self.model.trainable_variables
        weights = self._global_weights(weights)
        gradients, loss, predictions, total, parts, own_losses = self._forward_backward(
            x, y, sample_weight, weights)
        if self.accumulation is not None:
            self._accumulate(self.accumulation,
                             [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                              for g, v in zip(gradients, variables)], loss)
        else:
            self._apply(gradients, loss)
        shares = BatchShares(weights, 1.0 / (self.collectives.world.size
                                             * self.options.accumulation_steps))
        self.train_metrics.update(y, predictions, total, parts, sample_weight, weights > 0,
                                  own_losses, shares)
        return self.train_metrics.local_results()


def xla_line(jit_compile: bool, own_step: bool) -> str:
    """The run log's line on XLA: the model's ``jit_compile`` (Keras' "auto" already resolved:
    on with a GPU where the model supports it, off on CPUs) taken as the user set it."""
    if jit_compile and own_step:
        return ("note: the model's own train_step runs without XLA although its jit_compile is "
                "True: its optimizers reduce gradients with collectives, which XLA cannot "
                "compile; compile the model with jit_compile=False to silence this")
    if jit_compile:
        return ("XLA: on for the forward and backward pass (the model's jit_compile); the "
                "collectives and the update run outside it")
    return "XLA: off (the model's jit_compile is False; Keras' 'auto' chooses off without a GPU)"


def model_losses(model: keras.Model) -> tf.Tensor:
    """The sum of the model's own losses of the last forward pass (``add_loss``, weight and
    activity regularisers), as float32; 0 when it has none."""
    if not model.losses:
        return tf.constant(0.0)
    return tf.cast(tf.add_n(model.losses), tf.float32)


class Evaluation:
    """Exact distributed evaluation: local metric state over this rank's shard, reduced once."""

    def __init__(self, model: keras.Model, collectives: Collectives,
                 objective: Objective, equal_steps: bool = True, xla: bool = False) -> None:
        """``equal_steps``: every rank runs as many steps (filled at weight zero), so a step
        may sum across ranks (the per-output loss columns' global batch sizes); false for a
        share read unpadded, whose per-output columns are means over examples. ``xla``: the
        forward pass and the losses compiled with XLA (the model's ``jit_compile``), the
        collectives and the metric sums outside."""
        self.model = model
        self.collectives = collectives
        self.objective = objective
        self.batch_means = equal_steps and bool(objective.output_loss_names)
        self.metrics = objective.new_metrics()
        self._step = tf.function(self._eval_step, jit_compile=False)
        self._forward = tf.function(self.forward, jit_compile=True) if xla else self.forward

    def forward(self, x, y) -> tuple:
        """The predictions, each example's losses and the model's own losses (no collective)."""
        predictions = self.model(x, training=False)
        total, parts = self.objective.per_example_losses(y, predictions)
        return predictions, total, parts, model_losses(self.model)

    def _eval_step(self, x, y, sample_weight: tf.Tensor, weights: tf.Tensor) -> None:
        predictions, total, parts, own_losses = self._forward(x, y)
        shares = None
        if self.batch_means:   # only the per-output columns need the global batch's size
            real = tf.cast(weights > 0, tf.float32)
            count = self.collectives.allreduce_sum([tf.reduce_sum(real)])[0]
            shares = BatchShares(real / tf.maximum(count, 1.0), 1.0 / self.collectives.world.size)
        self.metrics.update(y, predictions, total, parts, sample_weight, weights > 0,
                            own_losses, shares)

    def run(self, dataset: tf.data.Dataset, prefix: str = "val_") -> dict[str, float]:
        self.metrics.reset()
        for batch in dataset:
            self._step(*batch)
        return {prefix + name: value
                for name, value in self.metrics.global_results(self.collectives).items()}
