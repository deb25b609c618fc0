"""The objective: Keras computes the loss and the metrics; this module says how each rank's
part of them adds up to one process's.

A compiled model's loss is Keras' own (``model.compute_loss``: its losses, their reductions,
``loss_weights``, ``add_loss`` and regularisers, a ``Loss`` that overrides ``__call__``, a loss
function returning one value per batch), and so are its metrics (``model.compute_metrics`` and
the loss tracker). Keras reduces a batch's loss to ``sum / divisor``; the global batch's loss is
the sum over ranks divided by the summed divisors, so each rank's loss is weighted by its
divisor (its ``LossShare``) before the gradients are summed across ranks, and the sum is divided
by the summed shares. Which divisor a loss has is measured once, by Keras' own code, before
training (``measured_share``): a loss whose batch value is not a divisor-weighted mean of its
parts' values couples the rows of a batch, which per-rank batches cannot compute exactly; the
run says so in one line. Metrics are exact because their state variables are summed across
ranks, so a metric whose state is not additive is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.collectives import Collectives, assign_across_ranks
from hvdtrain.config import OptimConfig
from hvdtrain.errors import UserError, first_sentence
from hvdtrain.log import logger
from hvdtrain.keras_internals import (build_symbolically, compile_arguments, keras_mask,
                                      loss_takes_unknown_rows, symbolic_outputs)

DEFAULT_LOSS = "sparse_categorical_crossentropy"
DEFAULT_METRICS = ("accuracy",)
# How close a batch's loss must be to the divisor-weighted mean of its halves' losses for the
# loss to count as one that does not couple rows (float32 arithmetic in different orders).
DECOMPOSES_RTOL = 1e-4


class ObjectiveError(UserError):
    """The model's loss or metrics cannot be used as compiled."""


