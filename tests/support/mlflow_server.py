"""A real MLflow tracking server for the tracking tests, as a team runs one: ``mlflow server``
from its own virtual environment (``launch/setup.sh --with mlflow`` installs it in
``.venv-mlflow``, apart from the training venv, which has only the client), a SQLite backend
store, artifacts served from a local folder, on a free port of localhost."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from conftest import REPO

SERVER = REPO / ".venv-mlflow" / "bin" / "mlflow"
# Measured: 5-7 s from start to a healthy server on the 2-core VM.
START_TIMEOUT_S = 90
# MLflow 3's server also starts job runners (huey consumers: six Python processes, for its
# GenAI jobs) that took the two cores for 10-30 s at every start; tracking needs none of them.
# Its usage telemetry has no network here.
QUIET = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def mlflow_servers(*folders: Path) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """One server per folder, storing into it, all started at the same time (each spends
    seconds importing before it answers): (its URI, its process, which a test may kill) each."""
    assert SERVER.exists(), f"no MLflow server at {SERVER}: run launch/setup.sh --with mlflow"
    started: list[tuple[str, subprocess.Popen, Path]] = []
    with contextlib.ExitStack() as logs:
        try:
            for folder in folders:
                folder.mkdir(parents=True, exist_ok=True)
                port = free_port()
                log = logs.enter_context(open(folder / "server.log", "w"))
                started.append((f"http://127.0.0.1:{port}", subprocess.Popen(
                    [str(SERVER), "server", "--backend-store-uri",
                     f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination",
                     str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
                     "--workers", "1"],
                    cwd=folder, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, env={**os.environ, "PYTHONPATH": "", **QUIET}),
                    folder))
            deadline = time.time() + START_TIMEOUT_S
            for uri, server, folder in started:
                _wait_healthy(uri, server, folder, deadline)
            yield [(uri, server) for uri, server, _ in started]
        finally:
            for _, server, _ in started:
                if server.poll() is None:  # what it stored is the test's to read, not to keep
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait(20)


def _wait_healthy(uri: str, server: subprocess.Popen, folder: Path, deadline: float) -> None:
    while True:
        assert server.poll() is None, (folder / "server.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        assert time.time() < deadline, "the MLflow server did not start"
        time.sleep(0.3)
