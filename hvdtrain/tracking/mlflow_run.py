"""The one place hvdtrain talks to MLflow: a job's run, created once and continued by every job
that resumes the run directory (its id kept in ``tracking.json`` there), so one job is one run
however often it was preempted. Only ``MlflowClient`` is used, never MLflow's fluent API, so the
user's own active run and MLflow's process-wide state stay as they were.

Metrics go as the run directory holds them: ``metrics.jsonl``'s rows at MLflow step = epoch
(as MLflow's own Keras autologging and hvdtrain's TensorBoard events count), the row's
``epoch`` among them. A job that opens the run sends every row the server lacks or holds
otherwise (``sync_rows``: rows lost to an outage, or epochs trained again after a resume from
an older checkpoint, whose newest value MLflow then shows). Names MLflow refuses are sent with
``_`` for each character it does not take; params longer than its limit are cut.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from hvdtrain.checkpoints.store import atomic_write_text
from hvdtrain.tracking.content import JobFacts

# Where a run directory keeps its MLflow run's id.
RECORD = "tracking.json"
# MLflow's REST limits per logged batch, and on a param's value.
METRICS_PER_BATCH = 1000
PARAMS_PER_BATCH = 100
PARAM_CHARACTERS = 6000
# What MLflow takes in a metric's name (a Keras metric may be named "precision@0.5").
REFUSED_IN_NAMES = re.compile(r"[^\w./\- :]")
# The metric of every epoch row whose history says which epochs the server has.
EPOCH_KEY = "epoch"
# The metric sent every --track-every-steps steps.
STEP_LOSS_KEY = "step_loss"


@dataclass(frozen=True)
class RunRecord:
    """The MLflow run a run directory's jobs send to, on one server."""

    experiment_id: str
    run_id: str


