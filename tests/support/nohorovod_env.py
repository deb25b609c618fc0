"""A virtual environment without Horovod, made the way a user makes one: launch/setup.sh.

The TensorFlow-collectives backend must train where Horovod cannot be built, so its tests run
in an environment that has never had Horovod, not in the suite's own (which has it). Making
one costs about half a minute of pip (one core, much of it writing files), so it is made once
per session, and in the background from the moment collection finds a test that needs it
(``start_building``, from conftest): it is ready when that test comes, instead of the test
waiting for it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP_TIMEOUT = 600
FIXTURE = "venv_without_horovod"


class _Build:
    """``launch/setup.sh --no-horovod`` into a fresh venv, running in its own process group."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="hvdtrain-venv-no-horovod-"))
        self.venv = self.directory / "venv"
        self.log = self.directory / "setup.log"
        # The suite's own interpreter version, so the venv takes the same wheels.
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        python = Path(sys.base_prefix) / "bin" / f"python{version}"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                ["bash", str(REPO / "launch" / "setup.sh"), "--no-horovod"], cwd=REPO,
                env=clean_env(HVDTRAIN_VENV=str(self.venv), PYTHON=str(python)), text=True,
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def finished(self, timeout: float) -> Path:
        """The venv's ``bin`` once setup.sh has succeeded; fails the test otherwise."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"setup.sh --no-horovod took over {SETUP_TIMEOUT} s:\n"
                        f"{self.log.read_text()[-3000:]}")
        assert code == 0, f"setup.sh --no-horovod failed:\n{self.log.read_text()[-3000:]}"
        return self.venv / "bin"

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


_BUILDS: list[_Build] = []


def start_building(items: list[pytest.Item]) -> None:
    """Start the venv's build now when one of ``items`` needs it."""
    if not _BUILDS and any(FIXTURE in getattr(item, "fixturenames", ()) for item in items):
        _BUILDS.append(_Build())


def stop_building() -> None:
    """At the session's end: a build still running is ended, and the venv removed."""
    for build in _BUILDS:
        build.stop()
        shutil.rmtree(build.directory, ignore_errors=True)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment minus what would let the suite's own packages (Horovod) leak in."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONPATH", "VIRTUAL_ENV", "HVDTRAIN_GPU", "PYTEST_ADDOPTS")}
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def venv_without_horovod() -> Path:
    """``launch/setup.sh --no-horovod`` into a fresh venv (started at collection's end); its
    ``bin`` directory."""
    if not _BUILDS:            # collected some other way: build it now
        _BUILDS.append(_Build())
    return _BUILDS[0].finished(SETUP_TIMEOUT)
