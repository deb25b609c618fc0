"""Shared helpers: launching real ranks with a timeout, running the command line in this
process, and reading what a run left behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hvdtrain.cli import main
import system_packages
from netcluster import SLURM_BASICS
from nohorovod_env import venv_without_horovod  # noqa: F401  (a fixture, for every test file)

REPO = Path(__file__).resolve().parents[1]
# The layers: unit/ (single process), distributed/ and cluster/ (real ranks, by subject),
# ranks/ (the scripts those tests launch as rank processes), support/ (helper modules every
# layer imports; setup.cfg puts support/ and ranks/ on pytest's sys.path).
TESTS = REPO / "tests"
SUPPORT = TESTS / "support"
RANKS = TESTS / "ranks"
# PYTHONPATH for launched processes that import a rank script or a support module by name.
RANK_PYTHONPATH = os.pathsep.join([str(RANKS), str(SUPPORT)])
BIN = Path(sys.executable).parent
# Generous for 2 cores (two TensorFlow imports at once) yet far below CI's budget: a hang fails.
RUN_TIMEOUT = 240
# Each collective of a job that a test interrupts waits up to this many milliseconds for
# Horovod's next cycle (HOROVOD_CYCLE_TIME): a step then takes at least that long on any
# machine, so a fast one does not finish, or leave an epoch, before the fault comes. It changes
# timing, not the math.
SLOW_CYCLE_MS = "100"
# How the tests start ranks when the launcher is not what they test: the shipped
# launch/mpirun.sh. horovodrun checks Horovod's build before every job by importing Horovod's
# TensorFlow extension (so TensorFlow) in a forked process: 3.7 s of CPU and 2.9 s of wall time
# more per 2-rank job on the 2-core VM (load ~3.5; up to 8 s wall under more load). horovodrun
# itself stays tested where it is used on purpose: its wrapper, the README's main command,
# doctor, a killed rank, ranks seeded differently, autotune, elastic training, the Python API's
# script, the drop-in's Horovod scripts, the nodes.
LAUNCHER = "mpirun"


# make test runs two pytest workers (pytest-xdist): on 2 cores, the tests that mostly wait
# (Slurm's time limit, a cut node's timeouts, podman, a launcher's keep-alive) run beside those
# that compute. All tests of a group run in one worker, so that what a group shares is made
# once: the machine's one Slurm cluster, network-namespace cluster and podman store
# ("machine"); a session fixture several files share (by its name); else a module's fixtures
# (by its file). The groups are found where the tests are collected, in the workers (which
# see each test's fixtures), and written to a file the scheduler in the main process reads.
# (pytest-xdist's own xdist_group marks do not work under pytest 9.2, whose subtests the
# conformance tool needs: the group suffix xdist writes into a test's id is lost.)
MACHINE_FIXTURES = ("slurm", "cluster")
SHARED_SESSION_FIXTURES = {"training_runs": "training_runs", "resnet_run": "resnet_run",
                           "uninterrupted": "uninterrupted", "reference": "programs",
                           "run": "programs", "venv_without_horovod": "venv_without_horovod"}
GROUPS_FILE = "HVDTRAIN_TEST_GROUPS"     # the environment variable naming the groups' file


def test_group(item: pytest.Item) -> str:
    """The worker group of ``item`` (see above)."""
    names = getattr(item, "fixturenames", ())
    path = Path(str(item.fspath)).relative_to(REPO)
    if path.parts[:2] == ("tests", "cluster") or any(n in names for n in MACHINE_FIXTURES):
        return "machine"
    shared = [group for name, group in SHARED_SESSION_FIXTURES.items() if name in names]
    return shared[0] if shared else path.as_posix()


def pytest_configure(config: pytest.Config) -> None:
    """The main process of a run with workers names the groups' file (the workers, started
    after, inherit the variable)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        handle, name = tempfile.mkstemp(prefix="hvdtrain-test-groups-", suffix=".json")
        os.close(handle)
        os.environ[GROUPS_FILE] = name


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and os.environ.get(GROUPS_FILE):
        Path(os.environ.pop(GROUPS_FILE)).unlink(missing_ok=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A worker writes every test's group (each worker collects every test: the same file)."""
    target = os.environ.get(GROUPS_FILE)
    if target and hasattr(config, "workerinput"):
        partial = Path(f"{target}.{config.workerinput['workerid']}")
        partial.write_text(json.dumps({item.nodeid: test_group(item) for item in items}))
        partial.replace(target)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Tests scheduled by group (``test_group``), a group at a time to a free worker, in
    collection order: the machine's long, waiting group (tests/cluster) first, the unit tests'
    many short groups last, where they even out the workers' ends (pytest-xdist would order
    the groups by their number of tests, which says little about their time)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:     # every worker has collected before the first call
                self.groups = json.loads(Path(os.environ[GROUPS_FILE]).read_text())
            return self.groups.get(nodeid, nodeid.split("::")[0])

    return GroupScheduling(config, log)


