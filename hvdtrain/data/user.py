"""A user's data: ``hvdtrain.fit(model, x, y, ...)`` or ``--dataset package.module:fn``.

What Keras' ``model.fit`` takes, hvdtrain takes (``KerasData`` holds ``fit``'s data arguments; a
``--dataset`` function's return value is read as its ``x``): arrays, a ``tf.data.Dataset`` or
``PyDataset`` (``data.datasets``), a function returning one (called after every rank is seeded
alike), ``hvdtrain.Arrays`` and ``hvdtrain.Pipeline`` factories of one rank's batches. Each
becomes a ``DataBundle`` (``data.contract``); the README's "Your model and data" says what each
form guarantees.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.collectives import World
from hvdtrain.config import DataConfig
from hvdtrain.data.arrays import class_count, split_arrays, targets_array
from hvdtrain.data.contract import ArraySplit, DataBundle, DataError, checked_bundle, first_leaf
from hvdtrain.data.datasets import DatasetSplit, class_ids, class_weight_table
from hvdtrain.data.equal_steps import count_batches, equal_passes, first_element
from hvdtrain.data.pipeline import ShardSpec


@dataclass(frozen=True)
class Arrays:
    """In-memory examples from a user's data function (``y`` None: no targets)."""

    x: Any
    y: Any = None
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


@dataclass(frozen=True)
class KerasData:
    """``model.fit``'s data arguments. ``validation_split`` None: Keras' default (none) for
    arrays given as ``x``/``y``, ``--validation-split`` for ``hvdtrain.Arrays``."""

    x: Any
    y: Any = None
    sample_weight: Any = None
    class_weight: dict | None = None
    validation_data: Any = None
    validation_split: float | None = None
    validation_steps: int | None = None


DATASET_OBJECTS = (tf.data.Dataset, keras.utils.PyDataset)


def _checked(values: Any, what: str, numeric: bool) -> Any:
    """Arrays (or nests of them), numeric where they must be; float64 becomes float32. Lists
    become tuples, as Keras' array adapter makes them (``tree.lists_to_tuples``): ``tf.data``
    would stack a list of arrays into one tensor (or fail on unequal shapes), where a list of
    inputs is a structure (a multi-input model's ``[x1, x2]``)."""
    def convert(array: Any) -> np.ndarray:
        array = np.asarray(array)
        if array.ndim == 0:
            raise DataError(f"{what} hold a single value ({array!r}); give arrays with one row "
                            "per example (a list stands for several inputs or outputs)")
        is_number = np.issubdtype(array.dtype, np.number) or array.dtype == bool
        if numeric and not is_number:
            raise DataError(f"{what} must be numeric arrays, got {array.dtype}")
        if not is_number and array.dtype.kind not in "USO":
            raise DataError(f"{what} must be numbers or strings, got {array.dtype}")
        return array.astype(np.float32) if array.dtype == np.float64 else array
    return tf.nest.map_structure(convert, keras.tree.lists_to_tuples(values))


def _features(x: Any) -> Any:
    """Features: numbers (floats as float32) or strings (for preprocessing layers)."""
    return tf.nest.map_structure(
        lambda a: a.astype(np.float32) if np.issubdtype(a.dtype, np.floating) else a,
        _checked(x, "features", numeric=False))


def _targets(y: Any) -> Any:
    """hvdtrain's form: class ids as int64 of shape (N,), other targets float32."""
    return () if y is None else tf.nest.map_structure(targets_array,
                                                      _checked(y, "targets", numeric=True))


def _keras_targets(y: Any) -> Any:
    """Keras' form: as given (float64 as float32), so a model's own step sees what Keras gives
    it."""
    return () if y is None else _checked(y, "targets", numeric=True)


def has_targets(y: Any) -> bool:
    """Whether targets are there (``()`` stands for none, as a ``tf.data`` structure can)."""
    return not (isinstance(y, tuple) and not y)


