"""``hvdtrain doctor``: is this environment able to train, on every rank?

Each rank collects versions, Horovod's build, the MPI library, its rank facts and its GPUs, and
runs one allreduce; rank 0 prints every rank's report and one verdict line. Each problem comes
with one sentence on how to fix it.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from hvdtrain import __version__
from hvdtrain.collectives import chosen_backend, init_collectives
from hvdtrain.collectives.horovod_backend import horovod_build_info
from hvdtrain.launchers import keepalive_window_s, launched_by_a_launcher, launcher_defaults

SETUP_HINT = "run launch/setup.sh (it rebuilds Horovod against this TensorFlow)"


def mpi_library_version() -> str:
    """The MPI library's own version string, without initialising MPI."""
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        # The C string comes back with its terminating NUL byte.
        return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
    except Exception as error:  # noqa: BLE001 - report, do not crash, whatever mpi4py raises
        return f"unavailable ({type(error).__name__}: {error})"


def horovod_problems(build: dict[str, Any]) -> list[str]:
    """What is wrong with Horovod's build, for a job that trains on it."""
    if "error" in build:
        return [f"Horovod cannot be used: {build['error']}; {SETUP_HINT}"]
    if not (build["controllers"]["MPI"] or build["controllers"]["Gloo"]):
        return [f"Horovod was built without MPI and Gloo; {SETUP_HINT}"]
    if not build["controllers"]["MPI"]:
        return ["Horovod was built without MPI (mpirun and Slurm launches will fail); "
                "install libopenmpi-dev and " + SETUP_HINT]
    return []


def problems_in(report: dict[str, Any], launched: bool) -> list[str]:
    """One sentence per problem found in a rank's report, each saying how to fix it (Horovod's
    build matters only where it trains: a job on TensorFlow's collectives does not need it)."""
    found: list[str] = []
    if not report.get("backend", "").startswith("tensorflow"):
        found += horovod_problems(report["horovod"])
    if report["mpi"].startswith("unavailable"):
        found.append("mpi4py cannot load an MPI library; install openmpi-bin and re-run "
                     "launch/setup.sh")
    check = report.get("allreduce")
    if check and not check["ok"]:
        found.append(f"allreduce across ranks gave {check['got']}, expected {check['expected']}:"
                     " the ranks are not talking to each other; check the launcher's network "
                     "interface (--network-interface)")
    if launched and report["size"] == 1:
        found.append("launched by an MPI launcher but the world has one rank: Horovod and "
                     "mpirun use different MPI libraries; re-run launch/setup.sh")
    return found


def launcher_notes(environ: dict[str, str]) -> list[str]:
    """Advice that is no problem on one node: Open MPI's launcher, as this rank's environment
    says it was set up, would outlive a job that loses a node (``launchers.launcher_defaults``)."""
    if "OMPI_COMM_WORLD_RANK" not in environ:
        return []
    window = keepalive_window_s(environ)
    if window <= keepalive_window_s(launcher_defaults()):
        return []
    exports = " ".join(f"{name}={value}" for name, value in launcher_defaults().items())
    return [f"mpirun would wait {window:.0f} s or more for a node that vanishes and, started "
            "outside the nodes, outlive the job; before a bare mpirun or horovodrun run: "
            f"export {exports} (launch/mpirun.sh and launch/horovodrun.sh set these)"]


def collect_report() -> tuple[dict[str, Any], Any]:
    """This rank's report, and the collectives it initialised (None if Horovod is broken)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    report: dict[str, Any] = {
        "hvdtrain": __version__,
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "horovod": horovod_build_info(),
        "mpi": mpi_library_version(),
        "host": platform.node(),
        "gpus": [gpu.name for gpu in tf.config.list_physical_devices("GPU")],
        "rank": 0, "size": 1, "local_rank": 0, "local_size": 1, "cross_rank": 0,
        "cross_size": 1,
    }
    collectives = None
    backend, _ = chosen_backend("auto") if launched_by_a_launcher() else ("none", "")
    if "error" not in report["horovod"] or backend != "horovod":
        collectives = init_collectives()
        report["backend"] = f"{collectives.backend} ({collectives.chosen})"
        world = collectives.world
        report.update(rank=world.rank, size=world.size, local_rank=world.local_rank,
                      local_size=world.local_size, cross_rank=world.cross_rank,
                      cross_size=world.cross_size)
        got = float(collectives.allreduce_sum([tf.constant(world.rank + 1.0)])[0])
        expected = world.size * (world.size + 1) / 2
        report["allreduce"] = {"got": got, "expected": expected, "ok": got == expected}
    return report, collectives


def format_report(report: dict[str, Any]) -> str:
    build = report["horovod"]
    if "error" in build:
        horovod = f"NOT USABLE ({build['error']})"
    else:
        on = [name for name, built in build["controllers"].items() if built]
        ops = [name for name, built in build["tensor_ops"].items() if built]
        horovod = (f"{build['version']} (frameworks: TensorFlow; controllers: "
                   f"{', '.join(on) or 'none'}; tensor ops: {', '.join(ops) or 'none'})")
    check = report.get("allreduce")
    allreduce = (f"sum of (rank+1) = {check['got']:g} (expected {check['expected']:g}) "
                 f"{'ok' if check['ok'] else 'WRONG'}" if check else "not run")
    return "\n".join([
        f"[rank {report['rank']}/{report['size']}] host {report['host']}, local rank "
        f"{report['local_rank']}/{report['local_size']}, node {report['cross_rank']}/"
        f"{report['cross_size']}",
        f"  hvdtrain {report['hvdtrain']}, Python {report['python']}, TensorFlow "
        f"{report['tensorflow']}, Keras {report['keras']}",
        f"  Horovod {horovod}",
        f"  backend {report.get('backend', 'not started')}",
        f"  MPI {report['mpi']}",
        f"  GPUs {', '.join(report['gpus']) or 'none (CPU)'}",
        f"  allreduce {allreduce}",
    ])


def main() -> int:
    """Print every rank's report on rank 0 and a verdict; exit 1 if anything is wrong."""
    report, collectives = collect_report()
    reports = collectives.allgather_object(report) if collectives else [report]
    if report["rank"] != 0:
        return 0 if not problems_in(report, launched_by_a_launcher()) else 1
    for each in reports:
        print(format_report(each))
    problems = [f"rank {each['rank']}: {problem}" for each in reports
                for problem in problems_in(each, launched_by_a_launcher())]
    for problem in problems:
        print(f"  problem: {problem}")
    for note in launcher_notes(dict(os.environ)):
        print(f"  note: {note}")
    verdict = "FAIL" if problems else "PASS"
    print(f"verdict: {verdict} ({len(reports)} rank(s) checked"
          f"{'; ' + str(len(problems)) + ' problem(s)' if problems else ', ready to train'})")
    sys.stdout.flush()
    return 1 if problems else 0