@dataclass(frozen=True)
class LossShare:
    """What Keras' reduction of the model's loss divides a batch's sum by: ``rows`` (the
    default ``sum_over_batch_size``, and a loss function that returns a batch mean),
    ``sample_weight`` (``mean_with_sample_weight``: the batch's summed sample weights) or
    ``sum`` (reduction ``"sum"``: nothing, so the ranks' losses simply add). ``coupled``: the
    loss is none of these (it couples a batch's rows, e.g. a contrastive loss over the batch):
    then ``gathered``, every rank computes it on the global batch (``gathered_rows``), or, where
    that cannot be (``unexact``, the reason), ranks weight it by rows and the run says so."""

    divisor: str = "rows"
    coupled: bool = False
    unexact: str = ""
    # An output carries a Keras mask: Keras' mean then divides by the unmasked entries.
    masked: bool = False
    # The compiled loss, by name, for the run's line about it.
    named: str = "the compiled loss"

    def of(self, rows: tf.Tensor, sample_weight: Any, predictions: Any = None) -> tf.Tensor:
        """This rank's divisor for a batch of ``rows`` real rows (0: a filler batch) with
        these ``predictions`` (whose Keras mask a masked loss divides by)."""
        rows = tf.cast(rows, tf.float32)
        if self.divisor == "sum":
            return tf.minimum(rows, 1.0)
        if self.divisor == "gathered":
            return tf.constant(1.0)
        weights = (tf.cast(tf.nest.flatten(sample_weight)[0], tf.float32)
                   if self.divisor == "sample_weight" and sample_weight is not None else None)
        masks: Iterator[Any] = (map(keras_mask, tf.nest.flatten(predictions)) if self.masked
                                else iter(()))
        mask = next((each for each in masks if each is not None), None)
        if mask is not None:
            mask = tf.cast(mask, tf.float32)
            if weights is not None:
                mask *= tf.reshape(weights, [-1] + [1] * (len(mask.shape) - 1))
            return tf.reduce_sum(mask)
        return rows if weights is None else tf.reduce_sum(weights)

    @property
    def divides(self) -> bool:
        """Whether the summed gradients are divided by the summed shares (not for ``sum``, whose
        losses add, nor ``gathered``, whose ranks' gradients are parts of one)."""
        return self.divisor not in ("sum", "gathered")

    def weighted(self, loss: tf.Tensor, share: tf.Tensor, own: tf.Tensor,
                 world_size: int) -> tf.Tensor:
        """What this rank differentiates: its loss times its ``share`` (the summed gradients
        are divided by the summed shares). Where nothing divides (``sum``, ``gathered``) the
        model's ``own`` losses (regularisers, which Keras adds to every batch's loss) must
        count once in all: a 1/N part on each rank."""
        if self.divides:
            return loss * share
        return (loss - own) * share + own / world_size

    def column_factor(self, share: tf.Tensor, shares: tf.Tensor, world_size: int) -> tf.Tensor:
        """What this rank's per-output loss (Keras' ``<output>_loss`` column, a mean over
        batches of each batch's value) is multiplied by so that the ranks' mean is the global
        batch's value: the ranks times its part of the global loss, given the summed
        ``shares`` (a gathered loss is already the global batch's)."""
        if self.divisor == "gathered":
            return tf.constant(1.0)
        part = tf.math.divide_no_nan(share, shares) if self.divides else share
        return part * world_size

    def reported(self, loss: tf.Tensor, weighted: tf.Tensor, world_size: int) -> tf.Tensor:
        """What this rank adds to the step's global loss (summed across ranks, then divided by
        the summed shares where ``divides``): a gathered loss is every rank's alike."""
        return loss / world_size if self.divisor == "gathered" else weighted

    def on_ranks(self, world_size: int, unexact: str) -> "LossShare":
        """This share for a job of ``world_size`` ranks: a coupled loss gathered, unless
        ``unexact`` says why it cannot be (or an output's Keras mask, which the gather does
        not carry)."""
        if not self.coupled or world_size == 1:
            return self
        unexact = unexact or self.unexact
        if self.masked and not unexact:
            unexact = "an output carries a Keras mask, which the gather does not carry"
        return dataclasses.replace(self, divisor="rows" if unexact else "gathered",
                                   unexact=unexact)

    def describe(self) -> str:
        """The run log's line on how the ranks' losses combine."""
        coupled = (f"{self.named} couples the rows of a batch (its value on a batch is not a "
                   "weighted mean of its values on the batch's parts, e.g. a contrastive loss)")
        if self.divisor == "gathered":
            return (f"loss: {coupled}: every rank computes it on the global batch, the ranks' "
                    "predictions, targets and sample weights gathered in each step (the "
                    "predictions differentiably)")
        if self.coupled:
            return (f"note: {coupled}; {self.unexact}, so each rank computes it over its own "
                    "rows: training is close to, but not exactly, one process with the global "
                    "batch")
        what = {"rows": "its rows", "sample_weight": "its summed sample weights",
                "sum": "nothing (reduction 'sum': the ranks' losses add)"}[self.divisor]
        return (f"loss: Keras' own compute_loss on each rank, weighted by what its reduction "
                f"divides by ({what}), so the ranks' gradients sum to one process's")


def unexact_reason(optim: OptimConfig, xla: bool) -> str:
    """Why a loss that couples a batch's rows cannot be computed on the global batch in this
    run ("" where it can)."""
    if xla:
        return "the model's jit_compile has XLA compile the loss, which cannot hold the gather"
    if optim.accumulation_steps > 1:
        return "--accumulation-steps spreads the global batch over micro-steps"
    if optim.reduction == "adasum":
        return "--reduction adasum combines each rank's own gradient"
    return ""


def agreed_share(share: LossShare, collectives: Collectives, optim: OptimConfig,
                 xla: bool, elastic: bool = False) -> LossShare:
    """The share every rank trains with: each rank measured its own first batch, and ranks
    must agree (a gathered loss holds a collective every step), so a loss coupled on any rank
    is coupled on all, else rank 0's is taken; rank 0 says how the losses combine. An
    elastic job's ranks each keep their own (its data is hvdtrain's plan, alike on every
    rank), as a rank joining it mid-run can meet no collective here."""
    world = collectives.world
    if world.size > 1 and not elastic:   # a rank joining an elastic job meets no collective
        measured = collectives.allgather_object(share)
        share = next((each for each in measured if each.coupled), measured[0])
    share = share.on_ranks(world.size, unexact_reason(optim, xla))
    if world.size > 1 and world.is_chief:   # one line, not one per rank
        (logger.warning if share.unexact else logger.info)(share.describe())
    return share


