"""The data contract: what training asks of a data source, built-in or the user's.

Read this module to write a source; the trainer relies on nothing else.

**Producers.** A source is anything that makes a ``DataBundle``: the built-in loaders
(``hvdtrain.data.sources``: in-memory ``ArraySplit``s, and ``FileSplit``s from
``hvdtrain.data.files``), a user's data (``hvdtrain.data.user``: arrays, ``tf.data`` and
``PyDataset`` objects as ``DatasetSplit``s from ``hvdtrain.data.datasets``, ``hvdtrain.Pipeline``
factories), chosen by name in ``hvdtrain.data.load``. This module imports none of them.

**A split** (``Split``) is one part of the data, training or validation. It provides:

* ``num_examples``: how many examples it holds, or None when it cannot know (a user's
  pipeline or dataset object).
* ``input_shape``: the shape of one example's features without the batch axis (a dict of
  shapes for dict features): what the model is built for.
* ``normalised``: True when every rank knows the whole plan of an epoch (in-memory and file
  data), so the loss weight below is already 1/(real examples in the global batch) and
  ``steps_per_epoch`` is the same on every rank. False when each rank counts its own batches:
  the trainer then agrees on the count across ranks (the largest, padding; or the fewest,
  dropping) and divides the loss by the global count it reduces in the step.
* ``steps_per_epoch(spec)``: this rank's batches per epoch under a ``ShardSpec`` (rank, world
  size, batch size, remainder policy, seed, accumulation).
* ``dataset(spec, first_epoch, end_epoch)``: one ``tf.data.Dataset`` of this rank's batches
  for epochs ``[first_epoch, end_epoch)``, exactly ``spec.steps_per_epoch`` of them per epoch
  (the agreed count: an uneven count would leave a rank waiting in the allreduce). Each batch
  is ``(features, targets, sample_weight, weight)``: ``targets`` is ``()`` when there are none;
  ``sample_weight`` the user's per-example weight (ones when there is none); ``weight`` 0 for
  padding, else 1/(real examples in the global batch) when ``normalised``, else 1. The order is
  a function of the seed and the epoch, so a resumed run sees what an unbroken one would (a
  user's dataset object keeps its own order). With ``spec.equal_steps`` false (evaluation
  under a model's own ``test_step``) a split gives this rank's share alone, unpadded.
* optionally ``infinite``: true for a dataset that repeats forever, which then needs
  ``steps_per_epoch`` from the user.

**A bundle** (``DataBundle``) is what a source returns: the training split, the validation
split (None: no validation), ``num_classes`` (None for targets that are not class ids), and two
facts about the examples that say how Keras would hand a batch to a model's own
``train_step`` (``keras_element``): whether they have targets and whether the user gave sample
(or class) weights. ``checked_bundle`` refuses a validation split that holds nothing.

**Errors.** A source refuses what it cannot read with a ``DataError``: one line naming the
problem and the fix (``hvdtrain.errors.UserError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.data.pipeline import ShardSpec, array_dataset
from hvdtrain.errors import UserError


class DataError(UserError):
    """The data the user pointed at is missing, empty or malformed."""


class Split(Protocol):
    """One split of any source (the module doc is the contract)."""

    normalised: bool

    @property
    def num_examples(self) -> int | None: ...

    @property
    def input_shape(self) -> Any: ...

    def steps_per_epoch(self, spec: ShardSpec) -> int: ...

    def dataset(self, spec: ShardSpec, first_epoch: int = 0,
                end_epoch: int = 1) -> tf.data.Dataset: ...


def first_leaf(values: Any) -> np.ndarray:
    """The first array of a nest of arrays (its length is the number of examples)."""
    return tf.nest.flatten(values)[0]


def leaf_shapes(values: Any) -> Any:
    """The shape of one example of each array (a dict of shapes for dict features)."""
    return tf.nest.map_structure(lambda array: tuple(array.shape[1:]), values)


@dataclass(frozen=True)
class ArraySplit:
    """Examples held in memory: features and targets of any shape (arrays, or dicts/lists of
    arrays for several inputs or outputs), and optional per-example weights. Sharded by the
    exact global-batch plan of ``hvdtrain.data.pipeline``."""

    x: Any
    y: Any
    sample_weight: np.ndarray | None = None
    normalised: bool = True

    @property
    def num_examples(self) -> int:
        return len(first_leaf(self.x))

    @property
    def input_shape(self) -> Any:
        return leaf_shapes(self.x)

    def steps_per_epoch(self, spec: ShardSpec) -> int:
        return spec.steps_per_epoch

    def dataset(self, spec: ShardSpec, first_epoch: int = 0,
                end_epoch: int = 1) -> tf.data.Dataset:
        return array_dataset(self.x, self.y, spec, first_epoch, end_epoch, self.sample_weight)

    def take(self, rows: np.ndarray) -> "ArraySplit":
        """The examples at ``rows``, in that order."""
        def pick(values: Any) -> Any:
            return tf.nest.map_structure(lambda array: array[rows], values)

        weights = None if self.sample_weight is None else self.sample_weight[rows]
        return ArraySplit(pick(self.x), pick(self.y), weights)


@dataclass(frozen=True)
class DataBundle:
    """What training needs from a source. ``num_classes`` is None for targets that are not
    class ids (regression, multi-label, several outputs); ``val`` is None when there is no
    validation data. ``targets``: the examples have targets (not for a GAN's or an
    autoencoder's ``x`` alone); ``sample_weights``: the user gave sample (or class) weights.
    Together they say how Keras would hand a batch to a model's own ``train_step``."""

    train: Split
    val: Split | None
    num_classes: int | None
    targets: bool = True
    sample_weights: bool = False

    def keras_element(self, x: Any, y: Any, sample_weight: Any) -> Any:
        """A batch as Keras ``fit`` gives it to ``train_step``: ``x`` (``(x,)`` for a tuple
        of inputs), ``(x, y)`` or ``(x, y, sample_weight)``."""
        if not self.targets:
            return keras.utils.pack_x_y_sample_weight(x)
        if self.sample_weights:
            return x, y, sample_weight
        return x, y

    @property
    def input_shape(self) -> Any:
        return self.train.input_shape


def checked_bundle(bundle: DataBundle, name: str) -> DataBundle:
    """A source's splits, refused when validation was asked for but holds nothing."""
    if bundle.val is not None and bundle.val.num_examples == 0:
        raise DataError(f"dataset '{name}' has no validation examples; raise "
                        "--validation-split or give validation data")
    return bundle
