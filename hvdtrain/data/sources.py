"""The built-in data sources by name: each gives a training and a validation split and the
class count, as ``hvdtrain.data.contract`` says.

In-memory sources (digits, synthetic, npz, mnist, fashion_mnist, cifar10) return arrays, sharded
by the exact global-batch plan of ``hvdtrain.data.pipeline``; file sources (tfrecord, csv) return
``FileSplit``s from ``hvdtrain.data.files``. Both kinds answer the same two questions, steps per
epoch and the dataset of (features, labels, weights) batches, so training treats them alike.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from hvdtrain.config import DataConfig
from hvdtrain.data import keras_files
from hvdtrain.data.arrays import class_count, split_arrays, targets_array
from hvdtrain.data.contract import ArraySplit, DataBundle, DataError
from hvdtrain.data.files import csv_split, tfrecord_split


def _arrays(x_train, y_train, x_val, y_val, num_classes: int | None) -> DataBundle:
    return DataBundle(ArraySplit(x_train, y_train), ArraySplit(x_val, y_val), num_classes)


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
    """tfrecord or csv: training and validation globs (both given: ``config.validate``)."""
    make = tfrecord_split if config.dataset == "tfrecord" else csv_split
    train, num_classes = make(config, config.data_path or "", "--data-path")
    val, _ = make(config, config.val_data_path or "", "--val-data-path")
    return DataBundle(train, val, num_classes)


# The built-in sources by name; hvdtrain.builtin_names.DATASETS holds the same names.
SOURCES: dict[str, Callable[[DataConfig, int], DataBundle]] = {
    "digits": load_digits,
    "synthetic": load_synthetic,
    "npz": load_npz,
    "tfrecord": load_files,
    "csv": load_files,
    "mnist": load_keras_dataset,
    "fashion_mnist": load_keras_dataset,
    "cifar10": load_keras_dataset,
}
