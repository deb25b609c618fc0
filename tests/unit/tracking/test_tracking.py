"""Tracking's parts in one process, no server: which jobs are tracked and which are refused in
one line; the background sender (in order, off the caller's path, a failure handed over); the
rows a run is sent when it opens (what the server lacks or holds otherwise); and a tracker whose
server goes away and comes back (one line each way, the rows it missed sent, the run ended),
against a stand-in for MLflow's client."""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from hvdtrain.config import ConfigError, build_config
from hvdtrain.tracking import check_tracking, wanted
from hvdtrain.tracking.content import job_facts, param_text
from hvdtrain.tracking.live import HTTP_DEFAULTS, Sender, mlflow_environment, restore

SERVER = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}


def test_auto_tracks_where_a_server_is_named_and_mlflow_always():
    assert not wanted(build_config({}), SERVER)            # the default: none
    assert not wanted(build_config({"tracking": "auto"}), {})
    assert wanted(build_config({"tracking": "auto"}), SERVER)
    assert wanted(build_config({"tracking": "auto", "tracking_uri": "http://h:1"}), {})
    assert not wanted(build_config({"tracking": "auto", "elastic": True, "run_dir": "r"}), SERVER)
    assert wanted(build_config({"tracking": "mlflow"}), {})


@pytest.mark.parametrize("options, environ, message", [
    ({"tracking": "mlflow"}, {}, "--tracking mlflow needs the server: --tracking-uri "
                                 "http://HOST:PORT, or MLflow's MLFLOW_TRACKING_URI"),
    ({"tracking": "mlflow", "elastic": True, "run_dir": "r"}, SERVER,
     "--tracking cannot follow an --elastic job"),
    ({"tracking": "mlflow", "autotune": True}, SERVER, "--autotune trains nothing to track"),
])
def test_a_job_that_cannot_be_tracked_is_refused_in_one_line(options, environ, message):
    with pytest.raises(ConfigError) as refused:
        check_tracking(build_config(options), environ)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_without_the_client_the_line_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)     # as in a venv without the extra
    with pytest.raises(ConfigError, match=r"^--tracking auto needs the MLflow client: pip "
                                          r"install 'hvdtrain\[mlflow\]' \(or launch/setup.sh "
                                          r"--with mlflow\)$"):
        check_tracking(build_config({"tracking": "auto"}), SERVER)
    check_tracking(build_config({"tracking": "auto"}), {})    # auto without a server: untracked


def test_params_are_the_config_as_written_and_tags_the_world(tmp_path):
    config = build_config({"hidden_units": [8, 4], "learning_rate": 0.5}).to_dict()
    facts = job_facts(tmp_path / "run-1", config, 4, 2, "horovod", "CPU")
    assert facts.name == "run-1"
    assert facts.params["hidden_units"] == "[8, 4]" and facts.params["learning_rate"] == "0.5"
    assert facts.params["model"] == "mlp" and facts.params["run_dir"] == "null"
    assert facts.params["tensorboard"] == "true"
    assert len(facts.params) == sum(len(section) for section in config.values())
    assert facts.tags["hvdtrain.ranks"] == "4" and facts.tags["hvdtrain.nodes"] == "2"
    assert param_text("a b") == "a b"


def test_the_sender_runs_calls_in_order_off_the_callers_thread():
    seen, threads = [], set()
    sender = Sender(lambda error: pytest.fail(str(error)))
    for number in range(100):
        sender.submit(lambda number=number: (seen.append(number),
                                             threads.add(threading.get_ident())))
    assert sender.close(10)
    assert seen == list(range(100)) and threads == {sender.thread.ident}
    assert sender.thread.ident != threading.get_ident()


