"""Every use of Keras 3 internals in hvdtrain, in one place.

hvdtrain reproduces parts of Keras' own ``fit`` (its loss and metric bookkeeping, its rank
rules for targets) and needs a few facts Keras keeps in private attributes. Each such use is a
function here, so a Keras upgrade that moves one breaks this module alone, and
``tests/test_keras_internals.py`` fails loudly naming it. ``pyproject.toml`` pins Keras to the
tested range.
"""

from __future__ import annotations

from typing import Any, Sequence

import keras

TESTED_KERAS = ((3, 10), (3, 16))   # [lowest, highest) major.minor tested


def compile_arguments(model: keras.Model) -> dict[str, Any]:
    """What was passed to ``model.compile`` (Keras keeps it in the compile config; ``model.loss``
    alone would lose ``loss_weights`` and the metrics)."""
    return dict(getattr(getattr(model, "_compile_config", None), "config", {}) or {})


def compile_metrics(metrics: Any, weighted_metrics: Any,
                    output_names: Sequence[str] | None) -> keras.metrics.Metric:
    """A fresh copy of Keras' own container of compiled metrics (it resolves names such as
    "accuracy" per output exactly as ``compile`` does)."""
    from keras.src.trainers.compile_utils import CompileMetrics

    return CompileMetrics(metrics, weighted_metrics, output_names=output_names)


def flat_compiled_metrics(container: keras.metrics.Metric) -> list[keras.metrics.Metric]:
    """The metric objects a ``compile_metrics`` container holds (None where an output has
    none)."""
    return [metric for metric in getattr(container, "_flat_metrics", []) +
            getattr(container, "_flat_weighted_metrics", []) if metric is not None]


def sublayers(model: keras.Model) -> list[keras.layers.Layer]:
    """Every layer inside ``model``, nested models' layers included."""
    return list(model._flatten_layers(include_self=False))


def same_rank(y_true: Any, y_pred: Any) -> tuple[Any, Any]:
    """Targets and predictions as a Keras ``Loss`` sees them: a trailing axis of size 1 added
    or removed so the ranks match (labels of shape (N,) against an output of (N, 1))."""
    from keras.src.losses.loss import squeeze_or_expand_to_same_rank

    return squeeze_or_expand_to_same_rank(y_true, y_pred)


def optimizer_variables_built_for(optimizer: keras.optimizers.Optimizer) -> list[Any]:
    """The model variables a built optimizer updates, in its own order (its slot variables
    follow that order), so a checkpoint can build it again before restoring its state."""
    return list(optimizer._trainable_variables)


def set_initial_epoch(model: keras.Model, epoch: int | None) -> None:
    """The epoch ``fit`` starts at regardless of its ``initial_epoch`` argument: Keras'
    ``BackupAndRestore`` sets it; hvdtrain restores instead and clears it."""
    model._initial_epoch = epoch


def initial_epoch_of(model: keras.Model) -> int:
    """The epoch ``BackupAndRestore`` told ``fit`` to start at (0: none)."""
    return int(getattr(model, "_initial_epoch", None) or 0)


def keras_version() -> tuple[int, int]:
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int(minor)


# tf.data's dataset classes that batch their input (names of tf.data's private classes).
_BATCHING_DATASETS = ("_BatchDataset", "_PaddedBatchDataset", "_ParallelBatchDataset",
                      "_DenseToRaggedDataset", "_DenseToSparseBatchDataset",
                      "_MapAndBatchDataset", "_RebatchDataset", "_RaggedBatchDataset")


def dataset_is_batched(dataset: Any) -> bool:
    """Whether a ``tf.data`` pipeline batches its elements: a batching op between it and its
    source, with no ``unbatch`` after it (tf.data keeps each op's input in ``_input_dataset``;
    a zip or concatenation is followed through its first input)."""
    while dataset is not None:
        name = type(dataset).__name__
        if name == "_UnbatchDataset":
            return False
        if name in _BATCHING_DATASETS:
            return True
        inputs = getattr(dataset, "_datasets", None)
        dataset = getattr(dataset, "_input_dataset", None) or (
            tf_nest_first(inputs) if inputs else None)
    return False


def tf_nest_first(structure: Any) -> Any:
    import tensorflow as tf

    return tf.nest.flatten(structure)[0]
