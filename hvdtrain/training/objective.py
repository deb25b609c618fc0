"""The objective: what a run optimises and reports, and how both reduce across ranks.

It comes from the user's model: its compiled loss and metrics, or for an uncompiled model
hvdtrain's default (sparse categorical cross-entropy on probabilities, accuracy). The loss is
evaluated per example, unreduced, so the step can weight each example for the global-batch mean.
Metrics are reduced by summing their state variables across ranks, which gives exactly what one
process would compute (a mean of per-rank results would not), so a metric whose state is not
declared additive is refused. ``check_output_kind`` catches probabilities fed to a loss
expecting logits, and the reverse, before the first step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.collectives import Collectives, assign_across_ranks
from hvdtrain.errors import UserError, first_sentence
from hvdtrain.keras_internals import (compile_arguments, compile_metrics, flat_compiled_metrics,
                                      same_rank)

DEFAULT_LOSS = "sparse_categorical_crossentropy"
DEFAULT_METRICS = ("accuracy",)
# Losses whose predictions are probabilities unless from_logits=True, and what a probability
# output looks like for each: a distribution over the last axis, or independent values in [0, 1].
DISTRIBUTION_LOSSES = ("categorical_crossentropy", "sparse_categorical_crossentropy",
                       "categorical_focal_crossentropy", "kl_divergence")
INDEPENDENT_PROBABILITY_LOSSES = ("binary_crossentropy", "binary_focal_crossentropy")


class ObjectiveError(UserError):
    """The model's loss or metrics cannot be used as compiled."""


@dataclass(frozen=True)
class CompiledObjective:
    """What the user passed to ``model.compile`` (or hvdtrain's default for a bare model)."""

    loss: Any = DEFAULT_LOSS
    loss_weights: Any = None
    metrics: Any = DEFAULT_METRICS
    weighted_metrics: Any = None
    optimizer: Any = None
    compiled: bool = False


def compiled_objective(model: keras.Model) -> CompiledObjective:
    """The loss, metrics and optimizer a model was compiled with, or the default."""
    arguments = compile_arguments(model)
    if not getattr(model, "compiled", False) or arguments.get("loss") is None:
        return CompiledObjective()
    return CompiledObjective(loss=arguments["loss"],
                             loss_weights=arguments.get("loss_weights"),
                             metrics=arguments.get("metrics"),
                             weighted_metrics=arguments.get("weighted_metrics"),
                             optimizer=arguments.get("optimizer"), compiled=True)


def output_names(model: keras.Model) -> list[str]:
    """The model's output names, in the order Keras gives its outputs."""
    names = list(getattr(model, "output_names", None) or [])
    return names or ["output_0"]


def flatten_outputs(values: Any, names: Sequence[str], what: str) -> list[Any]:
    """Predictions or targets as a list in the model's output order."""
    if isinstance(values, dict):
        missing = [name for name in names if name not in values]
        if missing:
            raise ObjectiveError(f"{what} has no entry for output(s) {', '.join(missing)} "
                                 f"(it has {', '.join(map(str, values))}); key them by the "
                                 "model's output names")
        return [values[name] for name in names]
    if isinstance(values, (list, tuple)):
        if len(values) != len(names):
            raise ObjectiveError(f"{what} has {len(values)} entries for {len(names)} model "
                                 "output(s); give one per output")
        return list(values)
    if len(names) != 1:
        raise ObjectiveError(f"the model has {len(names)} outputs but {what} is one array; "
                             "give a list or a dict keyed by output name")
    return [values]


def _per_output(setting: Any, names: Sequence[str], what: str) -> list[Any]:
    """A compile argument (one value, a list or a dict keyed by output) per output."""
    if isinstance(setting, dict):
        unknown = [key for key in setting if key not in names]
        if unknown:
            raise ObjectiveError(f"compile({what}=...) names unknown output(s) "
                                 f"{', '.join(map(str, unknown))}; the outputs are "
                                 f"{', '.join(names)}")
        return [setting.get(name) for name in names]
    if isinstance(setting, (list, tuple)) and len(names) > 1:
        if len(setting) != len(names):
            raise ObjectiveError(f"compile({what}=...) has {len(setting)} entries for "
                                 f"{len(names)} outputs; give one per output")
        return list(setting)
    return [setting] * len(names)


def _loss_object(loss: Any) -> keras.losses.Loss | None:
    if loss is None:
        return None
    try:
        resolved = keras.losses.get(loss)
    except (ValueError, TypeError) as error:
        raise ObjectiveError(f"unknown loss {loss!r} ({error}); give a Keras loss name or "
                             "object") from error
    if isinstance(resolved, keras.losses.Loss):
        return resolved
    return FunctionLoss(resolved)


class FunctionLoss(keras.losses.Loss):
    """A loss given as a plain function ``(y_true, y_pred) -> per-example values`` (a Keras
    loss name resolves to one), called like a Keras ``Loss`` object."""

    def __init__(self, fn: Any) -> None:
        super().__init__(name=getattr(fn, "__name__", "loss"))
        self.fn = fn

    def call(self, y_true: Any, y_pred: Any) -> Any:
        return self.fn(y_true, y_pred)