def rank_env(**extra: str) -> dict[str, str]:
    """The environment every launched rank gets: quiet TensorFlow, CPU only, our venv first."""
    env = dict(os.environ)
    # A pytest run inside the ranks (the drop-in's rank checks) must not take this run's
    # options: a --basetemp there would empty this run's temporary directory.
    env.pop("PYTEST_ADDOPTS", None)
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
    # More ranks than cores (four on the two-core CI machine): Open MPI needs the slots named.
    slots = ["-H", f"localhost:{np}"] if np > (os.cpu_count() or 1) else []
    if launcher == "horovodrun":
        command = [str(BIN / "horovodrun"), "-np", str(np), *program]
    elif launcher == "mpirun" and module == "hvdtrain":    # the arguments pass as they are
        command = [str(REPO / "launch" / "mpirun.sh"), "-np", str(np), *slots, "--", *args]
    elif launcher == "mpirun":
        # --command is one string, which the wrapper splits at spaces and expands as globs.
        if any(len(word.split()) != 1 or set(word) & set("*?[") for word in program):
            raise ValueError(f"launch/mpirun.sh --command would split or expand {program}")
        command = [str(REPO / "launch" / "mpirun.sh"), "-np", str(np), *slots, "--command",
                   " ".join(program)]
    elif launcher == "none":
        command = program
    else:
        raise ValueError(launcher)
    return subprocess.run(command, cwd=cwd or REPO, env=rank_env(**env), text=True,
                          capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)


def train(tmp: Path, name: str, *args: str, np: int = 2, launcher: str = LAUNCHER,
          **env: str) -> Path:
    """Train into ``tmp/name`` (output kept in ``tmp/name.log``) and return the run directory;
    fail with the output if training fails."""
    run_dir = tmp / name
    result = launch(launcher if np > 1 else "none", np,
                    ["train", "--run-dir", str(run_dir), "--no-progress", *args], cwd=tmp, **env)
    run_dir.with_suffix(".log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, f"training failed:\n{result.stdout}\n{result.stderr}"
    return run_dir


def fails_with(capsys, argv: list[str], message: str) -> str:
    """Run the CLI in-process; it must exit 2 with exactly one stderr line containing
    ``message``."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("hvdtrain: error: "), err
    assert message in lines[0], lines[0]
    return lines[0]


# --- processes of a running job ------------------------------------------------------------

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMIX_RANK")


def processes_mentioning(marker: str) -> dict[int, dict[str, str]]:
    """pid -> environment of every process whose command line contains ``marker``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in (entry / "cmdline").read_bytes().decode(errors="replace"):
                continue
            raw = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found[int(entry.name)] = dict(item.decode(errors="replace").split("=", 1)
                                      for item in raw if b"=" in item)
    return found


def rank_pid(marker: str, rank: int) -> int | None:
    for pid, env in processes_mentioning(marker).items():
        if "hvdtrain" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace") and any(
                env.get(name) == str(rank) for name in RANK_VARIABLES):
            return pid
    return None


def wait_for(condition, timeout: float, every: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout} s")


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> list:
    """The saved final model's weights (Keras safe mode: no code from the file runs)."""
    import keras

    return keras.saving.load_model(run_dir / "model.keras", safe_mode=True).get_weights()


def probe_shards(tmp: Path, *probes: tuple[str, str, int]) -> list[list[dict]]:
    """Per ``(kind, what, batch)`` probe: every rank's example ids, step counts and weight sums
    over two epochs (shard_probe; all the probes in one launch)."""
    outs = [tmp / f"shards-{kind}-{index}.json" for index, (kind, _, _) in enumerate(probes)]
    args = [str(arg) for (kind, what, batch), out in zip(probes, outs)
            for arg in (kind, what, batch, out)]
    result = launch(LAUNCHER, 2, args, module="shard_probe", PYTHONPATH=RANK_PYTHONPATH)
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(out.read_text()) for out in outs]


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


# The collectives a 2-rank test can run on (--backend): the features both have are tested on
# both, parametrised.
BACKENDS = ("horovod", "tensorflow")


@pytest.fixture(scope="session")
def training_runs(session_tmp):
    """``training_runs(group, name)``: a run directory of the trainer, option and compiled-model
    tests (tests/support/training_cases.py), each group trained in one launch when a test first
    asks for one of its runs."""
    from case_jobs import trained_on_demand
    from training_cases import cases

    return trained_on_demand(lambda group: session_tmp / f"cases-{group}", cases)


@pytest.fixture(scope="session")
def uninterrupted(session_tmp):
    """``uninterrupted(backend, name)``: the run directory of an uninterrupted run the fault
    tests compare a resumed run with (tests/support/uninterrupted_runs.py), each backend's
    trained in one launch when a test first asks for one of its runs."""
    from case_jobs import trained_on_demand
    from uninterrupted_runs import cases

    return trained_on_demand(lambda backend: session_tmp / f"uninterrupted-{backend}", cases)


