"""In-memory examples as the built-in sources and a user's arrays both take them: targets in
hvdtrain's form, the class count they imply, and a seeded hold-out for validation. Shared here
so that ``hvdtrain.data.sources`` and ``hvdtrain.data.user`` need nothing from each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hvdtrain.data.contract import ArraySplit, DataBundle, DataError


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


def split_arrays(x: Any, y: Any, fraction: float, seed: int, num_classes: int | None,
                 sample_weight: Any = None) -> DataBundle:
    """Hold out ``fraction`` of the examples for validation, chosen by a seeded permutation."""
    examples = ArraySplit(x, y, sample_weight)
    order = np.random.default_rng(seed).permutation(examples.num_examples)
    held = int(round(examples.num_examples * fraction))
    return DataBundle(examples.take(order[held:]), examples.take(order[:held]), num_classes)