def own_losses(model: keras.Model) -> tf.Tensor:
    """The model's own losses that Keras' ``compute_loss`` adds to the compiled loss (weight
    and activity regularisers, ``add_loss``) of the last forward pass, summed as float32."""
    if not model.losses:
        return tf.constant(0.0)
    return tf.add_n([tf.reduce_sum(tf.cast(loss, tf.float32)) for loss in model.losses])


def _close(value: float, expected: float) -> bool:
    return bool(np.isclose(value, expected, rtol=DECOMPOSES_RTOL,
                           atol=DECOMPOSES_RTOL * 1e-2 * max(1.0, abs(expected))))


def _synthetic_predictions(specs: Any, rows: int) -> Any:
    """Predictions of ``rows`` rows shaped and typed like the outputs' ``specs`` (Keras'
    symbolic pass: no call of the model on real rows), in (0.05, 0.95) and fixed."""
    leaves = tf.nest.flatten(specs)
    return tf.nest.pack_sequence_as(specs, [
        tf.cast(tf.random.stateless_uniform([rows, *spec.shape[1:]], seed=[17, index],
                                            minval=0.05, maxval=0.95), spec.dtype)
        for index, spec in enumerate(leaves, start=1)])


def _loss_value(model: keras.Model, y: Any, y_pred: Any, sample_weight: Any) -> float:
    return float(model.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight,
                                    training=False))


def _rows(values: Any, start: int, stop: int) -> Any:
    return tf.nest.map_structure(lambda value: value[start:stop], values)


def loss_names(model: keras.Model) -> str:
    """The compiled loss in words for a log line: its class or function name(s)."""
    def name(loss: Any) -> str:
        return loss if isinstance(loss, str) else getattr(loss, "__name__", type(loss).__name__)

    loss = compile_arguments(model).get("loss")
    losses = [each for each in tf.nest.flatten(loss) if each is not None]
    return ("the compiled loss " + ", ".join(name(each) for each in losses)) if losses else (
        "the compiled loss")


def measured_share(model: keras.Model, batch: tuple) -> LossShare:
    """The model's ``LossShare``, measured with Keras' own ``compute_loss`` on a real batch's
    targets and predictions of the outputs' shapes, whole and in two parts: a loss equal to
    its parts' mean weighted by rows divides by rows, unless with uneven sample weights it is
    their mean weighted by summed sample weights (then it divides by those); one equal to its
    parts' sum is a ``sum``; any other couples rows. Nothing a program sees is called (not the
    model, no metric kept)."""
    x, y = batch[0], batch[1]
    rows = int(tf.shape(tf.nest.flatten(x)[0])[0])
    (specs, masked), named = symbolic_outputs(model, x), loss_names(model)
    if rows < 2:
        return LossShare(masked=masked, named=named)
    predictions = _synthetic_predictions(specs, rows)
    # Keras adds the model's own losses (regularisers) to every batch's loss: left out here.
    own = float(own_losses(model))
    half = rows // 2
    cuts = ((0, half), (half, rows))

    def values(weights: tf.Tensor | None) -> tuple[float, list[float]]:
        whole = _loss_value(model, y, predictions, weights) - own
        return whole, [_loss_value(model, _rows(y, lo, hi), _rows(predictions, lo, hi),
                                   None if weights is None else weights[lo:hi]) - own
                       for lo, hi in cuts]

    def mean_of(parts: list[float], sizes: list[float]) -> float:
        return (sizes[0] * parts[0] + sizes[1] * parts[1]) / sum(sizes)

    whole, parts = values(None)
    uneven = tf.constant(np.linspace(0.5, 1.5, rows), tf.float32)
    try:
        weighted_whole, weighted_parts = values(uneven)
    except (ValueError, tf.errors.InvalidArgumentError):   # no weight per row (per token)
        weighted_whole, weighted_parts = whole, parts
    model.reset_metrics()      # the compiled loss's per-output trackers counted the probes
    if _close(whole, mean_of(parts, [half, rows - half])):
        summed = [float(tf.reduce_sum(uneven[lo:hi])) for lo, hi in cuts]
        by_weights = _close(weighted_whole, mean_of(weighted_parts, summed))
        by_rows = _close(weighted_whole, mean_of(weighted_parts, [half, rows - half]))
        return LossShare("sample_weight" if by_weights and not by_rows else "rows",
                         masked=masked, named=named)
    if _close(whole, parts[0] + parts[1]):
        return LossShare("sum", named=named)
    unexact = ("" if loss_takes_unknown_rows(model, y, predictions) else
               "it needs the batch's row count when traced (it squeezes or reshapes by it), "
               "which a batch gathered from the ranks leaves unknown")
    return LossShare("rows", coupled=True, unexact=unexact, masked=masked, named=named)


