"""launch/setup.sh --no-horovod gives what the TensorFlow-collectives backend needs, and no
Horovod: TensorFlow, mpi4py working under mpirun, hvdtrain."""

from __future__ import annotations

import json
import subprocess

import pytest

from nohorovod_env import REPO, clean_env

pytestmark = pytest.mark.slow


def run_python(bin_dir, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir / "python"), "-c", code], cwd=bin_dir, env=clean_env(),
                          text=True, capture_output=True, timeout=120, stdin=subprocess.DEVNULL)


def test_tensorflow_mpi4py_and_hvdtrain_import_and_horovod_does_not(venv_without_horovod):
    imports = run_python(venv_without_horovod, "import tensorflow, mpi4py, hvdtrain")
    assert imports.returncode == 0, imports.stderr
    horovod = run_python(venv_without_horovod, "import horovod")
    assert horovod.returncode != 0
    assert "No module named 'horovod'" in horovod.stderr
    assert not (venv_without_horovod / "horovodrun").exists()


@pytest.mark.distributed
def test_the_default_job_trains_on_tensorflows_collectives_without_horovod(
        venv_without_horovod, tmp_path):
    """Issue 19's first proof: where Horovod is not installed, ``launch/mpirun.sh -np 2``
    (mpirun, python -m hvdtrain) trains the embedded default job on TensorFlow's collectives,
    chosen by auto and said in one line, to the README's held-out accuracy on two real ranks
    (the binary mpi4py wheel found the system Open MPI: two ranks, not two singletons)."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [str(REPO / "launch" / "mpirun.sh"), "-np", "2", "--", "--run-dir", str(run_dir),
         "--no-progress"],
        cwd=tmp_path, env=clean_env(HVDTRAIN_PYTHON=str(venv_without_horovod / "python"),
                                    TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES=""),
        text=True, capture_output=True, timeout=600, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "backend: tensorflow (auto: Horovod is not usable here (" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["weights_identical"]
    assert summary["metrics"]["val_accuracy"] >= 0.95, summary["metrics"]
