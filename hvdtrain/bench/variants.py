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


def interop_threads(threads: int, interop: int | None = None) -> int:
    """The inter-op threads of a variant with ``threads`` intra-op threads: ``interop`` when
    given, else as hvdtrain sizes its own."""
    from hvdtrain.collectives.world import default_interop_threads

    return interop or default_interop_threads(threads)


def variant_env(threads: int, interop: int | None = None) -> dict[str, str]:
    """Every variant gets the same CPU threads per process (``threads`` intra-op, ``interop``
    inter-op: by default as hvdtrain sizes its own), the same quiet TensorFlow
    and hvdtrain's runtime defaults for Horovod and MPI (which a hand-written loop could set
    too), so the ratios measure code, not environment. The harnesses run on CPUs only."""
    from hvdtrain.launchers import runtime_defaults

    return {**runtime_defaults(gpus_visible=False), **os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "TF_NUM_INTRAOP_THREADS": str(threads), "TF_NUM_INTEROP_THREADS":
            str(interop_threads(threads, interop)),
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


def start_on(host: str, command: list[str], env: dict[str, str],
             ssh: str = "ssh") -> subprocess.Popen:
    """``command`` started on ``host``: here for this host, over ``ssh`` (in this directory,
    with this environment's TF_*, HOROVOD_* and ``FORWARDED`` settings) for any other."""
    if is_this_host(host):
        argv = command
    else:
        settings = [f"{name}={env[name]}" for name in sorted(env)
                    if name in FORWARDED or name.startswith(("TF_", "HOROVOD_"))]
        argv = [*shlex.split(ssh), host, shlex.join(["cd", os.getcwd()]) + " && "
                + shlex.join(["env", *settings, *command])]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)


def wait_all(processes: list[subprocess.Popen], what: str, timeout: int) -> None:
    """Wait for every process; one error naming ``what`` with each failure's output."""
    failures = []
    for process in processes:
        _, err = process.communicate(timeout=timeout)
        if process.returncode != 0:
            failures.append(err[-3000:])
    if failures:
        raise RuntimeError(f"{what} failed:\n" + "\n".join(failures))


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
        workers.append(start_on(host, command, dict(env, TF_CONFIG=config), ssh))
    wait_all(workers, "MultiWorkerMirroredStrategy worker", timeout)


def run_concurrent_singles(common: list[str], hosts: list[str], env: dict[str, str],
                           output: Path, ssh: str = "ssh", timeout: int = 1200) -> None:
    """The concurrent compute floor: one ``hvdtrain benchmark`` per entry of ``hosts``, each a
    world of one (no launcher, no communication), all started at once, so each computes while
    the others do, as the ranks of a job do (on one machine they share its cores and memory
    bandwidth; the one started over ssh begins its timed steps after its connection, well
    inside the other's warm-up). ``output`` gets the slowest one's step (a synchronous step
    waits for it), the examples/s of all of them together, each one's step, and the first
    host's CPU figure."""
    parts = [output.with_name(f"{output.stem}-host{index}.json") for index in range(len(hosts))]
    wait_all([start_on(host, [python(), "-m", "hvdtrain", "benchmark", *common, "--output",
                              str(part)], env, ssh) for host, part in zip(hosts, parts)],
             "concurrent single-process run", timeout)
    results = [json.loads(part.read_text()) for part in parts]
    slowest = max(results, key=lambda result: result["step_seconds_median"])
    output.write_text(json.dumps({
        **slowest, "host_cpu_busy": results[0].get("host_cpu_busy"),
        "examples_per_second_total": sum(r["examples_per_second_total"] for r in results),
        "per_process_step_seconds": [r["step_seconds_median"] for r in results]}, indent=2)
        + "\n")
