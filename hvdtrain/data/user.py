"""A user's data: ``--dataset package.module:fn`` or ``hvdtrain.fit(model, data)``.

The function (called with no arguments on every rank) returns one of:

* ``hvdtrain.Arrays`` (or ``(x, y)``, or a dict with the same keys): in-memory examples.
  Features may be a dict of arrays (several inputs); targets any shape and dtype, or a dict or
  list of arrays (several outputs); optional validation arrays and per-example weights. hvdtrain
  shards them with its exact global-batch plan, so N ranks x b computes what 1 x N*b does.
* ``hvdtrain.Pipeline``: factories that build one rank's ``tf.data.Dataset`` of batches
  ``(x, y)`` or ``(x, y, sample_weight)`` for one epoch from a ``hvdtrain.Shard`` (rank, size,
  epoch, seed, batch size). The factory must give each rank a disjoint part of the data (e.g.
  ``dataset.shard(shard.size, shard.rank)``), batch it by ``shard.batch_size`` and make the
  order a function of ``shard.seed`` and ``shard.epoch``. hvdtrain makes every rank run the same
  number of steps per epoch (``steps_per_epoch`` if given, else the most batches any rank's
  epoch-0 pipeline yields): a rank whose pipeline runs short is padded with zero-weight batches,
  one that runs long is cut there. Each step's loss is the mean over the real examples of the
  global batch (their count is summed across ranks in the step), so uneven batch sizes are
  weighted exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from hvdtrain.config import DataConfig
from hvdtrain.data.pipeline import ShardSpec
from hvdtrain.data.sources import (ArraySplit, DataBundle, DataError, checked_bundle, class_count,
                                   first_leaf, split_arrays, targets_array)
from hvdtrain.world import World


@dataclass(frozen=True)
class Arrays:
    """In-memory examples from a user's data function."""

    x: Any
    y: Any
    x_val: Any = None
    y_val: Any = None
    sample_weight: Any = None
    val_sample_weight: Any = None
    num_classes: int | None = None


@dataclass(frozen=True)
class Shard:
    """What a pipeline factory is told about the part of the data it must build."""

    rank: int
    size: int
    epoch: int
    seed: int
    batch_size: int


@dataclass(frozen=True)
class Pipeline:
    """Factories of one rank's batches per epoch, for training and (optionally) validation."""

    train: Callable[[Shard], tf.data.Dataset]
    val: Callable[[Shard], tf.data.Dataset] | None = None
    steps_per_epoch: int | None = None
    val_steps: int | None = None
    num_classes: int | None = None


def _numeric(values: Any, what: str) -> Any:
    """Arrays (or nests of them) as float32 features / checked targets."""
    def convert(array: Any) -> np.ndarray:
        array = np.asarray(array)
        if not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
            raise DataError(f"{what} must be numeric arrays, got {array.dtype}")
        return array
    return tf.nest.map_structure(convert, values)


def _features(x: Any) -> Any:
    return tf.nest.map_structure(
        lambda a: a.astype(np.float32) if np.issubdtype(a.dtype, np.floating) else a,
        _numeric(x, "features"))


def _targets(y: Any) -> Any:
    return tf.nest.map_structure(targets_array, _numeric(y, "targets"))


def _checked_lengths(x: Any, y: Any, weights: Any, what: str) -> None:
    lengths = {len(a) for a in tf.nest.flatten(x) + tf.nest.flatten(y)}
    if weights is not None:
        lengths.add(len(weights))
    if len(lengths) != 1:
        raise DataError(f"the {what} arrays have different numbers of examples "
                        f"({sorted(lengths)}); every array needs one row per example")
    if not lengths or lengths == {0}:
        raise DataError(f"the {what} arrays hold no examples")


def _as_arrays(value: Any) -> Arrays:
    if isinstance(value, Arrays):
        return value
    if isinstance(value, dict) and "x" in value and "y" in value:
        unknown = set(value) - set(Arrays.__dataclass_fields__)
        if unknown:
            raise DataError(f"the data function returned unknown key(s) "
                            f"{', '.join(sorted(unknown))}; use x, y, x_val, y_val, "
                            "sample_weight, val_sample_weight, num_classes")
        return Arrays(**value)
    if isinstance(value, tuple) and len(value) == 2:
        return Arrays(*value)
    raise DataError(f"the data function returned {type(value).__name__}; return "
                    "hvdtrain.Arrays(x=..., y=...), (x, y) or hvdtrain.Pipeline(train=...)")


