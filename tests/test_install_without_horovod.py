"""launch/setup.sh --no-horovod gives what the TensorFlow-collectives backend needs, and no
Horovod: TensorFlow, mpi4py working under mpirun, hvdtrain."""

from __future__ import annotations

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
def test_mpi4py_runs_two_ranks_under_the_mpirun_wrapper(venv_without_horovod):
    """The binary mpi4py wheel picks the system Open MPI: two ranks, not two singletons."""
    python = venv_without_horovod / "python"
    result = subprocess.run(
        [str(REPO / "launch" / "mpirun.sh"), "-np", "2", "--command",
         f"{python} -m mpi4py.bench helloworld"],
        cwd=REPO, env=clean_env(HVDTRAIN_PYTHON=str(python)), text=True, capture_output=True,
        timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    greetings = sorted(line.split(" on ")[0] for line in result.stdout.splitlines()
                       if line.startswith("Hello"))
    assert greetings == ["Hello, World! I am process 0 of 2", "Hello, World! I am process 1 of 2"]