def read_records(run_dir: Path) -> dict[str, RunRecord]:
    """``tracking.json``: the run directory's run on each server it was sent to."""
    try:
        saved = json.loads((run_dir / RECORD).read_text())
        return {uri: RunRecord(**record) for uri, record in saved.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def _write_record(run_dir: Path, uri: str, record: RunRecord) -> None:
    records = {**read_records(run_dir), uri: record}
    atomic_write_text(run_dir / RECORD, json.dumps(
        {name: asdict(each) for name, each in records.items()}, indent=1) + "\n")


def _same(held: float | None, value: float) -> bool:
    """Whether the server holds ``value`` (its SQL store keeps an infinity as the largest
    float; NaN as NaN)."""
    if math.isinf(value):
        value = math.copysign(sys.float_info.max, value)
    return held is not None and (held == value or (math.isnan(held) and math.isnan(value)))


def metric_key(name: str) -> str:
    return REFUSED_IN_NAMES.sub("_", name)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _chunks(items: list, size: int) -> list[list]:
    return [items[start:start + size] for start in range(0, len(items), size)]


def _experiment_id(client: MlflowClient, name: str | None, environ: dict[str, str]) -> str:
    """The experiment named ``name`` (made if new; MLflow's MLFLOW_EXPERIMENT_NAME when None,
    then MLFLOW_EXPERIMENT_ID), else MLflow's Default (id 0)."""
    name = name or environ.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        return environ.get("MLFLOW_EXPERIMENT_ID") or "0"
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:        # another job made it meanwhile
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def keras_autologging() -> list[str]:
    """MLflow's autologging integrations switched on in this process that patch Keras' ``fit``
    (which hvdtrain's fit loop calls on every rank: one MLflow run per rank)."""
    from mlflow.utils.autologging_utils import autologging_is_disabled

    return [name for name in ("tensorflow", "keras") if not autologging_is_disabled(name)]


def _exists(client: MlflowClient, run_id: str) -> bool:
    """Whether the server has the run, not deleted."""
    try:
        return client.get_run(run_id).info.lifecycle_stage != "deleted"
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise


class MlflowRun:
    """One job's MLflow run: ``open`` creates it or continues the run directory's."""

    def __init__(self, client: MlflowClient, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    @classmethod
    def open(cls, run_dir: Path, tracking_uri: str | None, experiment: str | None,
             facts: JobFacts, environ: dict[str, str],
             say: Callable[[str], None]) -> "MlflowRun":
        """The run directory's run when it was sent to this server, else a new one (in
        ``experiment``), with the job's params and tags; ``say``: a line for the user."""
        client = MlflowClient(tracking_uri)
        uri = client.tracking_uri.rstrip("/")
        record = read_records(run_dir).get(uri)
        if record is not None and not _exists(client, record.run_id):
            say(f"MLflow run {record.run_id} of {run_dir} is gone from {uri}; this job starts "
                "a new one")
            record = None
        if record is not None:
            client.update_run(record.run_id, status="RUNNING")
            run = cls(client, record.run_id)
        else:
            experiment_id = _experiment_id(client, experiment, environ)
            created = client.create_run(experiment_id, run_name=facts.name)
            run = cls(client, created.info.run_id)
            _write_record(run_dir, uri, RunRecord(experiment_id, run.run_id))
        run._log_params(facts.params, say)
        run.client.log_batch(run.run_id, tags=[RunTag(k, v) for k, v in facts.tags.items()])
        return run

    def _log_params(self, params: dict[str, str], say: Callable[[str], None]) -> None:
        """The params the run lacks. MLflow keeps a param as first logged, so a resumed job's
        changed option (``--accept-changes``) is named, not sent."""
        logged = self.client.get_run(self.run_id).data.params
        changed = [f"{name} {logged[name]} -> {value}" for name, value in params.items()
                   if name in logged and logged[name] != value[:PARAM_CHARACTERS]]
        if changed:
            say(f"MLflow keeps a run's params as first logged; this job's changes are not "
                f"sent: {', '.join(changed)}")
        missing = [Param(name, value[:PARAM_CHARACTERS]) for name, value in params.items()
                   if name not in logged]
        for chunk in _chunks(missing, PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk)

    def last_step(self, key: str) -> int:
        """The highest step the run has of metric ``key`` (0: none)."""
        return max((metric.step for metric in self.client.get_metric_history(self.run_id, key)),
                   default=0)

    def sync_rows(self, rows: list[dict[str, float]]) -> list[dict[str, float]]:
        """Send the epoch rows the run lacks or holds other values of (its newest value at
        each step counts); return them."""
        newest: dict[str, dict[int, float]] = {}
        for key in {metric_key(name) for row in rows for name, value in row.items()
                    if isinstance(value, (int, float))}:
            history = sorted(self.client.get_metric_history(self.run_id, key),
                             key=lambda metric: metric.timestamp)
            newest[key] = {metric.step: metric.value for metric in history}
        unsent = [row for row in rows if not all(
            _same(newest[metric_key(name)].get(int(row[EPOCH_KEY])), float(value))
            for name, value in row.items() if isinstance(value, (int, float)))]
        self.log_rows(unsent)
        return unsent

    def log_rows(self, rows: list[dict[str, float]]) -> None:
        """Epoch rows as ``metrics.jsonl`` holds them, each at step = its epoch."""
        now = _now_ms()
        metrics = [Metric(metric_key(name), float(value), now, int(row[EPOCH_KEY]))
                   for row in rows for name, value in row.items()
                   if isinstance(value, (int, float))]
        for chunk in _chunks(metrics, METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk)

    def log_step_loss(self, step: int, loss: float) -> None:
        self.client.log_batch(self.run_id, metrics=[Metric(STEP_LOSS_KEY, loss, _now_ms(), step)])

    def log_files(self, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def end(self, status: str) -> None:
        """FINISHED, FAILED or KILLED (a stopped job, which a resumed one sets running)."""
        self.client.set_terminated(self.run_id, status)
