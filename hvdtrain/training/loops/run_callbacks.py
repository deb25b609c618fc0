"""The run's own callbacks besides the epoch end (``epoch_end``): per-step hooks (liveness,
divergence, the first-step clock, where training is), rank 0's reporting (metrics files,
TensorBoard, progress), the user's writer callbacks on rank 0 alone, and ``CallbackContext``,
what they act on. Every rank runs the hooks that hold collectives, in the same order, so no
allreduce is left waiting; the logs hold only what one plain ``model.fit`` would put there."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import keras
import tensorflow as tf

from hvdtrain.checkpoints.store import CheckpointStore, atomic_write_text
from hvdtrain.collectives import Collectives, World
from hvdtrain.data.equal_steps import RAN_OUT, Passes
from hvdtrain.errors import TrainingDiverged
from hvdtrain.startup import process_age_seconds
from hvdtrain.training.loops.checkpointing import CheckpointPlan
from hvdtrain.liveness.watch import Liveness
from hvdtrain.training.loops.run_columns import RunColumnsLog, Throughput, epoch_row, ordered
from hvdtrain.training.step.schedule import PlateauDecay, RateControl
from hvdtrain.training.step.core import TrainingStep
from hvdtrain.artifacts import json_rows


class EpochMetrics(keras.callbacks.Callback):
    """Reset the local metric sums at each epoch's begin (``end_epoch`` reduces them)."""

    def __init__(self, step: TrainingStep) -> None:
        super().__init__()
        self.step = step

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.step.begin_epoch()


class StepPosition(keras.callbacks.Callback):
    """Where training is (epoch and step), for the note a failing step's error gets."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch: int | None = None
        self.batch = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.batch = batch


class DataRanOut(keras.callbacks.Callback):
    """Rank 0: Keras' warning when an epoch ends before ``steps_per_epoch`` because its pass
    over the data ended (``equal_steps.Passes``), as one process's ``fit`` shows it."""

    def __init__(self, passes: Passes) -> None:
        super().__init__()
        self.passes = passes

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.passes.cut_short(epoch):
            warnings.warn(RAN_OUT, stacklevel=2)


class StopOnDivergence(keras.callbacks.Callback):
    """Stop every rank at the step whose global-batch loss is NaN or infinite.

    The step skipped that update on every rank, and no checkpoint is written for the epoch,
    so the newest checkpoint on disk is the last good one.
    """

    def __init__(self, step: TrainingStep, store: CheckpointStore) -> None:
        super().__init__()
        self.step = step
        self.store = store
        self.epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        loss = float(self.step.global_loss.numpy())
        if math.isfinite(loss):
            return
        latest = self.store.latest()
        kept = f"the last good checkpoint {latest} is kept" if latest else "no checkpoint yet"
        how = ("without applying it" if self.step.skips_non_finite_updates else
               "(the model's own train_step had applied it)")
        raise TrainingDiverged(
            f"loss became {loss} at epoch {self.epoch + 1}, step {batch + 1}; stopped on every "
            f"rank {how} ({kept}); lower --learning-rate or check the data for NaN/Inf")


class FirstStepClock(keras.callbacks.Callback):
    """Note when this process's first training step ended: seconds since the process started,
    and the wall-clock (Unix) time, which a launching harness compares with its own start.
    Placed after ``StopOnDivergence``, whose loss read waits for the step to finish."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: float | None = None
        self.unix_time: float | None = None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.seconds is None:
            self.seconds, self.unix_time = process_age_seconds(), time.time()


class LivenessCallback(keras.callbacks.Callback):
    """Tell the rank's ``Liveness`` when each step begins and ends, and when the phase that
    ``end_epoch`` begins (validation and its collectives, rank 0's checkpoint) ends. With a
    stall limit, every rank serves a heartbeat port and learns the others' at train begin (an
    allgather)."""

    def __init__(self, liveness: Liveness, collectives: Collectives) -> None:
        super().__init__()
        self.liveness = liveness
        self.collectives = collectives
        self.in_phase = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.liveness.watches_stalls:
            self.liveness.connect_peers(self.collectives.allgather_object,
                                        self.collectives.world)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.liveness.step_begins()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.liveness.step_ends()

    def step_traces_next(self) -> None:
        """The next step traces the step function again (``--bucket-choice measured``)."""
        self.liveness.next_step_traces()

    def epoch_end_begins(self, epoch: int) -> None:
        self.liveness.phase_begins(f"the end of epoch {epoch + 1} (validation, metrics, "
                                   "checkpoint)")
        self.in_phase = True

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self.in_phase:
            self.liveness.phase_ends()
            self.in_phase = False

    def on_train_end(self, logs: dict | None = None) -> None:
        self.liveness.training_ended()


class TensorBoardEvents(keras.callbacks.Callback):
    """Rank 0 writes every epoch's logs (losses, metrics) and the run's own columns (rate,
    examples/second) as TensorBoard scalars under ``run_dir/tensorboard``."""

    def __init__(self, directory: Path, columns: RunColumnsLog) -> None:
        super().__init__()
        self.writer = tf.summary.create_file_writer(str(directory))
        self.columns = columns

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        with self.writer.as_default(step=epoch + 1):
            for name, value in epoch_row(epoch, logs, self.columns).items():
                tf.summary.scalar(name, value)
        self.writer.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        self.writer.close()


def validates_after(epoch: int, frequency: int | list[int]) -> bool:
    """Keras' ``validation_freq``: every ``frequency``-th epoch, or the epochs (1-based) listed."""
    if isinstance(frequency, int):
        return (epoch + 1) % frequency == 0
    return epoch + 1 in frequency