def arrays_bundle(data: Arrays, config: DataConfig, seed: int) -> DataBundle:
    """Check and shard a user's arrays exactly like a built-in in-memory source."""
    x, y = _features(data.x), _targets(data.y)
    weights = None if data.sample_weight is None else np.asarray(data.sample_weight, np.float32)
    _checked_lengths(x, y, weights, "training")
    single_target = not isinstance(y, (dict, list, tuple))
    if data.x_val is None:
        classes = data.num_classes or (class_count(y) if single_target else None)
        return split_arrays(x, y, config.validation_split, seed, classes, weights)
    x_val, y_val = _features(data.x_val), _targets(data.y_val)
    val_weights = (None if data.val_sample_weight is None
                   else np.asarray(data.val_sample_weight, np.float32))
    _checked_lengths(x_val, y_val, val_weights, "validation")
    classes = data.num_classes or (class_count(y, y_val) if single_target else None)
    return DataBundle(ArraySplit(x, y, weights), ArraySplit(x_val, y_val, val_weights), classes)


def user_bundle(value: Any, config: DataConfig, seed: int) -> DataBundle:
    """The splits of whatever a user's data function returned."""
    if isinstance(value, Pipeline):
        val = None if value.val is None else PipelineSplit(value.val, value.val_steps)
        return DataBundle(PipelineSplit(value.train, value.steps_per_epoch), val,
                          value.num_classes)
    return checked_bundle(arrays_bundle(_as_arrays(value), config, seed), "the user's data")


def _with_weights(element: Any) -> tuple[Any, Any, tf.Tensor, tf.Tensor]:
    """A user batch ``(x, y)`` or ``(x, y, w)`` as ``(x, y, sample_weight, weight 1)``."""
    if not isinstance(element, tuple) or len(element) not in (2, 3):
        raise DataError("a pipeline must yield batches (x, y) or (x, y, sample_weight), got "
                        f"{type(element).__name__}")
    x, y = element[0], element[1]
    rows = tf.shape(first_leaf(x))[0]
    weights = (tf.cast(element[2], tf.float32) if len(element) == 3
               else tf.ones([rows], tf.float32))
    return x, y, weights, tf.ones([rows], tf.float32)


def _padding_batch(spec: Any) -> Any:
    """A one-row batch of zeros shaped like the pipeline's elements, with weight 0."""
    zeros = tf.nest.map_structure(
        lambda s: tf.zeros([1 if d is None else d for d in s.shape], s.dtype), spec)
    x, y, sample_weight, _ = zeros
    return x, y, sample_weight, tf.zeros_like(sample_weight)


@dataclass(frozen=True)
class PipelineSplit:
    """A user's per-rank ``tf.data`` factory, evened out to the same steps on every rank."""

    factory: Callable[[Shard], tf.data.Dataset]
    declared_steps: int | None
    normalised: bool = False

    @property
    def num_examples(self) -> None:
        return None

    def _epoch(self, spec: ShardSpec, epoch: int) -> tf.data.Dataset:
        shard = Shard(spec.world.rank, spec.world.size, int(epoch), spec.seed, spec.batch_size)
        dataset = self.factory(shard)
        if not isinstance(dataset, tf.data.Dataset):
            raise DataError(f"the pipeline factory returned {type(dataset).__name__}, not a "
                            "tf.data.Dataset")
        return dataset.map(lambda *element: _with_weights(element))

    @property
    def input_shape(self) -> Any:
        spec = self._epoch(ShardSpec(0, World(), 1), 0).element_spec[0]
        return tf.nest.map_structure(lambda s: tuple(s.shape[1:]), spec)

    def steps_per_epoch(self, spec: ShardSpec) -> int:
        """This rank's batches in epoch 0 (or the declared count); the run agrees on the most."""
        if self.declared_steps is not None:
            return self.declared_steps
        return int(self._epoch(spec, 0).reduce(np.int64(0), lambda count, _: count + 1))

    def dataset(self, spec: ShardSpec, first_epoch: int = 0,
                end_epoch: int = 1) -> tf.data.Dataset:
        steps = spec.steps_per_epoch
        epochs = []
        for epoch in range(first_epoch, end_epoch):
            batches = self._epoch(spec, epoch)
            padding = tf.data.Dataset.from_tensors(_padding_batch(batches.element_spec))
            epochs.append(batches.concatenate(padding.repeat()).take(steps))
        dataset = epochs[0]
        for more in epochs[1:]:
            dataset = dataset.concatenate(more)
        return dataset.prefetch(tf.data.AUTOTUNE)
