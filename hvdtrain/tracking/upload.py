"""``hvdtrain track RUN_DIR``: send a run directory to MLflow after the fact: a job whose server
was down, or one trained without ``--tracking``. It continues the run the directory was tracked
in (``tracking.json``) when that run is on the same server, so only what the server lacks is
added (rows by epoch, params by name), and ends it finished when the job wrote its summary,
else as stopped. The step losses of ``--track-every-steps`` live only on the server."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import yaml

from hvdtrain.errors import UserError
from hvdtrain.tracking import INSTALL, server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory to send")
    parser.add_argument("--tracking-uri", help="the MLflow tracking server (default: MLflow's "
                                               "MLFLOW_TRACKING_URI)")
    parser.add_argument("--experiment", help="MLflow experiment for a new run (default: "
                                             "MLflow's MLFLOW_EXPERIMENT_NAME, else Default)")


def _read(run_dir: Path) -> tuple[dict, dict]:
    """The run directory's resolved config and (empty until the job ends) summary."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as error:
        raise UserError(f"{run_dir} is not an hvdtrain run directory (config.yaml: "
                        f"{getattr(error, 'strerror', None) or error}); give the --run-dir "
                        "of a job") from error
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return config, summary


def track(args: argparse.Namespace) -> int:
    """Send ``args.run_dir`` to MLflow; print what was sent. A server that fails is one line
    (with MLflow's HTTP settings of a live job: seconds, not minutes of retries)."""
    run_dir = Path(args.run_dir)
    config, summary = _read(run_dir)
    uri = server(args.tracking_uri, os.environ)
    if not uri:
        raise UserError("hvdtrain track needs the server: --tracking-uri http://HOST:PORT, or "
                        "MLflow's MLFLOW_TRACKING_URI")
    try:
        from hvdtrain.tracking.mlflow_run import MlflowRun
    except ImportError as error:
        raise UserError(f"hvdtrain track needs the MLflow client: {INSTALL}") from error
    from hvdtrain.tracking.content import final_files, job_facts
    from hvdtrain.tracking.live import failure_reason, mlflow_environment, restore
    from hvdtrain.artifacts import json_rows

    ranks = summary.get("ranks") or [{}]
    facts = job_facts(run_dir, config, summary.get("world_size", 0),
                      ranks[0].get("cross_size", 0), summary.get("backend", ""),
                      summary.get("device", ""))
    saved = mlflow_environment(os.environ)
    try:
        run = MlflowRun.open(run_dir, uri, args.experiment, facts, dict(os.environ), print)
        rows = run.sync_rows(json_rows(run_dir / "metrics.jsonl"))
        files = final_files(run_dir) if summary else []
        run.end("FINISHED" if summary else "KILLED")
        run.log_files(files)
    except Exception as error:   # MLflow's and the connection's errors alike
        raise UserError(f"MLflow at {uri} failed ({failure_reason(error)}); nothing is lost: "
                        "run hvdtrain track again once it answers") from error
    finally:
        restore(os.environ, saved)
    print(f"sent {run_dir} to MLflow run {run.run_id} at {uri}: {len(rows)} epoch row(s), "
          f"{len(files)} file(s)" + ("" if summary else "; the job has not finished (no "
                                     "summary.json), so the run is marked stopped"))
    return 0
