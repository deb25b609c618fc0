"""Rank 0's live tracking of a job. Every call to the tracker runs on one background thread, in
order, from a bounded queue: a training step only enqueues (no wait on the server, no extra
device sync: the loss it sends was read for the divergence check already). The first failure
(a server unreachable at start or gone mid-run, a refusal) costs one warning line and ends the
sending for this job; the run directory still holds everything, for ``hvdtrain track``."""

from __future__ import annotations

import os
import queue
import re
import threading
from pathlib import Path
from typing import Callable, MutableMapping

import keras

from hvdtrain.errors import StoppedBySignal, first_sentence
from hvdtrain.log import logger
from hvdtrain.tracking.content import JobFacts, final_files
from hvdtrain.training.run_columns import RunColumnsLog, epoch_row
from hvdtrain.writes import json_rows

# Calls waiting for the server; past this (a server far slower than training) later ones are
# dropped, said once.
QUEUE_CAPACITY = 10_000
# How long the job's end waits for what is still queued (the final files among it).
DRAIN_S = 120.0
# MLflow's HTTP settings while a job is tracked, where the user set none: a server that is gone
# fails a call in seconds, instead of MLflow's default minutes of retries.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


class Sender:
    """One background thread running submitted calls in order; after one fails, the rest are
    dropped (``failed``) and ``on_failure`` has said why, once."""

    def __init__(self, on_failure: Callable[[BaseException], None]) -> None:
        self.calls: queue.Queue[Callable[[], None] | None] = queue.Queue(QUEUE_CAPACITY)
        self.on_failure = on_failure
        self.failed = self.overflowed = False
        self.thread = threading.Thread(target=self._serve, name="hvdtrain-tracking",
                                       daemon=True)
        self.thread.start()

    def submit(self, call: Callable[[], None]) -> None:
        if self.failed:
            return
        try:
            self.calls.put_nowait(call)
        except queue.Full:
            if not self.overflowed:
                logger.warning("the tracker is too slow to keep up with training; what it "
                               "misses is in the run directory (hvdtrain track sends it)")
            self.overflowed = True

    def _serve(self) -> None:
        while (call := self.calls.get()) is not None:
            if self.failed:
                continue
            try:
                call()
            except Exception as error:   # the tracker's failure must never end training
                self.failed = True
                self.on_failure(error)

    def close(self, timeout: float) -> bool:
        """Let the queued calls run (for at most ``timeout`` seconds); True if they all did."""
        try:
            self.calls.put(None, timeout=timeout)
        except queue.Full:
            return False
        self.thread.join(timeout)
        return not self.thread.is_alive()


def add_http_defaults(environ: MutableMapping[str, str]) -> list[str]:
    """``HTTP_DEFAULTS`` where unset; returns the names added, for ``close`` to remove."""
    added = [name for name in HTTP_DEFAULTS if name not in environ]
    environ.update({name: HTTP_DEFAULTS[name] for name in added})
    return added


class Tracker:
    """One job's tracking on rank 0: the run opened (or continued, with the rows a resumed job's
    server lacks) in the background at once, each epoch's row, the step loss every
    ``every_steps``, the final files, and the run's end."""

    def __init__(self, run_dir: Path, tracking_uri: str | None, experiment: str | None,
                 facts: JobFacts, columns: RunColumnsLog, every_steps: int) -> None:
        self.run_dir, self.columns, self.every_steps = run_dir, columns, every_steps
        self.where = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        self.run = None
        self.sent_epoch = self.sent_step = 0
        self._added_environment = add_http_defaults(os.environ)
        self.sender = Sender(self._failed)
        self.sender.submit(lambda: self._open(tracking_uri, experiment, facts))

    def _open(self, tracking_uri: str | None, experiment: str | None, facts: JobFacts) -> None:
        from hvdtrain.tracking.mlflow_run import EPOCH_KEY, STEP_LOSS_KEY, MlflowRun

        self.run = MlflowRun.open(self.run_dir, tracking_uri, experiment, facts,
                                  dict(os.environ), logger.warning)
        self.sent_epoch = self.run.last_step(EPOCH_KEY)
        self.sent_step = self.run.last_step(STEP_LOSS_KEY)
        logger.info(f"tracking: MLflow run {self.run.run_id} at {self.where}")
        self._send_rows(json_rows(self.run_dir / "metrics.jsonl"))

    def _failed(self, error: BaseException) -> None:
        # A connection's error is pages of MLflow's and urllib3's words around the system's.
        system = re.search(r"\[Errno -?\d+\] [^'\")\]]+", str(error))
        reason = (system.group(0) if system else first_sentence(str(error))
                  or type(error).__name__)
        logger.warning(f"MLflow tracking at {self.where} stopped ({reason}); training goes on, "
                       f"and {self.run_dir} keeps every metric and file: send them later with "
                       f"hvdtrain track {self.run_dir}")

    def _send_rows(self, rows: list[dict]) -> None:
        new = [row for row in rows if row["epoch"] > self.sent_epoch]
        if new:
            self.run.log_rows(new)
            self.sent_epoch = new[-1]["epoch"]

    def _send_step_loss(self, step: int, loss: float) -> None:
        if step > self.sent_step:
            self.run.log_step_loss(step, loss)
            self.sent_step = step

    def epoch_ended(self, epoch: int, logs: dict) -> None:
        """Epoch ``epoch``'s row, as ``MetricsFiles`` wrote it to ``metrics.jsonl``."""
        row = {"epoch": epoch + 1, **epoch_row(epoch, logs, self.columns)}
        self.sender.submit(lambda: self._send_rows([row]))

    def step_ended(self, step: int, loss: float) -> None:
        self.sender.submit(lambda: self._send_step_loss(step, loss))

    def files_written(self) -> None:
        """Rank 0's final files are on disk: send them."""
        self.sender.submit(lambda: self.run.log_files(final_files(self.run_dir)))

    def close(self, error: BaseException | None) -> None:
        """End the run (finished, killed by a stop, or failed) once what is queued is sent."""
        status = ("FINISHED" if error is None else
                  "KILLED" if isinstance(error, StoppedBySignal) else "FAILED")
        self.sender.submit(lambda: self.run.end(status))
        try:
            if not self.sender.close(DRAIN_S):
                logger.warning(f"MLflow tracking at {self.where} did not finish within "
                               f"{DRAIN_S:.0f} s; send the rest with hvdtrain track "
                               f"{self.run_dir}")
        finally:
            for name in self._added_environment:
                os.environ.pop(name, None)

    def callback(self, global_loss: Callable[[], float]) -> keras.callbacks.Callback:
        """The run's callback (after ``MetricsFiles``); ``global_loss``: the step's exact loss."""
        return TrackingHooks(self, global_loss)


class TrackingHooks(keras.callbacks.Callback):
    """Hands the tracker each epoch's row and, every ``every_steps`` steps (counted as epoch
    x steps per epoch + step), the step's global-batch loss."""

    def __init__(self, tracker: Tracker, global_loss: Callable[[], float]) -> None:
        super().__init__()
        self.tracker, self.global_loss = tracker, global_loss
        self.epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        every = self.tracker.every_steps
        step = self.epoch * self.params["steps"] + batch + 1
        if every and step % every == 0:
            self.tracker.step_ended(step, self.global_loss())

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.tracker.epoch_ended(epoch, logs or {})
