"""The one place hvdtrain talks to MLflow: a job's run, created once and continued by every job
that resumes the run directory (its id kept in ``tracking.json`` there), so one job is one run
however often it was preempted. Only ``MlflowClient`` is used, never MLflow's fluent API, so the
user's own active run and MLflow's process-wide state stay as they were.

Metrics go as the run directory holds them: ``metrics.jsonl``'s rows at MLflow step = epoch
(as MLflow's own Keras autologging and hvdtrain's TensorBoard events count), the row's
``epoch`` among them, which also tells a resumed job which rows the server already has.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from hvdtrain.checkpoint import atomic_write_text
from hvdtrain.tracking.content import JobFacts

# Where a run directory keeps its MLflow run's id.
RECORD = "tracking.json"
# MLflow's REST limits per logged batch.
METRICS_PER_BATCH = 1000
PARAMS_PER_BATCH = 100
# The metric of every epoch row whose history says which epochs the server has.
EPOCH_KEY = "epoch"
# The metric sent every --track-every-steps steps.
STEP_LOSS_KEY = "step_loss"


@dataclass(frozen=True)
class RunRecord:
    """``tracking.json``: the MLflow run a run directory's jobs send to."""

    tracking_uri: str
    experiment_id: str
    run_id: str


def read_record(run_dir: Path) -> RunRecord | None:
    try:
        return RunRecord(**json.loads((run_dir / RECORD).read_text()))
    except (OSError, ValueError, TypeError):
        return None


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
        uri = client.tracking_uri
        record = read_record(run_dir)
        if record is not None and record.tracking_uri != uri:
            say(f"{run_dir} was tracked in MLflow run {record.run_id} at {record.tracking_uri}; "
                f"this job sends to {uri}, as a new run")
            record = None
        if record is not None:
            client.update_run(record.run_id, status="RUNNING")
            run = cls(client, record.run_id)
        else:
            experiment_id = _experiment_id(client, experiment, environ)
            created = client.create_run(experiment_id, run_name=facts.name)
            run = cls(client, created.info.run_id)
            atomic_write_text(run_dir / RECORD, json.dumps(asdict(RunRecord(
                uri, experiment_id, run.run_id))) + "\n")
        run._log_params(facts.params, say)
        run.client.log_batch(run.run_id, tags=[RunTag(k, v) for k, v in facts.tags.items()])
        return run

    def _log_params(self, params: dict[str, str], say: Callable[[str], None]) -> None:
        """The params the run lacks. MLflow keeps a param as first logged, so a resumed job's
        changed option (``--accept-changes``) is named, not sent."""
        logged = self.client.get_run(self.run_id).data.params
        changed = [f"{name} {logged[name]} -> {value}" for name, value in params.items()
                   if name in logged and logged[name] != value]
        if changed:
            say(f"MLflow keeps a run's params as first logged; this job's changes are not "
                f"sent: {', '.join(changed)}")
        missing = [Param(name, value) for name, value in params.items() if name not in logged]
        for chunk in _chunks(missing, PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk)

    def last_step(self, key: str) -> int:
        """The highest step the run has of metric ``key`` (0: none)."""
        return max((metric.step for metric in self.client.get_metric_history(self.run_id, key)),
                   default=0)

    def log_rows(self, rows: list[dict[str, float]]) -> None:
        """Epoch rows as ``metrics.jsonl`` holds them, each at step = its epoch."""
        now = _now_ms()
        metrics = [Metric(key, float(value), now, int(row[EPOCH_KEY]))
                   for row in rows for key, value in row.items()
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
