"""One optimizer step and one evaluation step: the math every loop shares.

Keras computes the loss and the metrics (``model.compute_loss``, ``compute_metrics`` and its
loss tracker, as its own ``train_step`` does) on this rank's real rows; the distribution is
underneath. Each rank weights its loss by its share of the global batch, what Keras' reduction
divides by (``objective.LossShare``: rows, or summed sample weights), the gradients are summed
across ranks and divided by the summed shares: the update one process with an N-times larger
batch would make, the short last batch included. The gradients travel in buckets of about
``--bucket-mib`` inside the step's ``tf.function``, so each starts while the backward pass goes
on; the loss, the shares and the stop votes ride in the first bucket, so every rank skips a
non-finite update, or stops, after the same step. Metrics sum their state across ranks once per
epoch. A model with its own ``train_step`` is trained by ``own``; both are a
``TrainingStep``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Protocol

import keras
import tensorflow as tf

from hvdtrain.collectives import Collectives, GradientReduction, gathered_rows, variable_bytes
from hvdtrain.errors import found_by_every_rank
from hvdtrain.optimizers.accumulation import Accumulation
from hvdtrain.training.step.sync_batch_norm import batch_rows
from hvdtrain.training.step.votes import StopVotes
from hvdtrain.keras_internals import (keras_logits, loss_tracker, marked, output_loss_trackers,
                                      output_marks, with_logits)
from hvdtrain.training.step.objective import (LossShare, global_metric_results, metric_variables,
                                              own_losses, real_rows)
from hvdtrain.model_memory.for_run import LayerMemory
from hvdtrain.model_memory.remat import Remat
from hvdtrain.optimizers.powersgd import PowerSGD
from hvdtrain.optimizers.sharding import Sharding, gradient_bytes_kept
from hvdtrain.optimizers.state_into_pieces import SavedState
from hvdtrain.training.step.held import RunEnd, memory_for_the_run


class TrainingStep(Protocol):
    """What the loops and callbacks ask of a training step, whichever code it runs."""

    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    collectives: Collectives
    # The last step's loss over the global batch (equal on every rank): stops a diverged run.
    global_loss: tf.Variable
    # A stop request and a batch hook's stop, summed across ranks in the step.
    votes: StopVotes
    # False when the update of a step whose loss is not finite has already been applied.
    skips_non_finite_updates: bool
    # How the step's gradients travel (buckets, their order, compression); read when the step
    # is traced, so a loop may change it and trace again (``bucket_choice``).
    reduction: GradientReduction
    # The two ways the first steps time (``bucket_choice``); None: ``reduction`` throughout.
    bucket_candidates: tuple[GradientReduction, GradientReduction] | None
    # What the layers hold for the run (stage 3's gathered weights, --remat).
    layer_memory: LayerMemory
    # A resumed sharded run's optimizer state, loaded into pieces as training starts.
    saved_state: SavedState | None
    # --compression powersgd's state (checkpointed with each rank's own state); None without.
    powersgd: PowerSGD | None

    def keras_step(self, data: Any) -> dict[str, Any]:
        """One step on one dataset element (graph-safe): Keras ``fit`` runs it as the model's
        ``train_step``, the custom loop in a ``tf.function``."""

    @property
    def optimizers(self) -> dict[str, keras.optimizers.Optimizer]:
        """Every optimizer the step applies, by the model's attribute name ("optimizer"
        first)."""

    def begin_epoch(self) -> None:
        """Start the epoch's running metric state afresh."""

    def epoch_results(self, logs: dict[str, Any]) -> dict[str, float]:
        """The epoch's exact global metrics, equal on every rank (a collective)."""

    @property
    def epoch_state_variables(self) -> list[Any]:
        """The epoch's running metric state (mid-epoch checkpoints save its sum over ranks)."""

    def validation(self) -> Callable[[Any], dict[str, float]]:
        """Exact validation over every rank's share of a dataset, ``val_*`` names."""

    def training(self, ends: RunEnd = RunEnd()) -> ContextManager[None]:
        """What must be in place while this step trains (the run enters it around the loop);
        ``ends``: what may stay in pieces after it."""

    def gradient_bytes(self) -> int:
        """The gradient bytes this rank keeps after the exchange (``memory.HeldMemory``)."""


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """How gradients travel (accumulation steps, Adasum or mean, fp16 or bf16 on the wire,
    bucket size and submission order), the global batch the ranks' shares are counted against
    (a constant that keeps the weighted gradients at a mean's scale), whether the forward and
    backward pass are compiled with XLA (the model's ``jit_compile``), and the ZeRO stage
    (``optimizers.zero``: 0, every rank holds the whole optimizer state)."""

    accumulation_steps: int = 1
    adasum: bool = False
    compression: str = "none"
    global_batch: int = 1
    # Whether the data carries the user's sample (or class) weights: else Keras' loss and
    # metrics get none, as in Keras' own fit (a masked loss broadcasts them differently).
    sample_weights: bool = True
    bucket_bytes: int = 0
    xla: bool = False
    zero_stage: int = 0
    in_issue_order: bool = False
    remat: Remat | None = None
    # PowerSGD's rank (``optimizers.powersgd``; 0: none) and the seed of its first Q's.
    powersgd_rank: int = 0
    seed: int = 0

    def reduction(self, world_size: int) -> GradientReduction:
        """Gradients weighted by the global batch are summed; Adasum combines each rank's own
        mean gradient (its weighted sum times the world size), as Horovod's Adasum expects."""
        if self.adasum:
            return GradientReduction("adasum", self.compression, prescale=world_size,
                                     bucket_bytes=self.bucket_bytes,
                                     in_issue_order=self.in_issue_order)
        return GradientReduction("sum", self.compression, bucket_bytes=self.bucket_bytes,
                                 in_issue_order=self.in_issue_order)


