"""Experiment tracking (``--tracking``): rank 0 alone sends one job to one MLflow run, the other
ranks never talk to the tracker. ``mlflow_run`` is the only module that imports MLflow (an
optional extra: ``pip install 'hvdtrain[mlflow]'``), and only on rank 0 of a tracked job;
``live`` sends off the training step's path; ``upload`` is ``hvdtrain track RUN_DIR``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Mapping

from hvdtrain.config import Config, ConfigError
from hvdtrain.log import logger

INSTALL = "pip install 'hvdtrain[mlflow]' (or launch/setup.sh --with mlflow)"


def server(tracking_uri: str | None, environ: Mapping[str, str]) -> str | None:
    """The server named by ``--tracking-uri`` or MLflow's MLFLOW_TRACKING_URI."""
    return tracking_uri or environ.get("MLFLOW_TRACKING_URI") or None


def wanted(config: Config, environ: Mapping[str, str]) -> bool:
    """Whether this job is tracked: ``mlflow``, or ``auto`` where a server is named (and the job
    is not elastic)."""
    tracking = config.tracking
    if tracking.tracking == "auto":
        return not config.train.elastic and server(tracking.tracking_uri, environ) is not None
    return tracking.tracking == "mlflow"


def check_tracking(config: Config, environ: Mapping[str, str]) -> None:
    """Refuse, in one line, a tracked job that cannot be: no MLflow client, no server named, an
    elastic job (whose rank 0 may change)."""
    tracking = config.tracking
    if not wanted(config, environ):
        return
    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError(f"--tracking {tracking.tracking} needs the MLflow client: {INSTALL}")
    if not server(tracking.tracking_uri, environ):
        raise ConfigError("--tracking mlflow needs the server: --tracking-uri "
                          "http://HOST:PORT, or MLflow's MLFLOW_TRACKING_URI")
    if config.train.autotune and tracking.tracking == "mlflow":
        raise ConfigError("--autotune trains nothing to track; leave out --tracking mlflow")
    if config.train.elastic:
        raise ConfigError("--tracking cannot follow an --elastic job (its rank 0 may change); "
                          "send its run directory after it ends: hvdtrain track RUN_DIR")


def warn_about_autologging(modules: Mapping[str, object]) -> None:
    """One line where the program switched on MLflow's Keras autologging (``modules``: the
    process's ``sys.modules``; MLflow is looked at only where the program imported it)."""
    if "mlflow" not in modules:
        return
    from hvdtrain.tracking.mlflow_run import keras_autologging

    integrations = keras_autologging()
    if integrations:
        logger.warning(f"mlflow.{integrations[0]}.autolog() is on: it logs one MLflow run per "
                       "rank; turn it off (mlflow.autolog(disable=True)) and track the job "
                       "with --tracking mlflow (tracking='mlflow'), rank 0's one run")


def start_tracking(config: Config, run_dir: Path, ranks: int, nodes: int, backend: str,
                   device: str, columns, environ: Mapping[str, str]):
    """Rank 0's ``live.Tracker`` for a tracked job (checked by ``check_tracking``), else None
    (said in one line where a server was named for an untracked job)."""
    if not wanted(config, environ):
        if config.tracking.tracking_uri:
            how = ("the job is elastic: send its run directory when it ends with hvdtrain "
                   "track RUN_DIR" if config.train.elastic else
                   f"--tracking is {config.tracking.tracking}: add --tracking mlflow")
            logger.warning(f"--tracking-uri {config.tracking.tracking_uri} is not used: {how}")
        return None
    from hvdtrain.tracking.content import job_facts
    from hvdtrain.tracking.live import Tracker

    tracking = config.tracking
    facts = job_facts(run_dir, config.to_dict(), ranks, nodes, backend, device)
    return Tracker(run_dir, server(tracking.tracking_uri, environ), tracking.experiment, facts,
                   columns, tracking.track_every_steps)
