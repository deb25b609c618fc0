"""A user's ``tf.data.Dataset`` or ``keras.utils.PyDataset`` object, sharded by rank.

Elements are read as Keras reads them (``x``, ``(x,)``, ``(x, y)`` or ``(x, y,
sample_weight)``). How a rank takes its share:

* **Unbatched** (no batching op in the pipeline, e.g. ``from_tensor_slices(...)``): rank r
  keeps elements r, r+N, ... (``Dataset.shard``) and batches them by ``--batch-size``. Global
  step s is then exactly the s-th batch of N*b elements that one process would batch from the
  same order, so N ranks x b compute what 1 x N*b does.
* **Batched** (``.batch``, ``.padded_batch``, ``timeseries_dataset_from_array``,
  ``image_dataset_from_directory``, a ``PyDataset``): rank r keeps batches r, r+N, ...: its
  batches are per-rank batches, as given (``--batch-size`` does not apply). A ``PyDataset``'s
  batch order is shuffled every epoch (seeded) unless ``shuffle`` is off, as Keras does.

Every rank must run the same number of steps. hvdtrain's own step (which divides by the real
examples of the global batch, counted in the step) pads a rank that runs short with
zero-weight batches up to the most any rank has; a model's own ``train_step`` (a mean per rank,
exact only for equal batches) runs the fewest any rank has, in batches of one size. The counts
are each rank's for the first epoch (``cardinality``, or one pass when unknown). An infinite
dataset needs ``steps_per_epoch``; its epochs are consecutive stretches of one stream.

Each epoch is a new pass over the dataset, so a ``shuffle`` in it reshuffles as under Keras
``fit``; TensorFlow's global seed is the same on every rank, so an unseeded shuffle still makes
the same order everywhere and the shards stay disjoint. The order is the dataset's own: a
resumed run does not replay it (use arrays or ``hvdtrain.Pipeline`` for that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.data.pipeline import ShardSpec
from hvdtrain.errors import UserError
from hvdtrain.training.keras_internals import dataset_is_batched


class DatasetError(UserError):
    """A user's dataset object cannot be trained on as given."""


def keras_parts(element: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) of an element as Keras reads it; y and sample_weight may be None."""
    return keras.utils.unpack_x_y_sample_weight(element)


def four_tuple(element: Any) -> tuple[Any, Any, tf.Tensor, tf.Tensor]:
    """An element as the trainer's batches: (x, y or (), sample weights, loss weights 1)."""
    x, y, sample_weight = keras_parts(element)
    rows = tf.shape(tf.nest.flatten(x)[0])[0]
    weights = (tf.ones([rows], tf.float32) if sample_weight is None
               else tf.cast(tf.reshape(sample_weight, [rows]), tf.float32))
    return x, () if y is None else y, weights, tf.ones([rows], tf.float32)


def py_dataset_as_tf(source: keras.utils.PyDataset, spec: ShardSpec,
                     first_epoch: int = 0) -> tf.data.Dataset:
    """A ``PyDataset``'s batches as a ``tf.data.Dataset``: each pass (epoch) orders the batch
    indices (shuffled by (seed, epoch) when ``spec.shuffle``, as Keras shuffles a PyDataset's
    batches) and this rank takes every N-th; ``on_epoch_end`` is called after every pass, as
    Keras does."""
    first = source[0]
    signature = tf.nest.map_structure(
        lambda value: tf.TensorSpec((None, *np.shape(value)[1:]),
                                    tf.as_dtype(np.asarray(value).dtype)), first)
    passes = iter(range(first_epoch, 1 << 30))

    def batches():
        order = np.arange(len(source))
        if spec.shuffle:
            order = np.random.default_rng((spec.seed, next(passes))).permutation(order)
        for index in order[spec.world.rank::spec.world.size]:
            yield source[int(index)]
        source.on_epoch_end()

    return tf.data.Dataset.from_generator(batches, output_signature=signature)