def build_for_training(model: keras.Model, batch: tuple, label: str,
                       sample_weights: bool = True) -> LossShare:
    """Before training: Keras' own symbolic build of the model, its compiled loss and metrics
    (what ``fit`` does first; no call on real rows), a one-line refusal when the model cannot
    take the data, then the loss's ``LossShare`` and a check that every metric can be summed.
    ``sample_weights``: the batch's weights are the user's (else Keras sees none)."""
    features, targets = batch[0], batch[1]
    sample_weight = batch[2] if sample_weights else None
    try:
        build_symbolically(model, features, targets, sample_weight)
        share = measured_share(model, batch)
    except (ValueError, TypeError, tf.errors.InvalidArgumentError) as error:
        raise UserError(f"model '{label}' cannot be trained on this data: "
                        f"{first_sentence(str(error))}; check that "
                        "the model's inputs and outputs match the features and targets") \
            from error
    check_additive(model.metrics)
    return share


def leaf_metrics(metrics: Sequence[keras.metrics.Metric]) -> list[keras.metrics.Metric]:
    """Every metric that holds state itself (Keras groups an output's metrics in lists)."""
    def leaves(metric: keras.metrics.Metric) -> list[keras.metrics.Metric]:
        inner = getattr(metric, "metrics", None)
        if isinstance(inner, (list, tuple)) and inner and inner[0] is not metric:
            return [leaf for child in inner for leaf in leaves(child)]
        return [metric]

    return [leaf for metric in metrics for leaf in leaves(metric)]


def check_additive(metrics: Sequence[keras.metrics.Metric]) -> None:
    """Refuse a metric whose state cannot be summed across ranks for an exact global value."""
    for metric in leaf_metrics(metrics):
        for variable in metric.variables:
            aggregation = getattr(variable, "aggregation", "sum")
            if aggregation not in ("sum", "none"):
                raise ObjectiveError(
                    f"metric '{metric.name}' keeps state '{variable.name}' with aggregation "
                    f"'{aggregation}', which cannot be summed across ranks for an exact global "
                    "value; use a metric whose state is additive")


def metric_variables(model: keras.Model) -> list[Any]:
    """The state of every metric the model tracks, each variable once."""
    seen: dict[int, Any] = {}
    for metric in model.metrics:
        for variable in metric.variables:
            seen.setdefault(id(variable), variable)
    return list(seen.values())


def scalar(value: Any) -> bool:
    """Whether a log value is one number (a tensor, a Keras or TensorFlow variable, a float)."""
    return (isinstance(value, (float, int, np.number))
            or (hasattr(value, "shape") and tuple(value.shape) == ()))


def global_metric_results(model: keras.Model, collectives: Collectives,
                          prefix: str = "") -> dict[str, float]:
    """Sum every metric's state across ranks, then read each metric by name, in Keras' order:
    exact global values, equal on every rank."""
    check_additive(model.metrics)
    assign_across_ranks(collectives, metric_variables(model))
    return {prefix + name: float(value) for name, value in model.get_metrics_result().items()
            if scalar(value)}


def real_rows(weights: tf.Tensor) -> tf.Tensor:
    """A batch's real rows: those with a loss weight (the data plan puts them first; a filler
    batch, repeated at weight zero so every rank runs the step, has none)."""
    return tf.reduce_sum(tf.cast(weights > 0, tf.int32))