class StepMath:
    """Forward pass, Keras' loss weighted by this rank's share of the global batch, gradients
    summed across ranks and divided by the summed shares, the optimizer's update, and Keras'
    metrics (their state summed across ranks once per epoch)."""

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer,
                 collectives: Collectives, share: LossShare = LossShare(),
                 options: StepOptions = StepOptions()) -> None:
        """``share``: what the model's loss divides a batch by (``objective.measured_share``)."""
        self.model = model
        self.optimizer = optimizer
        self.collectives = collectives
        self.share = share
        self.options = options
        self.loss_scaling = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        self.skips_non_finite_updates = True
        self.reduction = options.reduction(collectives.world.size)
        self.bucket_candidates: tuple[GradientReduction, GradientReduction] | None = None
        self.global_loss = tf.Variable(0.0, trainable=False, dtype=tf.float32)
        self.votes = StopVotes()
        self._forward_backward = (tf.function(self.forward_backward, jit_compile=True)
                                  if options.xla else self.forward_backward)
        self.sharding: Sharding | None = None
        shapes = [v.shape for v in model.trainable_variables]
        if options.zero_stage:
            self.sharding = Sharding(collectives, options.zero_stage, self.reduction)
            if options.zero_stage < 3:     # stage 3 cuts the weights when the run begins
                self.sharding.register(model.trainable_variables)
            if options.zero_stage >= 2:    # only this rank's pieces are summed
                shapes = self.sharding.piece_shapes(model.trainable_variables)
        self.layer_memory = LayerMemory(model, self.sharding, options.remat)
        self.saved_state: SavedState | None = None
        self.powersgd = (PowerSGD(model.trainable_variables, options.powersgd_rank, options.seed)
                         if options.powersgd_rank else None)
        self.accumulation: Accumulation | None = None
        if options.accumulation_steps > 1:   # the gradients' sums, the weighted loss's, shares'
            self.accumulation = Accumulation(shapes + [(), ()],
                                             [tf.float32] * (len(shapes) + 2),
                                             options.accumulation_steps)

    def reduce(self, gradients: list[Any], scalars: list[tf.Tensor]) -> tuple[list, list]:
        """The step's exchange: (the gradients combined as the options say, the float32
        ``scalars`` summed). The scalars ride in the first bucket (the list's end), so no extra
        collective; with compression (fp16, bf16) or Adasum they travel in a separate
        allreduce, as they must neither be rounded nor Adasum-combined. With PowerSGD the
        gradients it compresses travel in its two allreduces after the others' buckets.
        ``hvdtrain benchmark --loop exchange`` times this alone."""
        reduction = self.reduction
        if self.powersgd is not None:
            return self.powersgd.reduced(self.collectives, gradients,
                                         self.model.trainable_variables, reduction, scalars)
        if self.options.adasum or self.options.compression != "none":
            summed = self.collectives.allreduce_sum(scalars)
            return self.collectives.reduce_gradients(gradients, reduction), summed
        reduced = self.collectives.reduce_gradients([*gradients, *scalars], reduction)
        return reduced[:len(gradients)], reduced[len(gradients):]

    def _divided(self, gradients: list[Any], shares: tf.Tensor) -> list[Any]:
        """The summed share-weighted gradients over the summed shares: the global batch's
        gradient (Adasum combines the ranks' own gradients and a ``sum`` loss adds: as they
        are)."""
        if self.options.adasum or not self.share.divides:
            return gradients
        return divided(gradients, shares)

    def _apply(self, gradients: list[Any], weighted_loss: tf.Tensor, share: tf.Tensor,
               pieces: bool = False) -> tf.Tensor:
        """Reduce across ranks and update, unless the global loss is not finite: then the
        update is skipped on every rank and ``global_loss`` tells the caller to stop. Sharded
        (ZeRO), the gradients are reduce-scattered (``pieces``: they already were) and the
        scalars travel in an allreduce of their own. Returns the summed shares."""
        variables = self.model.trainable_variables
        scalars = [weighted_loss, share, *self.votes.to_reduce()]
        if self.sharding is None:
            gradients, (loss_sum, shares, *votes) = self.reduce(list(gradients), scalars)
        else:
            loss_sum, shares, *votes = self.collectives.allreduce_sum(scalars)
            if not pieces:
                gradients = self.sharding.scatter(list(gradients), variables)
        gradients = self._divided(gradients, shares)
        self.global_loss.assign(tf.math.divide_no_nan(loss_sum, shares)
                                if self.share.divides else loss_sum)
        self.votes.take_reduced(votes)

        def update() -> tf.Tensor:
            if self.sharding is None:
                self.optimizer.apply(gradients, variables)
            else:
                self.sharding.update(self.optimizer, gradients, variables)
            return tf.constant(True)

        tf.cond(tf.math.is_finite(self.global_loss), update, lambda: tf.constant(False))
        return shares

    def _accumulate(self, accumulation: Accumulation, gradients: list[tf.Tensor],
                    weighted_loss: tf.Tensor, share: tf.Tensor) -> None:
        """Sum micro-steps' gradients (ZeRO stage 2: this rank's pieces of their sum over
        ranks, reduce-scattered every micro-step) and apply at the last."""
        pieces = self._gradients_in_pieces
        if self.sharding is not None and self.sharding.stage == 2:
            pieces = True
            gradients = self.sharding.scatter(gradients, self.model.trainable_variables)
        accumulation.add([*gradients, weighted_loss, share])
        accumulation.at_the_last_pass(
            lambda totals: self._apply(totals[:-2], totals[-2], totals[-1], pieces=pieces))

    @property
    def epoch_state_variables(self) -> list:
        """The epoch's running metric state (saved by mid-epoch checkpoints)."""
        return metric_variables(self.model)

    @property
    def optimizers(self) -> dict[str, keras.optimizers.Optimizer]:
        return {"optimizer": self.optimizer}

    def begin_epoch(self) -> None:
        self.model.reset_metrics()

    def validation(self) -> Callable[[Any], dict[str, float]]:
        return Evaluation(self.model, self.collectives, self.options.xla, self.share,
                          self.options.sample_weights, equal_steps=True).run

    @property
    def _gradients_in_pieces(self) -> bool:
        """Stage 3's gradients leave the backward pass reduce-scattered (``model_memory``)."""
        return self.layer_memory.gathers

    @contextlib.contextmanager
    def training(self, ends: RunEnd = RunEnd()) -> Iterator[None]:
        """hvdtrain's step reduces gradients itself; sharded, the optimizer holds pieces (and
        at stage 3 the model's weights too); the layers recompute what ``--remat`` says."""
        with contextlib.ExitStack() as stack:
            memory_for_the_run(stack, self, self.sharding, self.model.trainable_variables, ends)
            yield

    def epoch_results(self, logs: dict[str, Any]) -> dict[str, float]:
        return global_metric_results(self.model, self.collectives)

    def gradient_bytes(self) -> int:
        totals = self.accumulation.totals if self.accumulation is not None else []
        compression = self.powersgd.state_bytes() if self.powersgd is not None else 0
        return (gradient_bytes_kept(self.sharding, self.model.trainable_variables)
                + variable_bytes(totals) + compression)

    def keras_step(self, data: Any) -> dict[str, tf.Tensor]:
        with found_by_every_rank(), self.layer_memory.reads_guarded():
            return self.train_step(*data)

    def forward_backward(self, x, y, sample_weight: Any, weights: tf.Tensor) -> tuple:
        """This rank's part of the step that no collective touches: the forward pass on the
        batch's real rows, Keras' loss weighted by this rank's share and its gradients
        (compiled with XLA when the options say so: collectives have no XLA kernels, so they
        stay outside). A filler batch is computed but weighs nothing."""
        count, size = real_rows(weights), self.collectives.world.size
        sample_weight = sample_weight if self.options.sample_weights else None
        with tf.GradientTape() as tape:
            with batch_rows(weights > 0):   # a filler counts in no synchronized BN statistics
                predictions = self.model(x, training=True)
            loss = keras_loss(self.model, self.collectives, self.share, y, predictions,
                              sample_weight, count, tf.shape(weights)[0], training=True)
            share = self.share.of(count, sample_weight, predictions) * tf.cast(count > 0,
                                                                               tf.float32)
            if self.share.divides:    # counted against the global batch: a mean's scale
                share /= self.options.global_batch
            weighted = self.share.weighted(loss, share, own_losses(self.model),
                                           size * self.options.accumulation_steps)
            scaled = self.optimizer.scale_loss(weighted) if self.loss_scaling else weighted
        gradients = tape.gradient(scaled, self.model.trainable_variables)
        return (gradients, loss, self.share.reported(loss, weighted, size), share,
                (y, predictions, sample_weight, count), output_marks(predictions))

    def train_step(self, x, y, sample_weight: Any, weights: tf.Tensor) -> dict[str, tf.Tensor]:
        variables = self.model.trainable_variables
        columns = OutputColumns(self.model)
        gradients, loss, weighted, share, real, marks = self._forward_backward(
            x, y, sample_weight, weights)
        marked(real[1], marks)    # what XLA's boundary dropped
        if self.accumulation is not None:
            self._accumulate(self.accumulation,
                             [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                              for g, v in zip(gradients, variables)], weighted, share)
            columns.scale(tf.cast(real[3] > 0, tf.float32))
        else:   # the tracker gets the global batch's loss, as one process's does
            shares = self._apply(gradients, weighted, share, pieces=self._gradients_in_pieces)
            columns.scale(self.share.column_factor(share, shares, self.collectives.world.size))
            loss = self.global_loss.read_value()
        return keras_metrics(self.model, loss, *real)