def test_a_failed_call_is_handed_over_and_the_next_one_runs():
    failures, sent = [], []

    def fail() -> None:
        raise ConnectionError("[Errno 111] Connection refused")

    sender = Sender(failures.append)
    sender.submit(lambda: sent.append(1))
    sender.submit(fail)
    sender.submit(lambda: sent.append(2))
    assert sender.close(10)
    sender.submit(lambda: sent.append(3))       # after close: dropped, never run
    assert sent == [1, 2] and [str(error) for error in failures] == [
        "[Errno 111] Connection refused"]


def test_a_blocked_server_never_blocks_the_caller(caplog):
    """A call stuck (a server that does not answer): submissions still return at once; past
    the queue's capacity they are dropped, said in one warning."""
    release = threading.Event()
    sender = Sender(lambda error: None)
    sender.submit(release.wait)
    caller = threading.Thread(target=lambda: [sender.submit(lambda: None)
                                              for _ in range(sender.calls.maxsize + 10)])
    with caplog.at_level(logging.WARNING, logger="hvdtrain"):
        caller.start()
        caller.join(10)
    assert not caller.is_alive(), "a submission waited for the stuck call"
    assert len([r for r in caplog.records if "too slow" in r.getMessage()]) == 1
    assert not sender.close(0.2)      # still stuck: the end does not wait past its bound
    release.set()
    sender.calls.put(None)            # the end its close could not queue
    sender.thread.join(10)
    assert not sender.thread.is_alive()


