"""Rank 0's live tracking of a job. Every call to the tracker runs on one background thread, in
order, from a bounded queue: a training step only enqueues (no wait on the server, no extra
device sync: the loss it sends was read for the divergence check already). A failure (a server
unreachable at start or gone mid-run, a refusal) costs one warning line; sending pauses, and at
each epoch's end the run is opened again, which sends the rows it missed (``sync_rows``). The
run directory holds everything in any case, for ``hvdtrain track``."""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Callable, MutableMapping

import keras

from hvdtrain.errors import StoppedBySignal, first_sentence
from hvdtrain.log import logger
from hvdtrain.tracking.content import JobFacts, final_files
from hvdtrain.training.loops.run_columns import RunColumnsLog, epoch_row
from hvdtrain.artifacts import json_rows

# Calls waiting for the server; past this (a server far slower than training) later ones are
# dropped, said once.
QUEUE_CAPACITY = 10_000
# How long the end of a finished job waits for what is still queued (the final files last),
# and of a stopped or failed one (Slurm's grace after a stop signal is 30 s by default).
DRAIN_S = 120.0
STOPPED_DRAIN_S = 10.0
# MLflow's HTTP settings while a job is tracked, where the user set none: a server that is gone
# fails a call in seconds, instead of MLflow's default minutes of retries.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
# MLflow's own variables that its import sets or takes back (its telemetry session); put back
# as they were when the job ends, with the HTTP settings.
MLFLOW_PRIVATE = "_MLFLOW_"


class Sender:
    """One background thread running submitted calls in order; a call that raises is handed
    to ``on_failure`` and the next one runs."""

    def __init__(self, on_failure: Callable[[BaseException], None]) -> None:
        self.calls: queue.Queue[Callable[[], None] | None] = queue.Queue(QUEUE_CAPACITY)
        self.on_failure = on_failure
        self.overflowed = self.closed = False
        self.thread = threading.Thread(target=self._serve, name="hvdtrain-tracking",
                                       daemon=True)
        self.thread.start()

    def submit(self, call: Callable[[], None]) -> None:
        if self.closed:
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
            try:
                call()
            except Exception as error:   # the tracker's failure must never end training
                self.on_failure(error)

    def close(self, timeout: float) -> bool:
        """Let the queued calls run, for at most ``timeout`` seconds in all; True if they did."""
        self.closed = True
        deadline = time.monotonic() + timeout
        try:
            self.calls.put(None, timeout=timeout)
        except queue.Full:
            return False
        self.thread.join(max(0.0, deadline - time.monotonic()))
        return not self.thread.is_alive()


def mlflow_environment(environ: MutableMapping[str, str]) -> dict[str, str | None]:
    """Add ``HTTP_DEFAULTS`` where unset; return what to put back (``restore``): those, and
    MLflow's own variables as they are now."""
    saved: dict[str, str | None] = {name: environ.get(name) for name in HTTP_DEFAULTS}
    saved.update({name: value for name, value in environ.items()
                  if name.startswith(MLFLOW_PRIVATE)})
    environ.update({name: value for name, value in HTTP_DEFAULTS.items() if name not in environ})
    return saved


def restore(environ: MutableMapping[str, str], saved: dict[str, str | None]) -> None:
    for name in [name for name in environ if name.startswith(MLFLOW_PRIVATE)]:
        if name not in saved:
            del environ[name]
    for name, value in saved.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


def failure_reason(error: BaseException) -> str:
    """A failed call's reason in a few words: a connection's error is pages of MLflow's and
    urllib3's words around the system's."""
    system = re.search(r"\[Errno -?\d+\] [^'\")\]]+", str(error))
    return system.group(0) if system else first_sentence(str(error)) or type(error).__name__


