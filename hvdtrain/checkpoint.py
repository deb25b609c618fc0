"""Rank-0 checkpoints that a crash cannot destroy, and weights-only restore.

A checkpoint is a directory ``checkpoints/epoch-NNNN`` holding the model weights
(``model.weights.h5``), the optimizer's variables (``optimizer.npz``, including its step counter,
so the learning-rate schedule resumes where it was) and ``state.json`` (epoch, model identity,
config). It is written under a temporary name, flushed to disk, and renamed into place in one
atomic step, so at any instant the newest complete checkpoint is on disk whole. Restore reads
weights and arrays only: nothing in a checkpoint is executed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import keras
import numpy as np

from hvdtrain.errors import UserError

CHECKPOINT_NAME = re.compile(r"epoch-(\d{4,})")
WEIGHTS_FILE = "model.weights.h5"
OPTIMIZER_FILE = "optimizer.npz"
STATE_FILE = "state.json"


class CheckpointError(UserError):
    """A checkpoint cannot be read or does not fit the configured model."""


def _fsync_tree(directory: Path) -> None:
    for path in [*directory.iterdir(), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file so readers see the old content or the new, never a torn one."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


class CheckpointStore:
    """The checkpoints of one run directory."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.directory = Path(run_dir) / "checkpoints"
        self.keep = keep

    def complete(self) -> list[Path]:
        """Finished checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir()
                 if CHECKPOINT_NAME.fullmatch(p.name) and (p / STATE_FILE).is_file()]
        return sorted(found, key=lambda p: int(CHECKPOINT_NAME.fullmatch(p.name).group(1)))

    def latest(self) -> Path | None:
        found = self.complete()
        return found[-1] if found else None

    def save(self, model: keras.Model, optimizer: keras.optimizers.Optimizer,
             state: dict[str, Any]) -> Path:
        """Write checkpoint ``epoch-<state['epoch']>`` atomically and prune old ones."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"epoch-{state['epoch']:04d}"
        partial = self.directory / f".partial-{final.name}-{os.getpid()}"
        self._recover_leftovers()
        partial.mkdir()
        model.save_weights(partial / WEIGHTS_FILE)
        arrays = {f"v{i:04d}": v.numpy() for i, v in enumerate(optimizer.variables)}
        np.savez(partial / OPTIMIZER_FILE, **arrays)
        (partial / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        _fsync_tree(partial)
        if final.exists():  # a re-run of the same epoch: keep the old one until the swap
            stale = self.directory / f".stale-{final.name}-{os.getpid()}"
            os.rename(final, stale)
            os.rename(partial, final)
            shutil.rmtree(stale)
        else:
            os.rename(partial, final)
        _fsync_tree(self.directory)
        for old in self.complete()[:-self.keep]:
            shutil.rmtree(old)
        return final

    def _recover_leftovers(self) -> None:
        """After a crash mid-write: drop partial checkpoints; put back a replaced checkpoint
        whose replacement never landed (a crash between the two renames of a swap)."""
        for partial in self.directory.glob(".partial-*"):
            shutil.rmtree(partial, ignore_errors=True)
        for stale in self.directory.glob(".stale-*"):
            name = CHECKPOINT_NAME.search(stale.name)
            original = self.directory / name.group(0) if name else None
            if original is not None and not original.exists():
                os.rename(stale, original)
            else:
                shutil.rmtree(stale, ignore_errors=True)

    @staticmethod
    def read_state(path: Path) -> dict[str, Any]:
        try:
            return json.loads((path / STATE_FILE).read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(f"checkpoint {path} is unreadable ({error}); delete it to "
                                  "resume from the one before") from error

    @staticmethod
    def restore(path: Path, model: keras.Model,
                optimizer: keras.optimizers.Optimizer) -> None:
        """Load weights and optimizer variables (built beforehand) from a checkpoint."""
        try:
            model.load_weights(path / WEIGHTS_FILE)
            with np.load(path / OPTIMIZER_FILE, allow_pickle=False) as archive:
                arrays = [archive[key] for key in sorted(archive.files)]
        except (OSError, ValueError, zipfile.BadZipFile) as error:
            raise CheckpointError(f"checkpoint {path} does not fit this model or is unreadable "
                                  f"({error}); check --model or start a new --run-dir") from error
        variables = optimizer.variables
        shapes_fit = len(arrays) == len(variables) and all(
            tuple(a.shape) == tuple(v.shape) for a, v in zip(arrays, variables))
        if not shapes_fit:
            raise CheckpointError(f"checkpoint {path} holds optimizer state of another shape; "
                                  "resume with the same --optimizer and --model")
        for variable, array in zip(variables, arrays):
            variable.assign(array)
