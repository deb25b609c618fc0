"""What the programs in this folder share: the GPU a process takes, and what each leaves
behind for ``tests/distributed/horovod/test_horovod_dropin.py``.

A Horovod program would not need the report: the test does, to check that every rank ended
with the same weights (``weights-<rank>.npz``, compared bit for bit) and that the training
learned (``report-<rank>.json``: whatever numbers the program chose to report).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf


def use_one_gpu_per_process(local_rank: int) -> None:
    """Each process on a machine takes the GPU numbered by its local rank (none on CPU)."""
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[local_rank], "GPU")


def write_rank_report(out_dir: str, rank: int, variables: list[Any],
                      report: dict[str, Any]) -> None:
    """Save this rank's trainable variables, by position, and its report."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / f"weights-{rank}.npz",
             **{f"v{index:03d}": np.asarray(variable) for index, variable in enumerate(variables)})
    (folder / f"report-{rank}.json").write_text(json.dumps(report, indent=1) + "\n")
