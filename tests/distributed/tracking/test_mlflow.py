"""``--tracking mlflow`` against a real MLflow server (``support/mlflow_server``), read back
through MLflow's own client: a 2-rank job stopped by a signal and resumed is one run, its params
the resolved config, its metrics the run directory's rows exactly and continuous, its step
losses without a repeat, its world as tags, its final files as artifacts; a server killed
mid-run costs one warning line and exit 0, and ``hvdtrain track`` sends that run directory
afterwards; an unreachable server changes nothing a job computes. (A job without the client:
tests/unit/tracking/test_tracking.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest
import yaml
from mlflow import MlflowClient

from conftest import BIN, REPO, RUN_TIMEOUT, rank_env, read_metrics, wait_for
from hvdtrain.tracking.content import job_facts
from jobs import finish, start_wrapper, stop_after_a_step_checkpoint
from mlflow_server import mlflow_servers

pytestmark = pytest.mark.distributed

# 3 deterministic epochs of 45 steps (2 x 16 digits); a step checkpoint every 5 steps, so a
# stop lands mid-epoch. --resume auto in every job: a requeued job reruns its command as is.
ARGS = ["--epochs", "3", "--deterministic", "--hidden-units", "64", "--seed", "5",
        "--batch-size", "16", "--checkpoint-every-steps", "5", "--no-tensorboard",
        "--resume", "auto"]
STEPS_PER_EPOCH = 45
STOPPED = 75
FAILURE_LINE = r"hvdtrain: MLflow tracking at \S+ stopped \("


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> dict[str, tuple[str, subprocess.Popen]]:
    """The module's server and the one the killed-server test kills (``doomed``), started at
    the same time."""
    names = ("main", "doomed")
    folders = [tmp_path_factory.mktemp(f"mlflow-{name}") for name in names]
    with mlflow_servers(*folders) as started:
        yield dict(zip(names, started))


@pytest.fixture(scope="module")
def server(servers) -> str:
    return servers["main"][0]


def tracked(uri: str, experiment: str, *more: str) -> list[str]:
    return ["--tracking", "mlflow", "--tracking-uri", uri, "--experiment", experiment, *more]


def the_one_run(client: MlflowClient, experiment: str):
    """The experiment's only run (a job must be one run)."""
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [run.info.run_name for run in runs]
    return runs[0]