def loss_kind(loss: keras.losses.Loss) -> tuple[str, bool]:
    """(canonical function name, from_logits) of a Keras loss, as far as it tells."""
    config = loss.get_config() if hasattr(loss, "get_config") else {}
    function = getattr(loss, "fn", None)
    name = getattr(function, "__name__", None) or config.get("name") or type(loss).__name__
    return str(name), bool(config.get("from_logits", False))


def per_example(values: tf.Tensor) -> tf.Tensor:
    """Average a loss over every axis after the first: one value per example, float32."""
    values = tf.cast(values, tf.float32)
    if values.shape.rank is not None and values.shape.rank > 1:
        values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
    return values


@dataclass
class Objective:
    """Per-example loss and fresh metric state for one model's outputs."""

    names: list[str]
    losses: list[keras.losses.Loss | None]
    loss_weights: list[float]
    compiled: CompiledObjective = field(default_factory=CompiledObjective)

    @classmethod
    def for_model(cls, model: keras.Model) -> "Objective":
        compiled = compiled_objective(model)
        names = output_names(model)
        losses = [_loss_object(loss) for loss in _per_output(compiled.loss, names, "loss")]
        if all(loss is None for loss in losses):
            raise ObjectiveError("compile(loss=...) gives no loss for any output; name one")
        weights = _per_output(compiled.loss_weights, names, "loss_weights")
        return cls(names, losses, [1.0 if w is None else float(w) for w in weights], compiled)

    @property
    def output_loss_names(self) -> list[str]:
        """The per-output loss columns Keras reports: one per output with a loss, when two or
        more outputs have one (Keras' ``CompileLoss.build``)."""
        named = [f"{name}_loss" for name, loss in zip(self.names, self.losses) if loss]
        return named if len(named) > 1 else []

    def per_example_losses(self, y_true: Any, y_pred: Any) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """(weighted sum over outputs, each output's own), one float32 value per example."""
        targets = flatten_outputs(y_true, self.names, "the targets")
        predictions = flatten_outputs(y_pred, self.names, "the model's output")
        total, parts = None, []
        for loss, weight, target, prediction in zip(self.losses, self.loss_weights, targets,
                                                    predictions):
            if loss is None:
                continue
            prediction = tf.cast(prediction, tf.float32)
            target = tf.convert_to_tensor(target)
            target = tf.cast(target, tf.float32) if target.dtype.is_floating else target
            target, prediction = same_rank(target, prediction)
            value = per_example(loss.call(target, prediction))
            parts.append(value)
            total = weight * value if total is None else total + weight * value
        return total, parts

    def new_metrics(self, prefix: str = "") -> "MetricState":
        return MetricState(self, prefix)


@dataclass
class BatchShares:
    """A rank's part of its global batch: ``rows``, each row's share of it (0 for filler), and
    ``batch``, the rank's share of one batch. Keras 3 reports each output's loss as the mean of
    its batches' means, so a rank adds its part of the global batch's mean with weight
    ``batch``, and the sums across ranks are one process's."""

    rows: tf.Tensor
    batch: float


class MetricState:
    """One set of metrics (training or validation): Keras metric objects whose state variables
    are summed across ranks to give exact global results."""

    def __init__(self, objective: Objective, prefix: str) -> None:
        self.objective = objective
        self.prefix = prefix
        self.loss = keras.metrics.Mean(name="loss")
        self.output_losses = [keras.metrics.Mean(name=name)
                              for name in objective.output_loss_names]
        compiled = objective.compiled
        self.compiled_metrics = None
        if compiled.metrics or compiled.weighted_metrics:
            names = objective.names if len(objective.names) > 1 else None
            self.compiled_metrics = compile_metrics(compiled.metrics, compiled.weighted_metrics,
                                                    names)

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        extra = [self.compiled_metrics] if self.compiled_metrics is not None else []
        return [self.loss, *self.output_losses, *extra]

    @property
    def variables(self) -> list[Any]:
        return [v for metric in self.metrics for v in metric.variables]

    def build(self, y_true: Any, y_pred: Any) -> None:
        """Create the compiled metrics' state (it depends on the outputs' shapes), then refuse
        any metric whose state cannot be summed across ranks."""
        if self.compiled_metrics is not None and not self.compiled_metrics.built:
            self.compiled_metrics.build(y_true, y_pred)
        found = [self.loss, *self.output_losses]
        if self.compiled_metrics is not None:
            found += flat_compiled_metrics(self.compiled_metrics)
        check_additive(found)

    def reset(self) -> None:
        for metric in self.metrics:
            metric.reset_state()

    def update(self, y_true: Any, y_pred: Any, total: tf.Tensor, parts: list[tf.Tensor],
               sample_weight: tf.Tensor, valid: tf.Tensor,
               own_losses: tf.Tensor | float = 0.0,
               batch_shares: BatchShares | None = None) -> None:
        """Add a batch; padding rows (``valid`` false) are left out of every metric. Losses are
        reported as Keras does: the sample-weighted sum over the examples' count, plus the
        model's own losses of the batch (``own_losses``: ``add_loss``, regularisers). The
        per-output loss columns (a model with two or more losses) are Keras' means of batch
        means given ``batch_shares`` (see ``BatchShares``), else means over examples."""
        def real(values: Any) -> Any:
            return tf.nest.map_structure(lambda v: tf.boolean_mask(v, valid), values)

        weight = real(sample_weight)
        self.loss.update_state(real(total) * weight + own_losses)
        for metric, part in zip(self.output_losses, parts):
            if batch_shares is None:   # the mean over examples
                metric.update_state(real(part) * weight)
                continue
            # this rank's part of the global batch's mean, and its part of one batch
            metric.update_state(tf.reduce_sum(part * sample_weight * batch_shares.rows)
                                / batch_shares.batch, sample_weight=batch_shares.batch)
        if self.compiled_metrics is not None:
            predictions = tf.nest.map_structure(lambda v: tf.cast(v, tf.float32), y_pred)
            self.compiled_metrics.update_state(real(y_true), real(predictions), weight)

    def local_results(self) -> dict[str, tf.Tensor]:
        """This rank's running values (for the progress bar; the epoch's logs are global)."""
        results = {self.prefix + m.name: m.result() for m in [self.loss, *self.output_losses]}
        if self.compiled_metrics is not None:
            results.update({self.prefix + name: value
                            for name, value in self.compiled_metrics.result().items()})
        return results

    def global_results(self, collectives: Collectives) -> dict[str, float]:
        """Sum every state variable across ranks, then read the metrics: exact global values,
        equal on every rank."""
        assign_across_ranks(collectives, self.variables)
        return {name: float(value) for name, value in self.local_results().items()}


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
            if aggregation != "sum":
                raise ObjectiveError(
                    f"metric '{metric.name}' keeps state '{variable.name}' with aggregation "
                    f"'{aggregation}', which cannot be summed across ranks for an exact global "
                    "value; use a metric whose state is additive")


