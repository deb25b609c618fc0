"""Data sources that fit in memory: each returns train and validation arrays.

A source is a function ``(DataConfig, seed) -> ArraySplits`` registered by name. The pipeline
(``hvdtrain.data.pipeline``) shards, shuffles and batches any of them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from hvdtrain.config import DataConfig
from hvdtrain.errors import UserError


class DataError(UserError):
    """The data the user pointed at is missing, empty or malformed."""


@dataclass(frozen=True)
class ArraySplits:
    """Features as float32 and integer labels, split into training and validation."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def split_arrays(x: np.ndarray, y: np.ndarray, fraction: float, seed: int,
                 num_classes: int) -> ArraySplits:
    """Hold out ``fraction`` of the examples for validation, chosen by a seeded permutation."""
    order = np.random.default_rng(seed).permutation(len(x))
    held = int(round(len(x) * fraction))
    val, train = order[:held], order[held:]
    return ArraySplits(x[train], y[train], x[val], y[val], num_classes)


def load_digits(config: DataConfig, seed: int) -> ArraySplits:
    """scikit-learn's bundled 8x8 digits: 1,797 images, 10 classes, scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    x = (bunch.images / 16.0).astype(np.float32)[..., np.newaxis]
    y = bunch.target.astype(np.int64)
    return split_arrays(x, y, config.validation_split, seed, 10)


def load_synthetic(config: DataConfig, seed: int) -> ArraySplits:
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


def load_npz(config: DataConfig, seed: int) -> ArraySplits:
    """A user's ``.npz``: ``x``, ``y``, and optionally ``x_val``, ``y_val``, ``num_classes``."""
    path = Path(config.data_path or "")
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; check --data-path")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as error:
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
        return ArraySplits(x, y, x_val, y_val, num_classes)
    return split_arrays(x, y, config.validation_split, seed, num_classes)


SOURCES: dict[str, Callable[[DataConfig, int], ArraySplits]] = {
    "digits": load_digits,
    "synthetic": load_synthetic,
    "npz": load_npz,
}


def load_source(config: DataConfig, seed: int) -> ArraySplits:
    """Load the configured source by name."""
    loader = SOURCES.get(config.dataset)
    if loader is None:
        raise DataError(f"unknown dataset '{config.dataset}'; choose one of "
                        f"{', '.join(SOURCES)}")
    splits = loader(config, seed)
    if len(splits.x_val) == 0:
        raise DataError(f"dataset '{config.dataset}' has no validation examples; raise "
                        "--validation-split or give x_val/y_val")
    return splits