def _weights(values: Any, y: Any) -> Any:
    """Keras' ``sample_weight``: one weight per example (shape (N,) or (N, 1)), which Keras
    applies to every output of a multi-output model, or one such array per output, in ``y``'s
    structure (a list or a dict keyed like ``y``): a vector of shape (N,), or a nest of them."""
    if values is None:
        return None
    if isinstance(values, (list, tuple)) and all(np.ndim(value) == 0 for value in values):
        values = np.asarray(values)            # a list of numbers: one weight per example
    if tf.nest.is_nested(values) and not tf.nest.is_nested(y):
        raise DataError("sample_weight is a list or dict but y is one array; give one "
                        "sample_weight array (shape (N,)) for a model with one output")
    weights = tf.nest.map_structure(_per_example, _checked(values, "sample weights", True))
    if tf.nest.is_nested(weights):
        try:
            tf.nest.assert_same_structure(y, weights)
        except (ValueError, TypeError) as error:
            raise DataError(f"sample_weight has another structure than y ({error}); give one "
                            "sample_weight array per output in y, or one for all") from None
    return weights


def _per_example(weights: np.ndarray) -> np.ndarray:
    """One float32 weight per example (shape (N,)), from shape (N,) or (N, 1)."""
    if weights.ndim > 2 or (weights.ndim == 2 and weights.shape[1] != 1):
        raise DataError(f"sample weights of shape {weights.shape} weigh parts of an example; "
                        "give one weight per example (shape (N,))")
    return weights.astype(np.float32).reshape(-1)


def _checked_lengths(x: Any, y: Any, weights: Any, what: str) -> None:
    lengths = {len(a) for a in tf.nest.flatten((x, y, () if weights is None else weights))}
    if len(lengths) != 1:
        raise DataError(f"the {what} arrays have different numbers of examples "
                        f"({sorted(lengths)}); every array needs one row per example")
    if not lengths or lengths == {0}:
        raise DataError(f"the {what} arrays hold no examples")


def _as_arrays(value: Any, returned: bool) -> Arrays | None:
    """hvdtrain's own array forms, or None for anything else. A data function's return value
    (``returned``) may also be a dict with ``x`` and ``y`` or a tuple ``(x, y[, sample_weight])``
    (as a dataset's element is read); ``fit``'s own ``x`` is read as Keras reads it, a tuple or
    dict being the inputs of a multi-input model."""
    if isinstance(value, Arrays):
        return value
    if not returned:
        return None
    if isinstance(value, dict) and "x" in value and "y" in value:
        unknown = set(value) - set(Arrays.__dataclass_fields__)
        if unknown:
            raise DataError(f"the data function returned unknown key(s) "
                            f"{', '.join(sorted(unknown))}; use x, y, x_val, y_val, "
                            "sample_weight, val_sample_weight, num_classes")
        return Arrays(**value)
    if isinstance(value, tuple) and len(value) in (2, 3) and not any(
            isinstance(part, DATASET_OBJECTS) for part in value):
        return Arrays(value[0], value[1], sample_weight=value[2] if len(value) == 3 else None)
    return None


def _with_class_weight(weights: np.ndarray | None, y: Any,
                       class_weight: dict | None) -> np.ndarray | None:
    """Sample weights times Keras' ``class_weight`` of each example's class."""
    if not class_weight:
        return weights
    if not has_targets(y):
        raise DataError("class_weight needs targets (class ids); the data has none")
    try:
        ids = class_ids(tf.constant(y)).numpy()
    except (TypeError, ValueError, tf.errors.InvalidArgumentError) as error:
        raise DataError(f"class_weight needs class-id targets ({error})") from error
    table = class_weight_table(class_weight).numpy()
    if ids.size and (ids.min() < 0 or ids.max() >= len(table)):
        table = np.concatenate([table, np.ones(int(ids.max()) + 1 - len(table), np.float32)])
    per_example = table[ids]
    return per_example if weights is None else weights * per_example