def keras_loss(model: keras.Model, collectives: Collectives, share: LossShare, y: Any,
               predictions: Any, sample_weight: Any, count: tf.Tensor, capacity: tf.Tensor,
               training: bool) -> tf.Tensor:
    """Keras' loss of this rank's batch (``model.compute_loss``), or of the global batch
    where the share is ``gathered``, as one float32 value (a loss compiled with reduction
    ``None`` gives one per row, summed here as Keras' gradient sums them)."""
    if share.divisor == "gathered":   # the logits too, which Keras' crossentropy reads
        leaves = tf.nest.flatten(predictions)
        logits = [keras_logits(leaf) for leaf in leaves]
        (y, sample_weight), (leaves, logits) = gathered_rows(
            collectives, (y, sample_weight), (leaves, logits), count, capacity)
        predictions = tf.nest.pack_sequence_as(predictions, [
            leaf if each is None else with_logits(leaf, each)
            for leaf, each in zip(leaves, logits)])
    loss = model.compute_loss(y=y, y_pred=predictions, sample_weight=sample_weight,
                              training=training)
    return tf.reduce_sum(tf.cast(loss, tf.float32))


def divided(gradients: list[Any], total: tf.Tensor) -> list[Any]:
    """Reduced gradients (dense or sparse; None stays None) over ``total``, the summed shares.
    Full batches' shares in rows sum to exactly 1, and dividing by 1 changes no bit: then the
    pass over every gradient is skipped (ResNet-50's on one CPU thread: 4 ms of a step)."""
    present = [gradient for gradient in gradients if gradient is not None]
    if not present:
        return list(gradients)

    def each() -> list[Any]:
        return [tf.IndexedSlices(tf.math.divide_no_nan(g.values, tf.cast(total, g.values.dtype)),
                                 g.indices, g.dense_shape) if isinstance(g, tf.IndexedSlices)
                else tf.math.divide_no_nan(g, tf.cast(total, g.dtype)) for g in present]

    quotients = iter(tf.cond(tf.equal(total, 1.0), lambda: present, each))
    return [None if gradient is None else next(quotients) for gradient in gradients]