def batch_values(logs: dict | None) -> str:
    """A progress line's numbers: the loss, or every value a model's own step returns (a GAN
    reports ``d_loss`` and ``g_loss``, no ``loss``)."""
    logs = logs or {}
    shown = {"loss": logs["loss"]} if "loss" in logs else logs
    return "  ".join(f"{name} {float(value):.4f}" for name, value in shown.items())


class MetricsFiles(keras.callbacks.Callback):
    """Rank 0 appends one row per epoch to ``metrics.jsonl`` and ``metrics.csv``: Keras' logs,
    then the run's own columns."""

    def __init__(self, run_dir: Path, columns: RunColumnsLog) -> None:
        super().__init__()
        self.jsonl = run_dir / "metrics.jsonl"
        self.csv = run_dir / "metrics.csv"
        self.columns = columns

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        row = {"epoch": epoch + 1, **epoch_row(epoch, logs, self.columns)}
        with open(self.jsonl, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        new_file = not self.csv.exists()
        with open(self.csv, "a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(row))
            if new_file:
                writer.writeheader()
            writer.writerow(row)


def resume_metrics_files(run_dir: Path, epoch: int, checkpoint_metrics: dict[str, float]) -> None:
    """Make ``MetricsFiles``' files end at ``epoch``, the resumed checkpoint's: drop rows of
    epochs that were lost with the crash, and restore that epoch's row (the run's columns
    included) from the checkpoint if the crash came between saving it and writing the row. No
    epoch appears twice."""
    jsonl = run_dir / "metrics.jsonl"
    rows = [row for row in json_rows(jsonl) if row["epoch"] <= epoch]
    if checkpoint_metrics and (not rows or rows[-1]["epoch"] < epoch):
        rows.append({"epoch": epoch, **checkpoint_metrics})
    atomic_write_text(jsonl, "".join(json.dumps(row) + "\n" for row in rows))
    if rows:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(rows[0]), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(run_dir / "metrics.csv", text.getvalue())


class Progress(keras.callbacks.Callback):
    """Rank 0 of the command line (``hvdtrain.fit`` shows ``KerasConsole`` instead): a progress
    bar with examples/second, then a one-line summary per epoch: Keras' logs, then the run's
    own columns. Epochs and steps come from Keras' ``params``; the bar's rate from the run's
    ``Throughput``."""

    def __init__(self, throughput: Throughput, columns: RunColumnsLog, show_bar: bool,
                 interactive: bool, stream=None) -> None:
        """``interactive``: redraw one line in place (a terminal, no launcher prefixing lines)."""
        super().__init__()
        self.throughput = throughput
        self.columns = columns
        self.show_bar = show_bar
        self.stream = stream or sys.stdout
        self.interactive = interactive
        self.next_report = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.next_report = max(1, self.params["steps"] // 4)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        done, steps = batch + 1, self.params["steps"]
        if not self.show_bar or (not self.interactive and done < self.next_report):
            return
        width = 30
        filled = int(width * done / steps)
        line = (f"  [{'=' * filled}{'.' * (width - filled)}] {done}/{steps} "
                f"{self.throughput.rate():,.0f} ex/s {batch_values(logs)}")
        if self.interactive:
            self.stream.write("\r" + line)
        else:
            self.stream.write(line + "\n")
            while self.next_report <= done:
                self.next_report += max(1, steps // 4)
        self.stream.flush()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.show_bar and self.interactive:
            self.stream.write("\n")
        own = self.columns.columns(epoch)
        rate = own.pop("examples_per_second", 0.0)
        text = "  ".join(f"{name} {value:.4f}" for name, value in ordered(logs).items())
        text += "".join(f"  {name} {value:.5g}" for name, value in own.items())
        self.stream.write(f"epoch {epoch + 1}/{self.params['epochs']}  {text}  {rate:,.0f} "
                          "ex/s\n")
        self.stream.flush()


class KerasConsole(keras.callbacks.ProgbarLogger):
    """``hvdtrain.fit``'s console: Keras' own progress bar (``verbose=1``) or line per epoch
    (``verbose=2``) on rank 0, as ``model.fit(verbose=...)`` shows them. ``hvdtrain.fit`` hands
    it to the run with the user's callbacks; ``standard_callbacks`` takes it out of them and
    fires it last on rank 0, after the epoch end made the logs exact, in place of hvdtrain's own
    ``Progress`` (the command line's). Its ``verbose`` is its own: the ``params`` a loop sets
    do not change it."""

    def __init__(self, verbose: int) -> None:
        super().__init__()
        self.fit_verbose = verbose

    def set_params(self, params: dict) -> None:
        super().set_params({**params, "verbose": self.fit_verbose})


@dataclass(frozen=True)
class Reporting:
    """What rank 0 reports: the run directory's metrics files (and TensorBoard events), the
    progress lines, when the first step ended, and what the tracker is handed (``tracking``:
    ``tracking.live``'s callback, after the metrics files, so a row is on disk first)."""

    run_dir: Path
    global_batch: int
    show_progress: bool
    interactive: bool = False
    tensorboard: bool = False
    first_step: FirstStepClock | None = None
    tracking: keras.callbacks.Callback | None = None


@dataclass(frozen=True)
class CallbackContext:
    """What the callbacks of one run act on (built by the run, for whichever loop trains).
    ``run_columns``: where the run's own columns go (the run keeps it for ``RunResult``);
    ``world_size_column``: they include the world size (an elastic run's, which changes)."""

    collectives: Collectives
    step: TrainingStep
    rates: RateControl
    checkpoints: CheckpointPlan
    reporting: Reporting
    liveness: Liveness | None = None
    # How many steps each epoch has (None: Keras' params["steps"], every epoch alike).
    passes: Passes | None = None
    evaluate: Callable[[], dict[str, float]] | None = None
    validation_freq: int | list[int] = 1
    plateau: PlateauDecay | None = None
    user_callbacks: Sequence[keras.callbacks.Callback] = ()
    run_columns: RunColumnsLog = field(default_factory=RunColumnsLog)
    world_size_column: bool = False


# Keras callbacks that write files or print: on rank 0 only, as one process would write them.
WRITERS = (keras.callbacks.ModelCheckpoint, keras.callbacks.CSVLogger,
           keras.callbacks.TensorBoard, keras.callbacks.BackupAndRestore,
           keras.callbacks.ProgbarLogger, keras.callbacks.RemoteMonitor)


class ChiefOnly(keras.callbacks.Callback):
    """A user's writer callback (``WRITERS``) run by rank 0 alone; the other ranks skip it.
    ``BackupAndRestore`` restores before training (``Run``), so its train-begin load is not
    repeated here."""

    def __init__(self, inner: keras.callbacks.Callback, is_chief: bool) -> None:
        super().__init__()
        self.inner = inner
        self.is_chief = is_chief
        restores = isinstance(inner, keras.callbacks.BackupAndRestore)
        for name in ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
                     "on_train_batch_begin", "on_train_batch_end", "on_test_begin",
                     "on_test_end", "on_test_batch_begin", "on_test_batch_end"):
            skip = not is_chief or (restores and name == "on_train_begin")
            if not skip:
                setattr(self, name, getattr(inner, name))

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        if self.is_chief:     # TensorBoard writes its graph already here
            self.inner.set_model(model)

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        if self.is_chief:
            self.inner.set_params(params)


def rank_aware(callbacks: Sequence[keras.callbacks.Callback],
               world: World) -> list[keras.callbacks.Callback]:
    """The user's callbacks with each writer limited to rank 0 (see ``WRITERS``)."""
    return [ChiefOnly(c, world.is_chief) if isinstance(c, WRITERS) else c for c in callbacks]
