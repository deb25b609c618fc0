"""Shared helpers: launching real ranks with a timeout, and reading what a run left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Generous for 2 cores (two TensorFlow imports at once) yet far below CI's budget: a hang fails.
RUN_TIMEOUT = 240


def rank_env(**extra: str) -> dict[str, str]:
    """The environment every launched rank gets: quiet TensorFlow, CPU only, our venv first."""
    env = dict(os.environ)
    env.update({
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), extra.pop("PYTHONPATH", "")])),
    })
    env.update(extra)
    return env


def launch(launcher: str, np: int, args: list[str], cwd: Path | None = None,
           timeout: int = RUN_TIMEOUT, module: str = "hvdtrain",
           **env: str) -> subprocess.CompletedProcess:
    """Run ``python -m <module> ARGS`` on ``np`` ranks with horovodrun, mpirun, or no launcher."""
    program = [str(BIN / "python"), "-m", module, *args]
    if launcher == "horovodrun":
        command = [str(BIN / "horovodrun"), "-np", str(np), *program]
    elif launcher == "mpirun":
        command = [str(REPO / "launch" / "mpirun.sh"), "-np", str(np), "--command",
                   " ".join(program)]
    elif launcher == "none":
        command = program
    else:
        raise ValueError(launcher)
    return subprocess.run(command, cwd=cwd or REPO, env=rank_env(**env), text=True,
                          capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)


def train(tmp: Path, name: str, *args: str, np: int = 2, launcher: str = "horovodrun",
          **env: str) -> Path:
    """Train into ``tmp/name`` and return the run directory; fail with the output if it fails."""
    run_dir = tmp / name
    result = launch(launcher if np > 1 else "none", np,
                    ["train", "--run-dir", str(run_dir), "--no-progress", *args], cwd=tmp, **env)
    assert result.returncode == 0, f"training failed:\n{result.stdout}\n{result.stderr}"
    return run_dir


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> list:
    """The saved final model's weights (Keras safe mode: no code from the file runs)."""
    import keras

    return keras.saving.load_model(run_dir / "model.keras", safe_mode=True).get_weights()


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")
