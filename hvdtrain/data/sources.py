"""Data sources by name: each gives a training and a validation split and the class count.

In-memory sources (digits, synthetic, npz, mnist, fashion_mnist, cifar10) return arrays, sharded
by the exact global-batch plan of ``hvdtrain.data.pipeline``; file sources (tfrecord, csv) return
``FileSplit``s from ``hvdtrain.data.files``. Both kinds answer the same two questions, steps per
epoch and the dataset of (features, labels, weights) batches, so training treats them alike.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.config import PYTHON_OBJECT, DataConfig
from hvdtrain.data import keras_files
from hvdtrain.data.files import csv_split, tfrecord_split
from hvdtrain.data.pipeline import ShardSpec, array_dataset
from hvdtrain.errors import UserError
from hvdtrain.plugins import is_plugin, load_callable


class DataError(UserError):
    """The data the user pointed at is missing, empty or malformed."""


class Split(Protocol):
    """What training asks of one split of any source, built-in or the user's.

    ``dataset`` yields, for epochs ``[first_epoch, end_epoch)``, exactly
    ``spec.steps_per_epoch`` batches per epoch on every rank (an uneven count would leave a
    rank waiting in the allreduce), each ``(features, targets, sample_weight, weight)``:
    ``sample_weight`` is the user's per-example weight (ones when there is none) and ``weight``
    is 0 for padding, else 1/(real examples in the global batch) when ``normalised``, else 1
    (the step then divides by the global count it reduces across ranks). A ``normalised``
    source knows the whole plan on every rank, so its ``steps_per_epoch`` is the same on every
    rank; the others' counts are agreed across ranks (the largest) before training.
    """

    normalised: bool

    @property
    def num_examples(self) -> int | None: ...

    @property
    def input_shape(self) -> Any: ...

    def steps_per_epoch(self, spec: ShardSpec) -> int: ...

    def dataset(self, spec: ShardSpec, first_epoch: int = 0,
                end_epoch: int = 1) -> tf.data.Dataset: ...


def first_leaf(values: Any) -> np.ndarray:
    return tf.nest.flatten(values)[0]


def leaf_shapes(values: Any) -> Any:
    """The shape of one example of each array (a dict of shapes for dict features)."""
    return tf.nest.map_structure(lambda array: tuple(array.shape[1:]), values)


@dataclass(frozen=True)
class ArraySplit:
    """Examples held in memory: features and targets of any shape (arrays, or dicts/lists of
    arrays for several inputs or outputs), and optional per-example weights."""

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


def _arrays(x_train, y_train, x_val, y_val, num_classes: int | None) -> DataBundle:
    return DataBundle(ArraySplit(x_train, y_train), ArraySplit(x_val, y_val), num_classes)


def split_arrays(x: Any, y: Any, fraction: float, seed: int, num_classes: int | None,
                 sample_weight: np.ndarray | None = None) -> DataBundle:
    """Hold out ``fraction`` of the examples for validation, chosen by a seeded permutation."""
    examples = ArraySplit(x, y, sample_weight)
    order = np.random.default_rng(seed).permutation(examples.num_examples)
    held = int(round(examples.num_examples * fraction))
    return DataBundle(examples.take(order[held:]), examples.take(order[:held]), num_classes)


def load_digits(config: DataConfig, seed: int) -> DataBundle:
    """scikit-learn's bundled 8x8 digits: 1,797 images, 10 classes, scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    x = (bunch.images / 16.0).astype(np.float32)[..., np.newaxis]
    y = bunch.target.astype(np.int64)
    return split_arrays(x, y, config.validation_split, seed, 10)


