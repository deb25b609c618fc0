"""Rank 0's files besides checkpoints fail the way a checkpoint write does.

The final model, the metrics files, TensorBoard events, ``curves.png``, ``summary.json``,
``config.yaml`` and ``elastic.jsonl``: a write that fails (disk full, quota, permission) ends
the run with one line naming the file and the reason and exit code 74 (``WriteFailed``), and
leaves the checkpoints as they were, so ``--resume auto`` continues once the cause is fixed.
The epoch-end files are written after the epoch's checkpoint, so that checkpoint is whole on
disk; the other ranks, left waiting in their next collective, leave quietly after rank 0
(``cli``). The run's log (``output``) stays best effort: it is where such a line is told.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf

from hvdtrain.checkpoints.store import CheckpointStore
from hvdtrain.errors import WriteFailed, os_error_reason


def _reason(error: Exception) -> str:
    """Why a write failed: the errno for an OSError; the operating system's words at the end
    of the first line of a TensorFlow file writer's error ('...events.out...; No space left
    on device')."""
    if isinstance(error, OSError):
        return os_error_reason(error)
    return str(getattr(error, "message", error)).splitlines()[0].rsplit("; ", 1)[-1]


@contextlib.contextmanager
def run_files(run_dir: Path, what: str, leftover: Path | None = None) -> Iterator[None]:
    """Writes of ``what`` (e.g. 'the final model') in the block: a failure becomes a
    ``WriteFailed`` line; ``leftover``, a partial file the block may leave, is removed."""
    try:
        yield
    except (OSError, tf.errors.OpError) as error:   # TensorFlow's writers raise OpError
        if leftover is not None:
            leftover.unlink(missing_ok=True)
        latest = CheckpointStore(run_dir, 1).latest()
        kept = f"the last checkpoint {latest} is whole" if latest else "no checkpoint exists yet"
        raise WriteFailed(f"could not write {what} in {run_dir}: {_reason(error)}; {kept}; "
                          "free space or fix the quota or permissions, then continue with "
                          "--resume auto") from error


class RunFileWriter(keras.callbacks.Callback):
    """A callback of rank 0's that writes run files (the metrics files, TensorBoard events),
    built and run inside ``run_files``. It forwards the hooks such writers use: ``on_epoch_end``
    and ``on_train_end``."""

    def __init__(self, make: Callable[[], keras.callbacks.Callback], run_dir: Path,
                 what: str) -> None:
        super().__init__()
        self.run_dir, self.what = run_dir, what
        with run_files(run_dir, what):
            self.writer = make()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        with run_files(self.run_dir, self.what):
            self.writer.on_epoch_end(epoch, logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        with run_files(self.run_dir, self.what):
            self.writer.on_train_end(logs)


def json_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file; a line that does not parse (the last, cut short by a
    failed append) is skipped."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows
