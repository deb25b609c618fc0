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
from typing import Callable

import numpy as np

import tensorflow as tf

from hvdtrain.config import DataConfig
from hvdtrain.data import keras_files
from hvdtrain.data.files import FileSplit, csv_split, tfrecord_split
from hvdtrain.data.pipeline import ShardSpec, array_dataset
from hvdtrain.errors import UserError


class DataError(UserError):
    """The data the user pointed at is missing, empty or malformed."""


@dataclass(frozen=True)
class ArraySplit:
    """Examples held in memory: float32 features and integer labels."""

    x: np.ndarray
    y: np.ndarray

    @property
    def num_examples(self) -> int:
        return len(self.x)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def steps_per_epoch(self, spec: ShardSpec) -> int:
        return spec.steps_per_epoch

    def dataset(self, spec: ShardSpec, first_epoch: int = 0,
                end_epoch: int = 1) -> tf.data.Dataset:
        return array_dataset(self.x, self.y, spec, first_epoch, end_epoch)


Split = ArraySplit | FileSplit


@dataclass(frozen=True)
class DataBundle:
    """What training needs from a source."""

    train: Split
    val: Split
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.train.input_shape


def _arrays(x_train, y_train, x_val, y_val, num_classes: int) -> DataBundle:
    return DataBundle(ArraySplit(x_train, y_train), ArraySplit(x_val, y_val), num_classes)


def split_arrays(x: np.ndarray, y: np.ndarray, fraction: float, seed: int,
                 num_classes: int) -> DataBundle:
    """Hold out ``fraction`` of the examples for validation, chosen by a seeded permutation."""
    order = np.random.default_rng(seed).permutation(len(x))
    held = int(round(len(x) * fraction))
    val, train = order[:held], order[held:]
    return _arrays(x[train], y[train], x[val], y[val], num_classes)


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


def _checked_pair(arrays: dict[str, np.ndarray], x_key: str, y_key: str, path: Path):
    x, y = arrays[x_key], arrays[y_key]
    if len(x) == 0:
        raise DataError(f"{path}: '{x_key}' is empty; it needs at least one example")
    if len(x) != len(y):
        raise DataError(f"{path}: '{x_key}' has {len(x)} examples but '{y_key}' has {len(y)}; "
                        "they must match")
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{path}: labels '{y_key}' must be integers (class ids), got {y.dtype}")
    if x.ndim == 1:
        x = x[:, np.newaxis]
    return x.astype(np.float32), y.astype(np.int64).reshape(-1)


def load_npz(config: DataConfig, seed: int) -> DataBundle:
    """A user's ``.npz``: ``x``, ``y``, and optionally ``x_val``, ``y_val``, ``num_classes``."""
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
    labels = np.concatenate([y, arrays["y_val"].reshape(-1)]) if has_val else y
    num_classes = int(arrays["num_classes"]) if "num_classes" in arrays else int(labels.max()) + 1
    if labels.min() < 0 or labels.max() >= num_classes:
        raise DataError(f"{path}: labels must lie in [0, {num_classes - 1}], found "
                        f"{labels.min()}..{labels.max()}")
    if has_val:
        x_val, y_val = _checked_pair(arrays, "x_val", "y_val", path)
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
    """Load the configured source by name."""
    loader = SOURCES.get(config.dataset)
    if loader is None:
        raise DataError(f"unknown dataset '{config.dataset}'; choose one of "
                        f"{', '.join(SOURCES)}")
    bundle = loader(config, seed)
    if bundle.val.num_examples == 0:
        raise DataError(f"dataset '{config.dataset}' has no validation examples; raise "
                        "--validation-split or give validation data")
    return bundle
