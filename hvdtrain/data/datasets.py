"""A user's ``tf.data.Dataset`` or ``keras.utils.PyDataset`` object, sharded by rank.

Unbatched, rank r keeps elements r, r+N, ... and batches them by ``--batch-size``, so N ranks x b
compute what 1 x N*b does; batched (or a ``PyDataset``), it keeps batches r, r+N, ... as given.
Every rank runs the same number of steps per pass (``data.equal_steps``), and a dataset whose
order differs across ranks is refused (``data.order``), since sharding by position needs the
same order everywhere. A shuffled ``PyDataset``'s order is hvdtrain's own (by seed and pass, so a
resume replays it); ``PythonShuffleDraws`` makes the draw Keras would make for it from Python's
generator, so a user's code sees that generator where one process leaves it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.data.equal_steps import Passes, count_batches, equal_passes, first_element
from hvdtrain.data.order import check_same_order
from hvdtrain.data.pipeline import ShardSpec
from hvdtrain.errors import UserError
from hvdtrain.keras_internals import dataset_is_batched


class DatasetError(UserError):
    """A user's dataset object cannot be trained on as given."""


def keras_parts(element: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) of an element as Keras reads it; y and sample_weight may be None."""
    return keras.utils.unpack_x_y_sample_weight(element)


def four_tuple(element: Any) -> tuple[Any, Any, tf.Tensor, tf.Tensor]:
    """An element as the trainer's batches: (x, y or (), sample weights, loss weights 1).
    Sample weights: one per example, or (as Keras takes them) one such vector per output."""
    x, y, sample_weight = keras_parts(element)
    rows = tf.shape(tf.nest.flatten(x)[0])[0]
    weights = (tf.ones([rows], tf.float32) if sample_weight is None
               else tf.nest.map_structure(lambda w: tf.cast(tf.reshape(w, [rows]), tf.float32),
                                          sample_weight))
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


class PythonShuffleDraws(keras.callbacks.Callback):
    """Keras' ``fit`` shuffles a ``PyDataset``'s batch indices with Python's ``random.shuffle``
    when a pass begins (on its first step: after that step's ``on_train_batch_begin``, before
    its ``on_train_batch_end``). hvdtrain orders the batches with a generator of its own, so it
    makes that draw here, on every rank at that point and over one process's batch count (the
    steps of a pass: one process's batches of the global batch), and throws the list away:
    Python's generator is where one process's is for every callback after it (it goes before
    the user's callbacks)."""

    def __init__(self, passes: Passes) -> None:
        super().__init__()
        self.passes = passes
        self.offset = 0          # steps of the current pass before this epoch's first

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.offset = self.passes.start(epoch)[1]

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.offset + batch == 0:         # an epoch never runs across a pass's end
            random.shuffle(list(range(self.passes.pass_steps)))


def python_draws(split: Any, spec: ShardSpec, passes: Passes) -> list[keras.callbacks.Callback]:
    """The callbacks that draw from Python's generator what Keras' ``fit`` would for this
    training split (a shuffled ``PyDataset``; nothing for any other data)."""
    if (isinstance(split, DatasetSplit) and isinstance(split.source, keras.utils.PyDataset)
            and spec.shuffle and passes.pass_steps is not None):
        return [PythonShuffleDraws(passes)]
    return []


@dataclass(frozen=True)
class DatasetSplit:
    """A user's dataset object (see the module doc). ``declared_steps``: the batches of one
    pass when the user says so (Keras' ``validation_steps``), else counted."""

    source: Any          # tf.data.Dataset or keras.utils.PyDataset
    declared_steps: int | None = None
    class_weight: dict | None = None
    normalised: bool = False
    # What was read so far (each read is an iteration of the user's dataset): templates by
    # batch size, examples per pass by (rank, size).
    _templates: dict = field(default_factory=dict, compare=False, repr=False)
    _rows: dict = field(default_factory=dict, compare=False, repr=False)
    # Whether the dataset's options said deterministic=False (read in order here instead).
    reordered: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        """A dataset whose options let tf.data order elements by timing (Keras' TFRecord
        example sets ``deterministic = False``) is read in order: every rank must read one
        order for its shards to be disjoint (said in the run log, ``order_note``)."""
        if isinstance(self.source, tf.data.Dataset) and self.source.options().deterministic \
                is False:
            options = tf.data.Options()
            options.deterministic = True
            object.__setattr__(self, "source", self.source.with_options(options))
            object.__setattr__(self, "reordered", True)

    def order_note(self, what: str) -> str | None:
        """Rank 0's line when the dataset is read in an order its options did not ask for."""
        if not self.reordered:
            return None
        return (f"{what} dataset: its options say deterministic=False; hvdtrain reads it in "
                "order (deterministic=True), since every rank must read one order to shard it")

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
        """This rank's batches, as the user's elements (before weights and evening out)."""
        size, rank = spec.world.size, spec.world.rank
        if isinstance(self.source, keras.utils.PyDataset):
            return py_dataset_as_tf(self.source, spec, first_epoch)
        if not isinstance(self.source, tf.data.Dataset):
            raise DatasetError(f"expected a tf.data.Dataset, got {type(self.source).__name__}")
        if self.batched:
            return self.source.shard(size, rank)
        exact_batches = spec.remainder == "drop" and spec.equal_steps
        return self.source.shard(size, rank).batch(spec.batch_size, drop_remainder=exact_batches)

    def rows_per_pass(self, spec: ShardSpec) -> int | None:
        """This rank's examples in one pass of an unbatched dataset (its cardinality, or one
        pass when unknown), None for a batched one."""
        if self.batched or self.infinite:
            return None
        key = (spec.world.rank, spec.world.size)
        if key not in self._rows:
            self._rows[key] = count_batches(self.source.shard(spec.world.size, spec.world.rank))
        return self._rows[key]

    def steps_per_epoch(self, spec: ShardSpec) -> int:
        """This rank's batches in one pass (or the declared count); the run agrees on the most
        (filling) or the fewest (cutting) across ranks."""
        if self.declared_steps is not None:
            return self.declared_steps
        if self.infinite:
            raise DatasetError("the dataset repeats forever; give steps_per_epoch (training) "
                               "or validation_steps (validation)")
        if isinstance(self.source, keras.utils.PyDataset):    # its batches r, r+N, ...
            return len(range(spec.world.rank, len(self.source), spec.world.size))
        rows = self.rows_per_pass(spec)
        if rows is not None:
            whole = spec.remainder == "drop" and spec.equal_steps
            return rows // spec.batch_size if whole else -(-rows // spec.batch_size)
        return count_batches(self._rank_batches(spec))

    def check_order(self, what: str, allgather_object: Callable[[Any], list]) -> None:
        """Refuse a ``tf.data`` dataset whose order differs across ranks
        (``hvdtrain.data.order``); a ``PyDataset``'s order is hvdtrain's own."""
        if isinstance(self.source, tf.data.Dataset):
            check_same_order(self.source, self.batched, keras_parts, what, allgather_object)

    def template(self, spec: ShardSpec) -> tuple | None:
        """The data's first batch (rank 0's first), weighted: what fills a short rank at loss
        weight zero, the same on every rank (None: the dataset is empty)."""
        if spec.batch_size in self._templates:
            return self._templates[spec.batch_size]
        if isinstance(self.source, keras.utils.PyDataset):   # as py_dataset_as_tf types it
            first = tf.nest.map_structure(lambda v: tf.constant(np.asarray(v)), self.source[0])
            whole = tf.data.Dataset.from_tensors(first)
        else:
            whole = self.source if self.batched else self.source.batch(spec.batch_size)
        template = self._templates[spec.batch_size] = first_element(self._weighted(whole))
        return template

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
        """This rank's batches of passes ``[first_epoch, end_epoch)``, evened out (an infinite
        dataset: its endless stream; with ``spec.equal_steps`` false: one pass, as it is)."""
        batches = self._weighted(self._rank_batches(spec, first_epoch))
        if self.declared_steps is not None and (self.infinite or not spec.equal_steps):
            # Keras' validation_steps on data that repeats, or on one rank's unpadded share.
            batches = batches.take(self.declared_steps)
        if not spec.equal_steps or self.infinite:
            return batches.prefetch(tf.data.AUTOTUNE)
        return equal_passes(spec, self.declared_steps is not None,
                            lambda: self.steps_per_epoch(spec), lambda: self.template(spec),
                            lambda _: batches, first_epoch, end_epoch).prefetch(tf.data.AUTOTUNE)


def _one_world() -> Any:
    from hvdtrain.collectives import World

    return World()


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
