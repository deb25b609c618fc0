"""The data contract: what training asks of a data source, built-in or the user's.

A source (``data.sources``, ``data.user``; chosen by name in ``data.load``, none imported here)
returns a ``DataBundle`` of ``Split``s; the trainer relies on nothing else, so a new source needs
only this module. Each ``Split`` gives this rank exactly the agreed number of batches per epoch
(an uneven count would leave a rank waiting in an allreduce), each batch ``(features, targets,
sample_weight, weight)`` with ``weight`` 0 for filler. A source refuses what it cannot read with
a one-line ``DataError``.
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
    """One split of any source, training or validation.

    ``num_examples``: None when it cannot know (a user's dataset). ``input_shape``: one example's
    features without the batch axis (a dict for dict features). ``normalised``: every rank knows
    the epoch's plan, so ``weight`` is already 1/(real examples in the global batch); else it is
    1 and the step divides by the count it reduces. ``steps_per_epoch(spec)``: this rank's
    batches. ``dataset(spec, first, end)``: exactly ``spec.steps_per_epoch`` batches per epoch,
    ordered by seed and epoch so a resume sees what an unbroken run would (with
    ``spec.equal_steps`` false: this rank's share alone, unpadded). Optional ``infinite``: a
    dataset that repeats forever, which needs ``steps_per_epoch``."""

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
    """Examples held in memory: features and targets of any shape (arrays, or nests of them,
    tuples and dicts, for several inputs or outputs; never lists, which ``tf.data`` would stack
    into one tensor), and optional per-example weights (a vector, or one per output in the
    targets' structure). Sharded by the exact global-batch plan of ``hvdtrain.data.pipeline``."""

    x: Any
    y: Any
    sample_weight: Any = None
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
            return None if values is None else tf.nest.map_structure(
                lambda array: array[rows], values)

        return ArraySplit(pick(self.x), pick(self.y), pick(self.sample_weight))


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