@dataclass(frozen=True)
class DatasetSplit:
    """A user's dataset object (see the module doc). ``pad``: even the steps out with
    zero-weight batches (hvdtrain's step) rather than cut to the fewest (a model's own)."""

    source: Any          # tf.data.Dataset or keras.utils.PyDataset
    declared_steps: int | None = None
    class_weight: dict | None = None
    normalised: bool = False

    @property
    def batched(self) -> bool:
        return isinstance(self.source, keras.utils.PyDataset) or dataset_is_batched(self.source)

    @property
    def infinite(self) -> bool:
        return (isinstance(self.source, tf.data.Dataset)
                and int(self.source.cardinality()) == tf.data.INFINITE_CARDINALITY)

    @property
    def num_examples(self) -> None:
        return None

    def _element_spec(self) -> Any:
        return self._rank_batches(ShardSpec(0, _one_world(), 1)).element_spec

    @property
    def has_targets(self) -> bool:
        return keras_parts(self._element_spec())[1] is not None

    @property
    def has_sample_weights(self) -> bool:
        return keras_parts(self._element_spec())[2] is not None or bool(self.class_weight)

    @property
    def input_shape(self) -> Any:
        x = keras_parts(self._element_spec())[0]
        return tf.nest.map_structure(lambda spec: tuple(spec.shape[1:]), x)

    def _rank_batches(self, spec: ShardSpec, first_epoch: int = 0) -> tf.data.Dataset:
        """This rank's batches, as the user's elements (before weights and padding)."""
        size, rank = spec.world.size, spec.world.rank
        if isinstance(self.source, keras.utils.PyDataset):
            return py_dataset_as_tf(self.source, spec, first_epoch)
        if not isinstance(self.source, tf.data.Dataset):
            raise DatasetError(f"expected a tf.data.Dataset, got {type(self.source).__name__}")
        if self.batched:
            return self.source.shard(size, rank)
        exact_batches = spec.remainder == "drop" and spec.equal_steps
        return self.source.shard(size, rank).batch(spec.batch_size, drop_remainder=exact_batches)

    def steps_per_epoch(self, spec: ShardSpec) -> int:
        """This rank's batches in one pass (or the declared count); the run agrees on the most
        (padding) or the fewest (cutting) across ranks."""
        if self.declared_steps is not None:
            return self.declared_steps
        if self.infinite:
            raise DatasetError("the dataset repeats forever; give steps_per_epoch")
        batches = self._rank_batches(spec)
        known = int(batches.cardinality())
        if known >= 0:
            return known
        return int(batches.reduce(np.int64(0), lambda count, _: count + 1))

    def _weighted(self, batches: tf.data.Dataset) -> tf.data.Dataset:
        # tf.data hands a tuple element's parts as separate arguments.
        dataset = batches.map(lambda *parts: four_tuple(parts if len(parts) > 1 else parts[0]))
        if self.class_weight:
            table = class_weight_table(self.class_weight)
            dataset = dataset.map(lambda x, y, w, v: (x, y, w * tf.gather(table, class_ids(y)),
                                                      v))
        return dataset

    def dataset(self, spec: ShardSpec, first_epoch: int = 0,
                end_epoch: int = 1) -> tf.data.Dataset:
        batches = self._weighted(self._rank_batches(spec, first_epoch))
        if not spec.equal_steps:
            return batches.prefetch(tf.data.AUTOTUNE)
        steps = spec.steps_per_epoch
        if self.infinite:
            return batches.take((end_epoch - first_epoch) * steps).prefetch(tf.data.AUTOTUNE)
        padding = tf.data.Dataset.from_tensors(padding_batch(batches.element_spec)).repeat()
        one_epoch = batches.concatenate(padding).take(steps)
        epochs = one_epoch
        for _ in range(first_epoch + 1, end_epoch):
            epochs = epochs.concatenate(one_epoch)   # a new pass: a shuffle in it reshuffles
        return epochs.prefetch(tf.data.AUTOTUNE)


def _one_world() -> Any:
    from hvdtrain.world import World

    return World()


def padding_batch(spec: Any) -> Any:
    """A one-row batch of zeros shaped like the elements, with loss weight 0."""
    zeros = tf.nest.map_structure(
        lambda s: tf.zeros([1 if d is None else d for d in s.shape], s.dtype), spec)
    x, y, sample_weight, _ = zeros
    return x, y, sample_weight, tf.zeros_like(sample_weight)


def class_weight_table(class_weight: dict) -> tf.Tensor:
    """Keras' ``class_weight`` as a lookup table by class id (unlisted classes weigh 1)."""
    size = int(max(class_weight)) + 1
    table = np.ones(size, np.float32)
    for label, weight in class_weight.items():
        table[int(label)] = float(weight)
    return tf.constant(table)


def class_ids(y: Any) -> tf.Tensor:
    """Class ids of single-output targets, as Keras reads them for ``class_weight``: ids of
    shape (N,) or (N, 1), or one-hot rows (their argmax)."""
    if isinstance(y, (dict, list, tuple)):
        raise DatasetError("class_weight is for a model with one output; give sample weights "
                           "for several")
    y = tf.convert_to_tensor(y)
    if y.shape.rank == 2 and y.shape[-1] not in (None, 1):
        return tf.argmax(y, axis=-1)
    return tf.cast(tf.reshape(y, [-1]), tf.int64)