def arrays_bundle(data: Arrays, config: DataConfig, seed: int,
                  class_weight: dict | None = None) -> DataBundle:
    """Check and shard a user's ``hvdtrain.Arrays`` exactly like a built-in in-memory source."""
    x, y = _features(data.x), _targets(data.y)
    weights = _with_class_weight(_weights(data.sample_weight, y), y, class_weight)
    _checked_lengths(x, y, weights, "training")
    single_target = not isinstance(y, (dict, list, tuple))
    flags = {"targets": has_targets(y), "sample_weights": weights is not None}
    if data.x_val is None:
        classes = data.num_classes or (class_count(y) if single_target else None)
        bundle = split_arrays(x, y, config.validation_split, seed, classes, weights)
        return DataBundle(bundle.train, bundle.val, classes, **flags)
    x_val, y_val = _features(data.x_val), _targets(data.y_val)
    val_weights = _weights(data.val_sample_weight, y_val)
    _checked_lengths(x_val, y_val, val_weights, "validation")
    classes = data.num_classes or (class_count(y, y_val) if single_target else None)
    return DataBundle(ArraySplit(x, y, weights), ArraySplit(x_val, y_val, val_weights),
                      classes, **flags)


def _keras_arrays(x: Any, y: Any, sample_weight: Any, what: str,
                  class_weight: dict | None = None) -> ArraySplit:
    x, y = _features(x), _keras_targets(y)
    weights = _with_class_weight(_weights(sample_weight, y), y, class_weight)
    _checked_lengths(x, y, weights, what)
    return ArraySplit(x, y, weights)


def _validation_split(data: Any) -> ArraySplit | DatasetSplit | None:
    """Keras' ``validation_data`` in any form: ``(x, y[, sample_weight])``, arrays, a
    dataset object, ``hvdtrain.Arrays``."""
    value = data.validation_data
    if value is None:
        return None
    if isinstance(value, DATASET_OBJECTS):
        return DatasetSplit(value, data.validation_steps)
    if isinstance(value, Arrays):
        return _keras_arrays(value.x, value.y, value.sample_weight, "validation")
    if isinstance(value, (tuple, list)):     # Keras' unpack_x_y_sample_weight
        if not 1 <= len(value) <= 3:
            raise DataError(f"validation_data has {len(value)} parts; give (x, y) or "
                            "(x, y, sample_weight), with a list or dict for several inputs")
        x, y, weights = keras.utils.unpack_x_y_sample_weight(tuple(value))
        return _keras_arrays(x, y, weights, "validation")
    return _keras_arrays(value, None, None, "validation")


def _keras_bundle(data: KerasData, config: DataConfig) -> DataBundle:
    """``x``/``y`` arrays as ``model.fit`` takes them."""
    if isinstance(data.y, DATASET_OBJECTS):
        raise DataError("y is a dataset; give the dataset as x (it yields (x, y))")
    train = _keras_arrays(data.x, data.y, data.sample_weight, "training", data.class_weight)
    val = _validation_split(data)
    fraction = data.validation_split or 0.0
    if fraction and val is None:
        examples = train.num_examples
        # Keras' split: training keeps floor(examples x (1 - fraction)), validation the rest
        # (the last examples, before shuffling)
        held = examples - math.floor(examples * (1.0 - fraction))
        if held == 0 or held == examples:
            raise DataError(f"validation_split {fraction} of {examples} examples leaves "
                            "nothing to train or to validate on; change it")
        val = train.take(np.arange(examples - held, examples))
        train = train.take(np.arange(examples - held))
    single_target = not isinstance(train.y, (dict, list, tuple))
    classes = None
    if single_target and np.issubdtype(np.asarray(train.y).dtype, np.integer) and (
            np.asarray(train.y).ndim == 1):
        classes = int(np.max(train.y)) + 1
    return DataBundle(train, val, classes, targets=has_targets(train.y),
                      sample_weights=train.sample_weight is not None)


def _dataset_bundle(data: KerasData) -> DataBundle:
    if data.y is not None or data.sample_weight is not None:
        raise DataError("a dataset yields its own targets and sample weights; do not also "
                        "give y or sample_weight")
    if data.validation_split:
        raise DataError("validation_split needs arrays; give the dataset's validation part "
                        "as validation_data")
    train = DatasetSplit(data.x, class_weight=data.class_weight)
    return DataBundle(train, _validation_split(data), None, targets=train.has_targets,
                      sample_weights=train.has_sample_weights)