def _probe_values(prediction: Any) -> np.ndarray:
    return np.asarray(tf.cast(prediction, tf.float32))


def check_output_kind(objective: Objective, y_pred: Any) -> None:
    """Stop before training when an output does not fit what its loss expects: logits under a
    loss that wants probabilities, or probabilities under ``from_logits=True``."""
    predictions = flatten_outputs(y_pred, objective.names, "the model's output")
    for name, loss, prediction in zip(objective.names, objective.losses, predictions):
        if loss is None:
            continue
        kind, from_logits = loss_kind(loss)
        values = _probe_values(prediction)
        where = f"output '{name}'" if len(objective.names) > 1 else "the model's output"
        in_unit = bool(np.all((values >= 0) & (values <= 1)))
        if kind in DISTRIBUTION_LOSSES:
            sums_to_one = bool(np.allclose(values.sum(axis=-1), 1.0, atol=1e-3))
            is_distribution = in_unit and sums_to_one and values.shape[-1] > 1
            if not from_logits and not is_distribution:
                raise ObjectiveError(
                    f"{where} is not a probability distribution (values "
                    f"{values.min():.3g}..{values.max():.3g}) but loss {kind} expects one; "
                    f"compile with keras.losses.{_class_name(kind)}(from_logits=True) or end "
                    "the model with a softmax")
            if from_logits and is_distribution:
                raise ObjectiveError(
                    f"{where} is already a probability distribution (rows sum to 1) but loss "
                    f"{kind} has from_logits=True; drop from_logits or the final softmax")
        elif kind in INDEPENDENT_PROBABILITY_LOSSES:
            if not from_logits and not in_unit:
                raise ObjectiveError(
                    f"{where} has values outside [0, 1] ({values.min():.3g}..{values.max():.3g})"
                    f" but loss {kind} expects probabilities; compile with "
                    f"keras.losses.{_class_name(kind)}(from_logits=True) or end the model with "
                    "a sigmoid")
            if from_logits and in_unit and values.size >= 16:
                raise ObjectiveError(
                    f"{where} lies entirely in [0, 1], as probabilities do, but loss {kind} has "
                    "from_logits=True; drop from_logits or the final sigmoid")


def _class_name(function_name: str) -> str:
    return "".join(part.capitalize() for part in function_name.split("_"))


def probe(model: keras.Model, objective: Objective, batch: tuple,
          metric_states: Sequence[MetricState], label: str) -> None:
    """One forward pass on a real batch before training: the metrics' state is created from
    the outputs' shapes, the loss is tried once, and outputs that do not fit their loss (logits
    under a loss that wants probabilities, or the reverse) stop the run with one line."""
    features, targets = batch[0], batch[1]
    try:
        predictions = model(features, training=False)
        objective.per_example_losses(targets, predictions)
    except (ValueError, TypeError, tf.errors.InvalidArgumentError) as error:
        raise UserError(f"model '{label}' cannot be trained on this data: "
                        f"{first_sentence(str(error))}; check that "
                        "the model's inputs and outputs match the features and targets") \
            from error
    check_output_kind(objective, predictions)
    for metrics in metric_states:
        metrics.build(targets, predictions)