def test_mlflows_variables_are_put_back_as_they_were():
    """The HTTP settings fill only what the user left unset, and MLflow's own variables (its
    import sets or takes back its telemetry session) end as they began."""
    environ = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "300", "_MLFLOW_SESSION": "a", "PATH": "/bin"}
    before = dict(environ)
    saved = mlflow_environment(environ)
    assert environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "300"
    assert environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == HTTP_DEFAULTS[
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
    del environ["_MLFLOW_SESSION"]
    environ["_MLFLOW_OTHER"] = "b"
    restore(environ, saved)
    assert environ == before


class FakeClient:
    """MLflow's client as ``MlflowRun`` uses it: metric histories kept in memory."""

    def __init__(self) -> None:
        self.metrics: list = []

    def get_metric_history(self, run_id: str, key: str) -> list:
        return [metric for metric in self.metrics if metric.key == key]

    def log_batch(self, run_id: str, metrics=(), params=(), tags=()) -> None:
        self.metrics += [SimpleNamespace(key=m.key, value=m.value, step=m.step,
                                         timestamp=m.timestamp) for m in metrics]


def test_a_run_is_sent_the_rows_it_lacks_or_holds_otherwise():
    """Rows the server has (an infinity as its SQL store keeps it, NaN) are not sent again;
    a missing row and an epoch trained again are; names MLflow refuses travel with _."""
    pytest.importorskip("mlflow")    # the extra: make test installs it
    from hvdtrain.tracking.mlflow_run import MlflowRun

    client = FakeClient()
    run = MlflowRun(client, "run")
    first = [{"epoch": 1, "loss": math.inf, "precision@0.5": math.nan},
             {"epoch": 2, "loss": 0.5, "precision@0.5": 0.25}]
    run.log_rows(first)
    for metric in client.metrics:      # what the SQL store gives back for an infinity
        if math.isinf(metric.value):
            metric.value = sys.float_info.max
    assert {m.key for m in client.metrics} == {"epoch", "loss", "precision_0.5"}
    time.sleep(0.002)                  # a later timestamp: the newest value
    again = [*first, {"epoch": 3, "loss": 0.25, "precision@0.5": 0.5}]
    assert run.sync_rows(again) == [again[2]]
    retrained = [first[0], {"epoch": 2, "loss": 0.4, "precision@0.5": 0.25}]
    assert run.sync_rows(retrained) == [retrained[1]]
    assert run.sync_rows(retrained) == []          # its newest value at step 2 is now 0.4


class FakeRun:
    """An open MLflow run on a server that answers while ``server["up"]``, recording what it is
    sent."""

    def __init__(self, server: dict, sent: list) -> None:
        self.run_id, self.server, self.sent = "run", server, sent

    def _answer(self) -> None:
        if not self.server["up"]:
            raise ConnectionError("[Errno 104] Connection reset by peer")

    def sync_rows(self, rows: list) -> list:
        self.sent.append(("sync", [row["epoch"] for row in rows]))
        return rows

    def last_step(self, key: str) -> int:
        return 0

    def log_rows(self, rows: list) -> None:
        self._answer()
        self.sent.append(("rows", [row["epoch"] for row in rows]))

    def end(self, status: str) -> None:
        self.sent.append(("end", status))

    def log_files(self, paths: list) -> None:
        self.sent.append(("files", sorted(path.name for path in paths)))


def test_a_server_that_goes_and_comes_back_costs_a_line_each_way(tmp_path, monkeypatch,
                                                                 caplog):
    pytest.importorskip("mlflow")
    from hvdtrain.tracking import mlflow_run
    from hvdtrain.tracking.live import Tracker
    from hvdtrain.training.loops.run_columns import RunColumnsLog

    server, sent = {"up": True}, []

    def open_run(*args, **kwargs):
        if not server["up"]:
            raise ConnectionError("[Errno 111] Connection refused")
        return FakeRun(server, sent)

    monkeypatch.setattr(mlflow_run.MlflowRun, "open", open_run)
    (tmp_path / "summary.json").write_text("{}")

    def drained(tracker: Tracker) -> None:
        """Wait until the sender has done what was queued."""
        done = threading.Event()
        tracker.sender.submit(done.set)
        assert done.wait(10)

    def epoch_ends(tracker: Tracker, epoch: int) -> None:
        """As the run does: MetricsFiles' row on disk, then the tracker's."""
        with open(tmp_path / "metrics.jsonl", "a") as rows:
            rows.write(json.dumps({"epoch": epoch + 1, "loss": 1.0 / (epoch + 1)}) + "\n")
        tracker.epoch_ended(epoch, {"loss": 1.0 / (epoch + 1)})
        drained(tracker)

    with caplog.at_level(logging.INFO, logger="hvdtrain"):
        tracker = Tracker(tmp_path, "http://127.0.0.1:1", None,
                          job_facts(tmp_path, {}, 2, 1, "horovod", "CPU"), RunColumnsLog(), 0)
        drained(tracker)             # opened before the first epoch ends, as in a run
        epoch_ends(tracker, 0)
        server["up"] = False
        epoch_ends(tracker, 1)       # its row fails: one line
        epoch_ends(tracker, 2)       # tried again at the epoch's end: no second line
        server["up"] = True
        tracker.close(None)          # back: the run reopened, its missed rows sent, ended
    lines = [record.getMessage() for record in caplog.records]
    assert len([line for line in lines if "stopped ([Errno 104] Connection reset" in line]) == 1
    assert len([line for line in lines if "stopped" in line]) == 1
    assert len([line for line in lines if "is back" in line]) == 1
    assert sent == [("sync", []), ("rows", [1]), ("sync", [1, 2, 3]), ("end", "FINISHED"),
                    ("files", ["summary.json"])]


def test_mlflows_keras_autologging_is_named_in_one_line(monkeypatch, caplog):
    """It patches Keras' fit, which every rank calls: one run per rank. MLflow is looked at
    only where the program imported it."""
    pytest.importorskip("mlflow")
    from mlflow.utils import autologging_utils

    from hvdtrain.tracking import warn_about_autologging

    with caplog.at_level(logging.WARNING, logger="hvdtrain"):
        warn_about_autologging(sys.modules)                 # imported, not switched on
        warn_about_autologging({})                          # not imported: not looked at
        monkeypatch.setitem(autologging_utils.AUTOLOGGING_INTEGRATIONS, "tensorflow",
                            {"disable": False})
        warn_about_autologging({})
        assert not caplog.records
        warn_about_autologging(sys.modules)
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith("mlflow.tensorflow.autolog() is on: it logs one MLflow run per rank")