def _builder(value: Any) -> bool:
    """Whether ``value`` is a function that builds the data (not data, nor a dataset object
    that happens to be callable)."""
    return callable(value) and not isinstance(value, (*DATASET_OBJECTS, Pipeline, Arrays, type))


def built(data: KerasData) -> KerasData:
    """``x`` and ``validation_data`` given as functions (``x=make_dataset``) called now, in the
    run, after every rank was seeded alike (``distribute_datasets_from_function``'s way: a
    pipeline built here shuffles the same on every rank)."""
    def call(value: Any, what: str) -> Any:
        made = value()
        if made is None or _builder(made):
            raise DataError(f"the function given as {what} returned {type(made).__name__}; "
                            "return the data (a tf.data.Dataset, arrays, ...)")
        return made

    x = call(data.x, "x") if _builder(data.x) else data.x
    val = data.validation_data
    val = call(val, "validation_data") if _builder(val) else val
    return dataclasses.replace(data, x=x, validation_data=val)


def user_bundle(value: Any, config: DataConfig, seed: int) -> DataBundle:
    """The splits of whatever the user handed over (``KerasData`` from ``hvdtrain.fit``, or a
    data function's return value)."""
    returned = not isinstance(value, KerasData) or _builder(value.x)
    data = built(value if isinstance(value, KerasData) else KerasData(value))
    if isinstance(data.x, Pipeline):
        pipeline = data.x
        val = None if pipeline.val is None else PipelineSplit(pipeline.val, pipeline.val_steps)
        return DataBundle(PipelineSplit(pipeline.train, pipeline.steps_per_epoch), val,
                          pipeline.num_classes)
    if isinstance(data.x, DATASET_OBJECTS):
        return _dataset_bundle(data)
    arrays = _as_arrays(data.x, returned) if data.y is None else None
    if arrays is not None:
        bundle = checked_bundle(arrays_bundle(arrays, config, seed, data.class_weight),
                                "the user's data")
        val = _validation_split(data)
        if val is not None:
            bundle = DataBundle(bundle.train, val, bundle.num_classes, bundle.targets,
                                bundle.sample_weights)
        return bundle
    if data.x is None or isinstance(data.x, (str, int, float)):
        raise DataError(f"the data is {type(data.x).__name__}; give arrays (x, y), "
                        "a tf.data.Dataset, a keras.utils.PyDataset, hvdtrain.Arrays or "
                        "hvdtrain.Pipeline")
    return _keras_bundle(data, config)


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


@dataclass(frozen=True)
class PipelineSplit:
    """A user's per-rank ``tf.data`` factory, evened out to the same steps on every rank
    (``hvdtrain.data.equal_steps``). ``declared_steps``: the batches of one pass when the user
    says so, else counted on the first."""

    factory: Callable[[Shard], tf.data.Dataset]
    declared_steps: int | None
    normalised: bool = False
    # The template, once read (rank 0's first batch of the first pass).
    _template: list = field(default_factory=list, compare=False, repr=False)

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
        """This rank's batches in the first pass (or the declared count); the run agrees on the
        most (filling) or the fewest (cutting)."""
        if self.declared_steps is not None:
            return self.declared_steps
        return count_batches(self._epoch(spec, 0))

    def template(self, spec: ShardSpec) -> tuple:
        """Rank 0's first batch of the first pass: the same real batch on every rank, which
        fills a short rank at loss weight zero."""
        if not self._template:
            first = first_element(self._epoch(dataclasses.replace(
                spec, world=dataclasses.replace(spec.world, rank=0)), 0))
            if first is None:
                raise DataError("the pipeline factory gave rank 0 no batches; give it data")
            self._template.append(first)
        return self._template[0]

    def dataset(self, spec: ShardSpec, first_epoch: int = 0,
                end_epoch: int = 1) -> tf.data.Dataset:
        if not spec.equal_steps:
            return self._epoch(spec, first_epoch).prefetch(tf.data.AUTOTUNE)
        return equal_passes(spec, self.declared_steps is not None,
                            lambda: self.steps_per_epoch(spec), lambda: self.template(spec),
                            lambda epoch: self._epoch(spec, epoch), first_epoch,
                            end_epoch).prefetch(tf.data.AUTOTUNE)
