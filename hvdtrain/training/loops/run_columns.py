"""hvdtrain's own per-epoch values, kept beside Keras' epoch logs and never in them: each
optimizer's learning rate, the throughput and, under ``--elastic``, the world size.

The logs a user's callbacks, ``CSVLogger`` and ``History`` see must hold exactly the keys one
plain ``model.fit`` produces: a key only hvdtrain adds would be a column one process does not
have, in their files and in code that walks the logs. So these values are measured by
hvdtrain's callbacks (``Throughput``, ``NoteRunColumns``) into a ``RunColumnsLog``, from which
the run's own outputs (metrics files, TensorBoard events, the progress line, the checkpoint's
metrics row) and ``RunResult.run_columns`` take them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import keras


@dataclass(frozen=True)
class RunColumns:
    """One epoch's own values. ``epoch`` counts from 1, as ``metrics.jsonl`` and the progress
    line do; ``learning_rates``: the rate of the epoch's last step, by the optimizer's attribute
    on the model (``optimizer``; a GAN's ``d_optimizer`` and ``g_optimizer``), for those that
    trained; ``examples_per_second``: global examples over the epoch's training time;
    ``world_size``: the ranks of an elastic run's epoch (None otherwise)."""

    epoch: int
    learning_rates: dict[str, float]
    examples_per_second: float
    world_size: int | None = None

    def columns(self) -> dict[str, float]:
        """As the run's files name them: ``lr`` (``<optimizer>_lr`` for each of several),
        ``examples_per_second``, then ``world_size``."""
        several = len(self.learning_rates) > 1
        named = {f"{name}_lr" if several else "lr": rate
                 for name, rate in self.learning_rates.items()}
        named["examples_per_second"] = self.examples_per_second
        if self.world_size is not None:
            named["world_size"] = float(self.world_size)
        return named


class RunColumnsLog:
    """The run's ``RunColumns``, one per epoch trained, on every rank. One per run: an elastic
    run keeps it across its worlds, and an epoch that a new world redoes replaces its row."""

    def __init__(self) -> None:
        self.rows: list[RunColumns] = []

    def add(self, row: RunColumns) -> None:
        self.rows = [kept for kept in self.rows if kept.epoch != row.epoch] + [row]

    def columns(self, epoch: int) -> dict[str, float]:
        """The columns of Keras' epoch ``epoch`` (counted from 0); none before it is noted."""
        return next((row.columns() for row in self.rows if row.epoch == epoch + 1), {})


class Throughput(keras.callbacks.Callback):
    """Time the epoch's steps: global examples per second over its training time so far (a
    resumed epoch counts the steps it ran), for the progress bar and ``NoteRunColumns``."""

    def __init__(self, global_batch: int) -> None:
        super().__init__()
        self.global_batch = global_batch
        self.steps = 0
        self.started = self.last_batch_end = 0.0

    def rate(self) -> float:
        """Global examples per second over this epoch's steps so far."""
        return self.steps * self.global_batch / max(self.last_batch_end - self.started, 1e-9)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.started = self.last_batch_end = time.perf_counter()
        self.steps = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.last_batch_end = time.perf_counter()
        self.steps += 1


class NoteRunColumns(keras.callbacks.Callback):
    """Every rank, at an epoch's end after validation and before the user's callbacks (so the
    rates are the epoch's, before a ``ReduceLROnPlateau`` changes them): note the epoch's
    ``RunColumns`` in ``log``. The logs are left as Keras made them."""

    def __init__(self, throughput: Throughput,
                 optimizers: dict[str, keras.optimizers.Optimizer], log: RunColumnsLog,
                 world_size: int | None = None) -> None:
        super().__init__()
        self.throughput = throughput
        self.optimizers = optimizers
        self.log = log
        self.world_size = world_size

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        rates = {name: float(optimizer.learning_rate)
                 for name, optimizer in self.optimizers.items() if optimizer.built}
        self.log.add(RunColumns(epoch + 1, rates, self.throughput.rate(), self.world_size))


def _column_key(name: str) -> tuple[int, int, str]:
    """Training metrics (loss first), then validation metrics (val_loss first)."""
    validation = name.startswith("val_")
    base = name[4:] if validation else name
    return (int(validation), 0 if base == "loss" else 1, base)


def ordered(logs: dict) -> dict[str, float]:
    """Epoch logs as floats in one fixed column order (the loops fill logs differently)."""
    return {name: float(logs[name]) for name in sorted(logs, key=_column_key)}


def epoch_row(epoch: int, logs: dict, columns: RunColumnsLog) -> dict[str, float]:
    """What the run records of Keras' epoch ``epoch``: its logs in a fixed order, then the
    run's own columns (which win over a log of the same name)."""
    return {**ordered(logs), **columns.columns(epoch)}
