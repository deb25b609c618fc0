"""Starting the timed variants, for ``compare`` (one machine) and ``scaling`` (several nodes):
the same environment for every variant, a checked run, and MultiWorkerMirroredStrategy's
workers, which no MPI launcher starts (each is told its place by ``TF_CONFIG``)."""

from __future__ import annotations

import json
import os
import random
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from hvdtrain.collectives.tensorflow_backend import free_port

# Open MPI with the flags and environment hvdtrain's ranks need (multi-node options included).
MPIRUN_WRAPPER = Path(__file__).resolve().parents[2] / "launch" / "mpirun.sh"
# What a MultiWorkerMirroredStrategy worker started over ssh needs from this environment.
FORWARDED = ("PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "OMPI_MCA_mpi_yield_when_idle")


def python() -> str:
    """This interpreter: the variants run in the same environment (on a shared file system
    across nodes)."""
    return sys.executable


def variant_env(threads: int) -> dict[str, str]:
    """Every variant gets the same CPU threads per process, the same quiet TensorFlow and
    hvdtrain's runtime defaults for Horovod and MPI (which a hand-written loop could set too),
    so the ratios measure code, not environment. The harnesses run on CPUs only."""
    from hvdtrain.launchers import runtime_defaults

    return {**runtime_defaults(gpus_visible=False), **os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "TF_NUM_INTRAOP_THREADS": str(threads), "TF_NUM_INTEROP_THREADS":
            str(min(2, threads)),
            "PATH": f"{Path(python()).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def run_checked(command: list[str], env: dict[str, str], timeout: int = 1200) -> None:
    """Run one variant; its error output (the end of it) if it fails."""
    result = subprocess.run(command, env=env, text=True, capture_output=True,
                            timeout=timeout, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])}... failed:\n{result.stderr[-3000:]}")


def is_this_host(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", socket.gethostname(),
                    socket.gethostname().split(".")[0])


def run_multiworker(common: list[str], hosts: list[str], env: dict[str, str], output: Path,
                    ssh: str = "ssh", timeout: int = 1200) -> None:
    """One ``baselines.multiworker`` worker per entry of ``hosts`` (a host twice: two
    workers there): started here for this host, over ``ssh`` for any other. A port on another
    host cannot be checked from here, so those are drawn at random from a high range."""
    ports = [free_port() if is_this_host(host) else random.randint(20000, 39999)
             for host in hosts]
    cluster = {"worker": [f"{host}:{port}" for host, port in zip(hosts, ports)]}
    command = [python(), "-m", "hvdtrain.bench.baselines.multiworker", *common,
               "--output", str(output)]
    workers = []
    for index, host in enumerate(hosts):
        config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        worker_env = dict(env, TF_CONFIG=config)
        if is_this_host(host):
            argv = command
        else:
            settings = [f"{name}={worker_env[name]}" for name in sorted(worker_env)
                        if name in FORWARDED or name.startswith(("TF_", "HOROVOD_"))]
            argv = [*shlex.split(ssh), host, shlex.join(["cd", os.getcwd()]) + " && "
                    + shlex.join(["env", *settings, *command])]
        workers.append(subprocess.Popen(argv, env=worker_env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True,
                                        stdin=subprocess.DEVNULL))
    failures = []
    for worker in workers:
        _, err = worker.communicate(timeout=timeout)
        if worker.returncode != 0:
            failures.append(err[-3000:])
    if failures:
        raise RuntimeError("MultiWorkerMirroredStrategy worker failed:\n" + "\n".join(failures))
