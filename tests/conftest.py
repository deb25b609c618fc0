"""Shared helpers: launching real ranks with a timeout, and reading what a run left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    """Train into ``tmp/name`` (output kept in ``tmp/name.log``) and return the run directory;
    fail with the output if training fails."""
    run_dir = tmp / name
    result = launch(launcher if np > 1 else "none", np,
                    ["train", "--run-dir", str(run_dir), "--no-progress", *args], cwd=tmp, **env)
    run_dir.with_suffix(".log").write_text(result.stdout + result.stderr)
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


def probe_shards(tmp: Path, kind: str, what: str, batch: int) -> list[dict]:
    """Every rank's example ids, step counts and weight sums over two epochs (shard_probe)."""
    out = tmp / f"shards-{kind}.json"
    result = launch("horovodrun", 2, [kind, what, str(batch), str(out)], module="shard_probe",
                    PYTHONPATH=str(REPO / "tests"))
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


def assert_partition(records: list[dict], num_examples: int, steps: int) -> None:
    """Each epoch: disjoint shards covering every example once, equal steps, and per-step
    weights summing to one across ranks (each update is a mean over its global batch)."""
    assert [r["rank"] for r in records] == [0, 1]
    for epoch in range(2):
        assert records[0]["steps"][epoch] == records[1]["steps"][epoch] == steps
        shard0, shard1 = (set(r["ids"][epoch]) for r in records)
        assert not shard0 & shard1
        assert sorted(shard0 | shard1) == list(range(num_examples))
        assert sum(len(r["ids"][epoch]) for r in records) == num_examples
        totals = [a + b for a, b in zip(*(r["weight_sums"][epoch] for r in records))]
        assert totals == pytest.approx([1.0] * steps, rel=1e-5)
    assert records[0]["ids"][0] != records[0]["ids"][1]   # reshuffled each epoch


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")


# Plain SGD, no dropout, fixed data order, op determinism: the update must not depend on N.
EXACT = ["--dataset", "digits", "--epochs", "2", "--optimizer", "sgd", "--momentum", "0",
         "--warmup-epochs", "0", "--hidden-units", "32", "--weight-decay", "0.001",
         "--seed", "1", "--deterministic"]


def assert_same_weights(a: list, b: list, atol: float) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b):
        np.testing.assert_allclose(left, right, atol=atol, rtol=0)


@pytest.fixture(scope="session")
def exact_runs(session_tmp):
    """2 ranks x batch 16 at rate 0.05 (linear scaling: 0.1) against 1 rank x 32 at 0.1.

    1,438 training examples do not divide into global batches of 32: the last one is short,
    and the equivalence covers it.
    """
    runs = {}
    for loop in ("fit", "custom"):
        runs[loop, 2] = train(session_tmp, f"exact-{loop}-2", *EXACT, "--loop", loop,
                              "--batch-size", "16", "--learning-rate", "0.05")
        runs[loop, 1] = train(session_tmp, f"exact-{loop}-1", *EXACT, "--loop", loop,
                              "--batch-size", "32", "--learning-rate", "0.1", np=1)
    return runs