class OutputColumns:
    """Keras' per-output loss trackers as a step begins: each batch adds its output's loss (a
    mean over the rank's rows) with weight one, so after the step this rank's addition is
    scaled by ``column_factor``, and the trackers summed across ranks hold one process's
    means of its global batches' values."""

    def __init__(self, model: keras.Model) -> None:
        self.trackers = output_loss_trackers(model)
        self.before = [tf.identity(tracker.total) for tracker in self.trackers]

    def scale(self, factor: tf.Tensor) -> None:
        """This step's additions to each total times ``factor`` (0 for a filler: the count
        still grows on every rank, as one process's grows once per global batch)."""
        for tracker, total in zip(self.trackers, self.before):
            added = tf.convert_to_tensor(tracker.total) - total
            tracker.total.assign(total + added * tf.cast(factor, added.dtype))


def keras_metrics(model: keras.Model, loss: tf.Tensor, y: Any, predictions: Any,
                  sample_weight: Any, count: tf.Tensor) -> dict[str, tf.Tensor]:
    """Keras' own bookkeeping of a step on this rank's real rows (as its ``train_step`` and
    ``test_step`` end): the loss tracker fed the batch's loss weighted by its rows, then
    ``compute_metrics``; its logs are this rank's running values."""
    loss_tracker(model).update_state(loss, sample_weight=count)

    def update() -> tf.Tensor:
        model.compute_metrics(None, y, predictions, sample_weight=sample_weight)
        return tf.constant(True)

    tf.cond(count > 0, update, lambda: tf.constant(False))   # a filler counts in no metric
    return model.get_metrics_result()