def assert_sent_exactly(client: MlflowClient, run, run_dir, epochs: int) -> None:
    """Params: the run directory's resolved config; every metric of every epoch row, at step =
    its epoch, equal to the row's number; the final files as artifacts, byte for byte in size."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert run.data.params == job_facts(run_dir, config, 2, 1, "", "").params
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == list(range(1, epochs + 1))
    for key in rows[0]:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == [(row["epoch"], float(row[key])) for row in rows], key
    artifacts = {item.path: item.file_size for item in client.list_artifacts(run.info.run_id)}
    assert artifacts == {name: (run_dir / name).stat().st_size
                         for name in ("curves.png", "summary.json", "model.keras")}


def test_a_stopped_and_resumed_two_rank_job_is_one_exact_run(server, tmp_path):
    run_dir = tmp_path / "run"
    args = [*ARGS, *tracked(server, "resumed", "--track-every-steps", "5")]
    code, output = stop_after_a_step_checkpoint(run_dir, *args)
    assert code == STOPPED, output[-3000:]
    client = MlflowClient(server)
    assert the_one_run(client, "resumed").info.status == "KILLED"
    code, output = finish(start_wrapper("mpirun.sh", run_dir, *args, slow=False), RUN_TIMEOUT)
    assert code == 0, output[-3000:]
    assert not re.search(FAILURE_LINE, output), output[-3000:]
    run = the_one_run(client, "resumed")
    assert run.info.status == "FINISHED"
    assert json.loads((run_dir / "tracking.json").read_text())[server]["run_id"] == \
        run.info.run_id
    assert_sent_exactly(client, run, run_dir, 3)
    assert {key: run.data.tags[key] for key in ("hvdtrain.ranks", "hvdtrain.nodes")} == {
        "hvdtrain.ranks": "2", "hvdtrain.nodes": "1"}
    assert run.data.tags["hvdtrain.backend"] in ("horovod", "tensorflow")
    # Every 5th step once: the steps the stop undid were trained again, not sent again.
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "step_loss")]
    assert sorted(steps) == list(range(5, 3 * STEPS_PER_EPOCH + 1, 5))


def test_a_server_killed_mid_run_costs_one_line_and_track_sends_the_run_after(
        servers, server, tmp_path):
    run_dir = tmp_path / "run"
    doomed, process = servers["doomed"]
    # Steps slowed less than a stop test's: the kill comes at train begin, well before the
    # first epoch ends (45 steps of at least 30 ms).
    job = start_wrapper("mpirun.sh", run_dir, *ARGS, "--epochs", "2",
                        *tracked(doomed, "doomed"), HOROVOD_CYCLE_TIME="30")
    try:     # once the run exists on the server: its first epoch's row finds it gone
        wait_for(lambda: (run_dir / "tracking.json").exists() or job.poll() is not None,
                 RUN_TIMEOUT)
        os.killpg(process.pid, signal.SIGKILL)     # the server and its workers
    finally:
        code, output = finish(job, RUN_TIMEOUT)
    assert code == 0, output[-3000:]
    assert len(re.findall(FAILURE_LINE, output)) == 1, output[-3000:]
    assert "Traceback" not in output
    assert (run_dir / "summary.json").exists()
    sent = subprocess.run([str(BIN / "python"), "-m", "hvdtrain", "track", str(run_dir),
                           "--tracking-uri", server, "--experiment", "sent-later"],
                          cwd=tmp_path, env=rank_env(), text=True, capture_output=True,
                          timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    assert sent.returncode == 0, sent.stdout + sent.stderr
    assert "2 epoch row(s), 3 file(s)" in sent.stdout, sent.stdout
    client = MlflowClient(server)
    run = the_one_run(client, "sent-later")
    assert run.info.status == "FINISHED"
    assert_sent_exactly(client, run, run_dir, 2)
    # One run per server: a later --resume auto to either continues its own.
    records = json.loads((run_dir / "tracking.json").read_text())
    assert set(records) == {doomed, server} and records[server]["run_id"] == run.info.run_id


UNREACHABLE = """
import json, os, sys
import numpy as np
import hvdtrain, keras
from sklearn.datasets import load_digits
digits = load_digits()
x, y = digits.data.astype("float32") / 16, digits.target
environment = dict(os.environ)
def trained(**tracking):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    result = hvdtrain.fit(model, x, y, batch_size=32, epochs=2, validation_split=0.2,
                          verbose=0, run_dir=sys.argv[1] + str(len(tracking)), **tracking)
    return model.get_weights(), result.history.history
tracked = trained(tracking="mlflow", tracking_uri="http://127.0.0.1:" + sys.argv[2])
plain = trained()
assert all(np.array_equal(a, b) for a, b in zip(tracked[0], plain[0]))
assert tracked[1] == plain[1], (tracked[1], plain[1])
assert dict(os.environ) == environment
print("same")
"""


def test_an_unreachable_server_changes_nothing_a_job_computes(tmp_path):
    """``hvdtrain.fit`` with tracking to a port nobody serves, then without, in one process:
    equal weights and history, one warning line, and the environment as it was."""
    from mlflow_server import free_port

    # rank_env() carries the telemetry session MLflow set in this process, which MLflow's
    # import in the child takes back: the job must put it back.
    result = subprocess.run([str(BIN / "python"), "-c", UNREACHABLE, str(tmp_path / "run"),
                             str(free_port())], cwd=REPO, env=rank_env(), text=True,
                            capture_output=True, timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and "same" in result.stdout, result.stdout + result.stderr
    assert len(re.findall(FAILURE_LINE, result.stdout + result.stderr)) == 1, result.stderr
