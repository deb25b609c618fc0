"""A virtual environment without Horovod, made the way a user makes one: launch/setup.sh.

The TensorFlow-collectives backend must train where Horovod cannot be built, so its tests run
in an environment that has never had Horovod, not in the suite's own (which has it). Making
one costs about half a minute with pip's cache warm, so it is made once per session.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP_TIMEOUT = 600


def clean_env(**extra: str) -> dict[str, str]:
    """This environment minus what would let the suite's own packages (Horovod) leak in."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONPATH", "VIRTUAL_ENV", "HVDTRAIN_GPU", "PYTEST_ADDOPTS")}
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def venv_without_horovod(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``launch/setup.sh --no-horovod`` into a fresh venv; its ``bin`` directory."""
    venv = tmp_path_factory.mktemp("venv-no-horovod")
    # The suite's own interpreter version, so the venv takes the same wheels.
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    python = Path(sys.base_prefix) / "bin" / f"python{version}"
    try:
        result = subprocess.run(
            ["bash", str(REPO / "launch" / "setup.sh"), "--no-horovod"], cwd=REPO,
            env=clean_env(HVDTRAIN_VENV=str(venv), PYTHON=str(python)), text=True,
            capture_output=True, timeout=SETUP_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"setup.sh --no-horovod took over {SETUP_TIMEOUT} s:\n{expired.stdout}")
    assert result.returncode == 0, \
        f"setup.sh --no-horovod failed:\n{result.stdout}\n{result.stderr}"
    return venv / "bin"