class Evaluation:
    """Exact distributed evaluation as Keras' ``test_step`` computes it: the model's metrics
    over this rank's shard, their state summed across ranks once."""

    def __init__(self, model: keras.Model, collectives: Collectives, xla: bool = False,
                 share: LossShare = LossShare(), sample_weights: bool = True,
                 equal_steps: bool = False) -> None:
        """``xla``: the forward pass and the loss compiled with XLA (the model's
        ``jit_compile``), the metrics and their sums outside; ``share``: the training loss's
        (a ``gathered`` loss is measured on each global batch too); ``sample_weights``: as
        ``StepOptions``'; ``equal_steps``: every rank runs every step (a validation plan), so a
        loss whose batch value is not a mean over rows, and the per-output loss columns, are
        made the global batch's with one small allreduce a step."""
        self.model = model
        self.collectives = collectives
        self.share = share
        self.sample_weights = sample_weights
        self.summed = equal_steps and collectives.world.size > 1 and (
            share.divisor != "rows" or share.masked or bool(output_loss_trackers(model)))
        self._forward = tf.function(self.forward, jit_compile=True) if xla else self.forward
        self._steps: dict[str, Any] = {}    # the step traced for each element spec

    def forward(self, x, y, sample_weight: Any, weights: tf.Tensor) -> tuple:
        """The loss and what the metrics read, on the batch's real rows (no collective)."""
        count = real_rows(weights)
        predictions = self.model(x, training=False)
        sample_weight = sample_weight if self.sample_weights else None
        loss = keras_loss(self.model, self.collectives, self.share, y, predictions,
                          sample_weight, count, tf.shape(weights)[0], training=False)
        share = self.share.of(count, sample_weight, predictions) * tf.cast(count > 0, tf.float32)
        return (loss, own_losses(self.model), share, (y, predictions, sample_weight, count),
                output_marks(predictions))

    def _eval_step(self, x, y, sample_weight: Any, weights: tf.Tensor) -> None:
        columns = OutputColumns(self.model)
        loss, own, share, real, marks = self._forward(x, y, sample_weight, weights)
        marked(real[1], marks)    # what XLA's boundary dropped
        if self.summed:    # the global batch's loss and columns, as in the training step
            size = self.collectives.world.size
            weighted = self.share.weighted(loss, share, own, size)
            part, shares = self.collectives.allreduce_sum(
                [self.share.reported(loss, weighted, size), share])
            columns.scale(self.share.column_factor(share, shares, size))
            loss = tf.math.divide_no_nan(part, shares) if self.share.divides else part
        keras_metrics(self.model, loss, *real)

    def run(self, dataset: tf.data.Dataset, prefix: str = "val_") -> dict[str, float]:
        """The metrics over ``dataset`` (cut to its real rows by the caller: ``real_rows_only``),
        the step traced from its element spec, as Keras' ``evaluate`` traces it from its
        iterator (a batch's rows known or not alike)."""
        self.model.reset_metrics()
        key = repr(dataset.element_spec)
        if key not in self._steps:
            self._steps[key] = tf.function(lambda batch: self._eval_step(*batch),
                                           jit_compile=False,
                                           input_signature=[dataset.element_spec])
        for batch in dataset:
            self._steps[key](batch)
        return global_metric_results(self.model, self.collectives, prefix)
