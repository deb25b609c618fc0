"""Keras' standard datasets from their standard files, for cluster nodes without internet.

``--data-dir`` holds what Keras itself downloads: ``mnist.npz``; the four Fashion-MNIST
``*-idx?-ubyte.gz`` files; ``cifar-10-batches-py/`` (or its contents). Without ``--data-dir``,
Keras' own loader runs (its cache in ~/.keras/datasets, else a download); when that fails, one
line says what to do. CIFAR-10's batches are Python pickles: they are read with an unpickler that
only admits the plain containers and NumPy arrays those files hold, so a tampered file cannot
run code.
"""

from __future__ import annotations

import gzip
import io
import pickle
import zipfile
from pathlib import Path

import numpy as np

from hvdtrain.errors import UserError

Arrays = tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
FASHION_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
STANDARD_FILES = {"mnist": "mnist.npz", "fashion_mnist": ", ".join(FASHION_FILES),
                  "cifar10": "cifar-10-batches-py/ (data_batch_1..5, test_batch)"}


class DatasetFilesError(UserError):
    """The standard files are missing or malformed, or the download failed."""


def _mnist(directory: Path) -> Arrays:
    with np.load(directory / "mnist.npz", allow_pickle=False) as f:
        return (f["x_train"], f["y_train"]), (f["x_test"], f["y_test"])


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST family's format): magic, dimension sizes, then uint8 data."""
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    dims = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)


def _fashion_mnist(directory: Path) -> Arrays:
    x_train, y_train, x_test, y_test = (read_idx(directory / name) for name in FASHION_FILES)
    return (x_train, y_train), (x_test, y_test)


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """Admit only what CIFAR batches contain: NumPy arrays and their dtypes."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = _ArraysOnlyUnpickler(io.BytesIO(path.read_bytes()), encoding="bytes").load()
    images = np.asarray(batch[b"data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, np.asarray(batch[b"labels"], np.int64)


def _cifar10(directory: Path) -> Arrays:
    if (directory / "cifar-10-batches-py").is_dir():
        directory = directory / "cifar-10-batches-py"
    parts = [read_cifar_batch(directory / f"data_batch_{i}") for i in range(1, 6)]
    test = read_cifar_batch(directory / "test_batch")
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])), test


READERS = {"mnist": _mnist, "fashion_mnist": _fashion_mnist, "cifar10": _cifar10}


def load(name: str, data_dir: str | None) -> Arrays:
    """(train, test) arrays of a standard dataset, from ``data_dir`` or Keras' loader."""
    if data_dir:
        try:
            return READERS[name](Path(data_dir))
        except (OSError, KeyError, ValueError, IndexError, pickle.UnpicklingError,
                zipfile.BadZipFile) as error:
            raise DatasetFilesError(f"--data-dir {data_dir} does not hold the standard {name} "
                                    f"files ({STANDARD_FILES[name]}): {error}") from error
    import keras

    try:
        return getattr(keras.datasets, name).load_data()
    except Exception as error:  # noqa: BLE001 - any download failure gets the same advice
        raise DatasetFilesError(
            f"cannot load {name} with Keras' downloader ({type(error).__name__}); on nodes "
            f"without internet pass --data-dir DIR holding {STANDARD_FILES[name]}") from error