@pytest.fixture(scope="session")
def resnet_run(session_tmp):
    """A 3-epoch ResNet on 2 ranks, trained once for the model and the run-output tests."""
    return train(session_tmp, "resnet", "--model", "resnet", "--resnet-blocks", "1",
                 "--dataset", "synthetic", "--synthetic-shape", "16", "16", "3",
                 "--synthetic-examples", "320", "--epochs", "3", "--batch-size", "32")


@pytest.fixture
def no_horovod(tmp_path) -> str:
    """A PYTHONPATH entry on which ``import horovod`` fails, as where it is not installed."""
    shim = tmp_path / "no-horovod"
    (shim / "horovod").mkdir(parents=True)
    (shim / "horovod" / "__init__.py").write_text(
        'raise ImportError("No module named \'horovod\' (tests: Horovod hidden)")\n')
    return str(shim)


# --- a real single-node Slurm cluster ----------------------------------------------------------

def run(command: list[str], timeout: int, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, text=True, capture_output=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kwargs)


def require_debian_packages(*packages: str) -> None:
    """Skip the test, naming the setup command that installs them, unless every one of
    ``packages`` is installed (pytest installs nothing)."""
    absent = system_packages.missing(*packages)
    if absent:
        pytest.skip(system_packages.why_missing(absent))


SLURM_CONF = """\
ClusterName=hvdtrain-test
SlurmctldHost={host}
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""" + SLURM_BASICS + """\
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
"""
FINAL_JOB_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def stop_daemon(pid_file: Path) -> None:
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text().strip()), 15)
        except (ProcessLookupError, ValueError):
            pass


class SlurmCluster:
    """Submit the shipped single-node batch script and read jobs back from scontrol."""

    def __init__(self, env: dict[str, str], directory: Path) -> None:
        self.env = env
        self.directory = directory

    def submit(self, *args: str, launcher: str = "srun", sbatch: tuple[str, ...] = (),
               **env: str) -> str:
        """Submit with trainer ``args``; ``sbatch``: more sbatch options (they override the
        script's own); ``env``: more environment for the job."""
        # The test's environment wins over the cluster's (which holds the caller's, where a
        # PYTHONPATH may already be set).
        job_env = rank_env(**{**self.env, **env, "HVDTRAIN_REPO": str(REPO),
                              "HVDTRAIN_LAUNCHER": launcher})
        result = run(["sbatch", "--parsable", "--ntasks-per-node=2", "--cpus-per-task=1", *sbatch,
                      f"--chdir={self.directory}", f"--output={self.directory}/job-%j.out",
                      f"--error={self.directory}/job-%j.err",
                      str(REPO / "launch" / "slurm" / "single_node.sbatch"), *args], 60,
                     env=job_env)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().split(";")[0]

    def finished(self, job: str) -> dict | None:
        """The job's scontrol record once it has ended, else None."""
        record = dict(re.findall(r"(\w+)=(\S+)", run(["scontrol", "show", "job", job], 30,
                                                     env=self.env).stdout))
        return record if record.get("JobState") in FINAL_JOB_STATES else None

    def output(self, job: str) -> str:
        return "".join((self.directory / f"job-{job}.{kind}").read_text()
                       for kind in ("out", "err")
                       if (self.directory / f"job-{job}.{kind}").exists())

    def wait(self, job: str, timeout: int = 300) -> tuple[dict, str]:
        deadline = time.time() + timeout
        while (record := self.finished(job)) is None:
            assert time.time() < deadline, f"job {job} did not end in {timeout} s"
            time.sleep(1)
        return record, self.output(job)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node Slurm cluster (munge, slurmctld, slurmd) on this machine, stopped after."""
    require_debian_packages(*system_packages.SLURM)
    directory = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (directory / sub).mkdir()
    conf = directory / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0],
                                      cpus=os.cpu_count(), dir=directory))
    started_munge = False
    # Is the standard munged answering on its default socket? (Another munged, such as the
    # multi-node cluster's own on its own socket, does not serve this cluster.)
    if run(["munge", "-n"], 10).returncode != 0:
        Path("/run/munge").mkdir(exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        assert run(["munged", "--force"], 30).returncode == 0
        started_munge = True
    env = dict(os.environ, SLURM_CONF=str(conf))
    try:
        for daemon in ("slurmctld", "slurmd"):
            result = run([daemon, "-f", str(conf)], 60, env=env)
            assert result.returncode == 0, result.stderr
        deadline = time.time() + 60
        while run(["sinfo", "-h", "-o", "%T"], 30, env=env).stdout.strip() != "idle":
            assert time.time() < deadline, (directory / "slurmctld.log").read_text()[-2000:]
            time.sleep(1)
        yield SlurmCluster(env, directory)
    finally:
        stop_daemon(directory / "slurmd.pid")
        stop_daemon(directory / "slurmctld.pid")
        if started_munge:
            stop_daemon(Path("/run/munge/munged.pid"))
