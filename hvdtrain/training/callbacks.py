"""Rank-aware epoch hooks, shared by the Keras ``fit`` path and the custom loop.

Order matters and is fixed by ``standard_callbacks``: training metrics are reduced across ranks,
then validation runs (every rank, reduced exactly), then the learning rate is logged, then rank 0
checkpoints, writes the metrics files and prints the epoch summary. Every rank runs the hooks
that hold collectives, in the same order, so no allreduce is left waiting.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import keras

from hvdtrain.checkpoint import CheckpointStore
from hvdtrain.training.step import StepMath
from hvdtrain.world import Collectives, World


COLUMNS = ("loss", "accuracy", "val_loss", "val_accuracy", "lr")


def ordered(logs: dict) -> dict[str, float]:
    """Epoch logs as floats in one fixed column order (the two loops fill logs differently)."""
    names = [n for n in COLUMNS if n in logs] + sorted(n for n in logs if n not in COLUMNS)
    return {name: float(logs[name]) for name in names}


class EpochMetrics(keras.callbacks.Callback):
    """Reset the local metric sums each epoch and replace the logs with exact global values."""

    def __init__(self, step: StepMath, collectives: Collectives) -> None:
        super().__init__()
        self.step = step
        self.collectives = collectives

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.step.train_sums.reset()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs.update(self.step.train_sums.global_means(self.collectives))


class Validation(keras.callbacks.Callback):
    """Evaluate on every rank's validation shard and add exact ``val_*`` metrics to the logs."""

    def __init__(self, evaluate: Callable[[], dict[str, float]]) -> None:
        super().__init__()
        self.evaluate = evaluate

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs.update(self.evaluate())


class LearningRateLog(keras.callbacks.Callback):
    """Log the rate used by the epoch's last step (the schedule is a function of the step)."""

    def __init__(self, schedule: Callable[[int], Any],
                 optimizer: keras.optimizers.Optimizer) -> None:
        super().__init__()
        self.schedule = schedule
        self.optimizer = optimizer

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs["lr"] = float(self.schedule(int(self.optimizer.iterations.numpy()) - 1))


class Checkpoint(keras.callbacks.Callback):
    """Rank 0 saves model, optimizer, epoch and config after every epoch."""

    def __init__(self, store: CheckpointStore, model: keras.Model,
                 optimizer: keras.optimizers.Optimizer, state: dict[str, Any]) -> None:
        super().__init__()
        self.store = store
        self.inner = model
        self.optimizer = optimizer
        self.state = state

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.store.save(self.inner, self.optimizer, {**self.state, "epoch": epoch + 1,
                                                     "metrics": ordered(logs)})


class MetricsFiles(keras.callbacks.Callback):
    """Rank 0 appends one row per epoch to ``metrics.jsonl`` and ``metrics.csv``."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        self.jsonl = run_dir / "metrics.jsonl"
        self.csv = run_dir / "metrics.csv"

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        row = {"epoch": epoch + 1, **ordered(logs)}
        with open(self.jsonl, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        new_file = not self.csv.exists()
        with open(self.csv, "a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(row))
            if new_file:
                writer.writeheader()
            writer.writerow(row)


class Progress(keras.callbacks.Callback):
    """Rank 0: a progress bar with examples/second, then a one-line summary per epoch."""

    def __init__(self, epochs: int, steps: int, global_batch: int, show_bar: bool,
                 interactive: bool, stream=None) -> None:
        """``interactive``: redraw one line in place (a terminal, no launcher prefixing lines)."""
        super().__init__()
        self.epochs, self.steps, self.global_batch = epochs, steps, global_batch
        self.show_bar = show_bar
        self.stream = stream or sys.stdout
        self.interactive = interactive
        self.started = 0.0
        self.last_batch_end = 0.0
        self.next_report = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.started = self.last_batch_end = time.perf_counter()
        self.next_report = max(1, self.steps // 4)

    def _rate(self, steps_done: int) -> float:
        elapsed = self.last_batch_end - self.started
        return steps_done * self.global_batch / max(elapsed, 1e-9)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.last_batch_end = time.perf_counter()
        done = batch + 1
        if not self.show_bar or (not self.interactive and done < self.next_report):
            return
        width = 30
        filled = int(width * done / self.steps)
        line = (f"  [{'=' * filled}{'.' * (width - filled)}] {done}/{self.steps} "
                f"{self._rate(done):,.0f} ex/s loss {float(logs['loss']):.4f}")
        if self.interactive:
            self.stream.write("\r" + line)
        else:
            self.stream.write(line + "\n")
            self.next_report += max(1, self.steps // 4)
        self.stream.flush()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.show_bar and self.interactive:
            self.stream.write("\n")
        values = "  ".join(f"{k} {v:.4f}" if k != "lr" else f"lr {v:.5g}"
                           for k, v in ordered(logs).items())
        self.stream.write(f"epoch {epoch + 1}/{self.epochs}  {values}  "
                          f"{self._rate(self.steps):,.0f} ex/s\n")
        self.stream.flush()


def standard_callbacks(world: World, step: StepMath, collectives: Collectives,
                       evaluate: Callable[[], dict[str, float]], schedule: Callable[[int], Any],
                       store: CheckpointStore,
                       inner: keras.Model, state: dict[str, Any], run_dir: Path,
                       progress: Progress) -> list[keras.callbacks.Callback]:
    """The callbacks of a run, in the order they must fire."""
    callbacks: list[keras.callbacks.Callback] = [
        EpochMetrics(step, collectives),
        Validation(evaluate),
        LearningRateLog(schedule, step.optimizer),
    ]
    if world.is_chief:
        callbacks += [Checkpoint(store, inner, step.optimizer, state), MetricsFiles(run_dir),
                      progress]
    return callbacks