def load_synthetic(config: DataConfig, seed: int) -> DataBundle:
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, any size or shape."""
    rng = np.random.default_rng(seed)
    shape = tuple(config.synthetic_shape)
    x = rng.standard_normal((config.synthetic_examples, *shape), dtype=np.float32)
    teacher = rng.standard_normal((int(np.prod(shape)), config.synthetic_classes))
    y = np.argmax(x.reshape(len(x), -1) @ teacher, axis=1).astype(np.int64)
    return split_arrays(x, y, config.validation_split, seed, config.synthetic_classes)


def targets_array(y: np.ndarray) -> np.ndarray:
    """Class ids as int64 of shape (N,); any other target keeps its shape (float32, or int64)."""
    if np.issubdtype(y.dtype, np.integer) or y.dtype == bool:
        y = y.astype(np.int64)
        return y.reshape(-1) if y.ndim == 1 or y.shape[1:] == (1,) else y
    if not np.issubdtype(y.dtype, np.floating):
        raise DataError(f"targets must be numbers, got {y.dtype}")
    return y.astype(np.float32)


def class_count(*targets: np.ndarray) -> int | None:
    """Classes implied by integer class ids (the largest id + 1); None for other targets."""
    if not all(t.dtype == np.int64 and t.ndim == 1 for t in targets):
        return None
    return int(max(t.max() for t in targets)) + 1


def _checked_pair(arrays: dict[str, np.ndarray], x_key: str, y_key: str, path: Path):
    x, y = arrays[x_key], arrays[y_key]
    if len(x) == 0:
        raise DataError(f"{path}: '{x_key}' is empty; it needs at least one example")
    if len(x) != len(y):
        raise DataError(f"{path}: '{x_key}' has {len(x)} examples but '{y_key}' has {len(y)}; "
                        "they must match")
    try:
        y = targets_array(y)
    except DataError as error:
        raise DataError(f"{path}: '{y_key}': {error}") from error
    if x.ndim == 1:
        x = x[:, np.newaxis]
    return x.astype(np.float32), y


def load_npz(config: DataConfig, seed: int) -> DataBundle:
    """A user's ``.npz``: ``x``, ``y``, and optionally ``x_val``, ``y_val``, ``num_classes``.
    Integer ``y`` of shape (N,) are class ids; float or multi-dimensional ``y`` are targets for
    whatever loss the model was compiled with."""
    path = Path(config.data_path or "")
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; check --data-path")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise DataError(f"{path} is not a readable .npz file ({error}); write it with "
                        "numpy.savez(path, x=..., y=...)") from error
    for key in ("x", "y"):
        if key not in arrays:
            raise DataError(f"{path} has no array '{key}' (found: {', '.join(arrays) or 'none'});"
                            " write it with numpy.savez(path, x=..., y=...)")
    x, y = _checked_pair(arrays, "x", "y", path)
    has_val = "x_val" in arrays and "y_val" in arrays
    x_val, y_val = _checked_pair(arrays, "x_val", "y_val", path) if has_val else (None, None)
    num_classes = class_count(y, *([y_val] if has_val else []))
    if num_classes is not None and "num_classes" in arrays:
        num_classes = int(arrays["num_classes"])
    if num_classes is not None:
        labels = np.concatenate([y, y_val]) if has_val else y
        if labels.min() < 0 or labels.max() >= num_classes:
            raise DataError(f"{path}: labels must lie in [0, {num_classes - 1}], found "
                            f"{labels.min()}..{labels.max()}")
    if has_val:
        if x_val.shape[1:] != x.shape[1:]:
            raise DataError(f"{path}: 'x_val' examples have shape {x_val.shape[1:]} but 'x' has "
                            f"{x.shape[1:]}; they must match")
        return _arrays(x, y, x_val, y_val, num_classes)
    return split_arrays(x, y, config.validation_split, seed, num_classes)


def load_keras_dataset(config: DataConfig, seed: int) -> DataBundle:
    """mnist, fashion_mnist or cifar10: the standard files in ``--data-dir``, or Keras' loader
    (its cache in ~/.keras/datasets, else a download). The standard test set validates."""
    (x_train, y_train), (x_val, y_val) = keras_files.load(config.dataset, config.data_dir)
    return _arrays(_unit_images(x_train), y_train.reshape(-1).astype(np.int64),
                   _unit_images(x_val), y_val.reshape(-1).astype(np.int64), 10)


def _unit_images(images: np.ndarray) -> np.ndarray:
    """uint8 images (N, H, W) or (N, H, W, C) as float32 in [0, 1] with a channel axis."""
    if images.ndim == 3:
        images = images[..., np.newaxis]
    return images.astype(np.float32) / 255.0


def load_files(config: DataConfig, seed: int) -> DataBundle:
    """tfrecord or csv: training and validation globs."""
    make = tfrecord_split if config.dataset == "tfrecord" else csv_split
    train, num_classes = make(config, config.data_path, "--data-path")
    val, _ = make(config, config.val_data_path, "--val-data-path")
    return DataBundle(train, val, num_classes)


SOURCES: dict[str, Callable[[DataConfig, int], DataBundle]] = {
    "digits": load_digits,
    "synthetic": load_synthetic,
    "npz": load_npz,
    "mnist": load_keras_dataset,
    "fashion_mnist": load_keras_dataset,
    "cifar10": load_keras_dataset,
    "tfrecord": load_files,
    "csv": load_files,
}


def load_source(config: DataConfig, seed: int) -> DataBundle:
    """Load the configured source: a built-in by name, or a user's ``package.module:fn``."""
    if is_plugin(config.dataset):
        from hvdtrain.data.user import user_bundle

        return user_bundle(load_callable(config.dataset, "dataset")(), config, seed)
    if config.dataset == PYTHON_OBJECT:
        raise DataError("this run's data was handed to hvdtrain.fit in Python and cannot be "
                        "loaded by name; pass the data again (or --data-path FILE.npz)")
    loader = SOURCES.get(config.dataset)
    if loader is None:
        raise DataError(f"unknown dataset '{config.dataset}'; choose one of "
                        f"{', '.join(SOURCES)} or give package.module:fn")
    return checked_bundle(loader(config, seed), config.dataset)


def checked_bundle(bundle: DataBundle, name: str) -> DataBundle:
    """A source's splits, refused when validation was asked for but holds nothing."""
    if bundle.val is not None and bundle.val.num_examples == 0:
        raise DataError(f"dataset '{name}' has no validation examples; raise "
                        "--validation-split or give validation data")
    return bundle
