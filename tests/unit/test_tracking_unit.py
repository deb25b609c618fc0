"""Tracking's parts in one process, no server: which jobs are tracked and which are refused in
one line, and the background sender (in order, off the caller's path, one line on the first
failure and nothing sent after it)."""

from __future__ import annotations

import logging
import sys
import threading

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
    with caplog.at_level(logging.WARNING, logger="hvdtrain"):
        for _ in range(sender.calls.maxsize + 10):
            sender.submit(lambda: None)
    assert len([r for r in caplog.records if "too slow" in r.getMessage()]) == 1
    assert not sender.close(0.2)      # still stuck: the end does not wait past its bound
    release.set()
    sender.thread.join(10)


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