class Tracker:
    """One job's tracking on rank 0: the run opened (or continued, with the rows a resumed job's
    server lacks) in the background at once, each epoch's row, the step loss every
    ``every_steps``, and at the end the run's status and final files."""

    def __init__(self, run_dir: Path, tracking_uri: str, experiment: str | None,
                 facts: JobFacts, columns: RunColumnsLog, every_steps: int) -> None:
        """``tracking_uri``: the server (``tracking.server``)."""
        self.run_dir, self.columns, self.every_steps = run_dir, columns, every_steps
        self.where = tracking_uri
        self._reopen = lambda: self._open(tracking_uri, experiment, facts)
        # The sender thread's alone: the MlflowRun while the server answers; whether a failure
        # came (and was said) since it last answered; whether the server refused for good.
        self.run = None
        self.down = self.refused = False
        self.sent_epoch = self.sent_step = 0
        self._saved_environment = mlflow_environment(os.environ)
        self.sender = Sender(self._failed)
        self.sender.submit(self._reopen)

    def _open(self, tracking_uri: str, experiment: str | None, facts: JobFacts) -> None:
        """Open the run and send the rows it lacks (``metrics.jsonl`` as the resume left it)."""
        from hvdtrain.tracking.mlflow_run import STEP_LOSS_KEY, MlflowRun

        run = MlflowRun.open(self.run_dir, tracking_uri, experiment, facts, dict(os.environ),
                             logger.warning)
        rows = json_rows(self.run_dir / "metrics.jsonl")
        run.sync_rows(rows)
        self.sent_epoch = rows[-1]["epoch"] if rows else 0
        if self.sent_step == 0:     # a resumed job: the steps the server has (once)
            self.sent_step = run.last_step(STEP_LOSS_KEY)
        if self.down:            # a later outage is said again
            logger.warning(f"MLflow tracking at {self.where} is back: run {run.run_id} "
                           "continued, the epochs it missed sent")
        else:
            logger.info(f"tracking: MLflow run {run.run_id} at {self.where}")
        self.run, self.down = run, False

    def _failed(self, error: BaseException) -> None:
        # A refusal (a name or value MLflow does not take) would fail the same way again.
        self.refused = getattr(error, "error_code", None) == "INVALID_PARAMETER_VALUE"
        again = ("the server refused it, so tracking ends for this job" if self.refused else
                 "it tries again at each epoch's end")
        if not self.down:
            logger.warning(f"MLflow tracking at {self.where} stopped ({failure_reason(error)}); "
                           f"training goes on, {again}, and {self.run_dir} keeps every metric "
                           f"and file (hvdtrain track {self.run_dir} sends them later)")
        self.run, self.down = None, True

    def _reopen_if_down(self) -> None:
        """After a failure (not a refusal): the run opened again, sending what it missed."""
        if self.run is None and not self.refused:
            self._reopen()

    def _while_up(self, call: Callable[[], None]) -> Callable[[], None]:
        """``call`` if the run is open when its turn comes; nothing while the server is down."""
        return lambda: None if self.run is None else call()

    def _send_row(self, row: dict) -> None:
        if row["epoch"] > self.sent_epoch:
            self.run.log_rows([row])
            self.sent_epoch = row["epoch"]

    def _send_step_loss(self, step: int, loss: float) -> None:
        if step > self.sent_step:
            self.run.log_step_loss(step, loss)
            self.sent_step = step

    def epoch_ended(self, epoch: int, logs: dict) -> None:
        """Epoch ``epoch``'s row, as ``MetricsFiles`` wrote it to ``metrics.jsonl`` (after a
        failure: the run opened again, which sends it with the others missed)."""
        self.sender.submit(self._reopen_if_down)
        row = {"epoch": epoch + 1, **epoch_row(epoch, logs, self.columns)}
        self.sender.submit(self._while_up(lambda: self._send_row(row)))

    def step_ended(self, step: int, loss: float) -> None:
        self.sender.submit(self._while_up(lambda: self._send_step_loss(step, loss)))

    def close(self, error: BaseException | None) -> None:
        """End the run as finished (then send the final files), killed by a stop (a resumed job
        sets it running again) or failed, waiting a bounded time for what is queued."""
        status = ("FINISHED" if error is None else
                  "KILLED" if isinstance(error, StoppedBySignal) else "FAILED")
        self.sender.submit(self._reopen_if_down)
        self.sender.submit(self._while_up(lambda: self.run.end(status)))
        if error is None:
            self.sender.submit(self._while_up(
                lambda: self.run.log_files(final_files(self.run_dir))))
        bound = DRAIN_S if error is None else STOPPED_DRAIN_S
        try:
            if not self.sender.close(bound):
                logger.warning(f"MLflow tracking at {self.where} did not finish within "
                               f"{bound:.0f} s; send the rest with hvdtrain track "
                               f"{self.run_dir}")
        finally:
            restore(os.environ, self._saved_environment)

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
