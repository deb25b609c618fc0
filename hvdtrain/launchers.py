"""The launch environment: which launcher started this rank, the settings hvdtrain gives MPI,
Horovod and the launcher (one source for training, the launch scripts and the benchmarks), and
what a rank does about an Open MPI daemon that would outwait a lost node."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Mapping

# Environment variables that a launcher sets in every rank it starts: horovodrun with Gloo,
# Open MPI's mpirun (also used by horovodrun with MPI), PMIx (srun --mpi=pmix), MPICH/PMI2.
LAUNCHER_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK",
                      "HOROVOD_ELASTIC")
# ... of which these mean an MPI launch (Horovod's MPI controller), not Gloo's.
MPI_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def launched_by_a_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """True when horovodrun, mpirun or srun started this process as one of several ranks
    (``HVDTRAIN_BACKEND=local`` says no whatever the launcher, a named backend says yes)."""
    env = os.environ if environ is None else environ
    forced = env.get("HVDTRAIN_BACKEND", "").lower()
    if forced in ("horovod", "tensorflow", "local"):
        return forced != "local"
    return any(name in env for name in LAUNCHER_VARIABLES)


def runtime_defaults(gpus_visible: bool) -> dict[str, str]:
    """hvdtrain's settings for Horovod and MPI: the single source of them, for training and for
    the benchmark harness (which gives every variant the same ones)."""
    defaults = {
        # A rank that stops submitting tensors (hung in I/O, stopped) while the others wait:
        # Horovod warns after 60 s and shuts the job down after 120 s, so no allocation burns.
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120",
    }
    if not gpus_visible:
        # CPU training keeps every core busy computing; Open MPI's default busy-polling while a
        # rank waits steals those cores (measured: 1.45x throughput when it yields, 2 ranks on
        # 2 cores). Read by MPI_Init.
        defaults["OMPI_MCA_mpi_yield_when_idle"] = "1"
        # Horovod's background thread starts a round of negotiation every cycle (1 ms by
        # default), so a collective waits up to a cycle before it starts. At 0.1 ms a 1 MiB
        # allreduce took 0.33 ms instead of 2.1 ms on 2 CPU ranks, and training throughput did
        # not change (cnn, 3 rounds each: within 1%).
        defaults["HOROVOD_CYCLE_TIME"] = "0.1"
    return defaults


# Open MPI's own TCP keep-alive settings for its daemons: idle seconds, seconds between probes,
# probes (oob_tcp_keepalive_time, _intvl, _probes).
OPEN_MPI_KEEPALIVE = (300, 20, 9)
KEEPALIVE_VARIABLES = ("OMPI_MCA_oob_tcp_keepalive_time", "OMPI_MCA_oob_tcp_keepalive_intvl",
                       "OMPI_MCA_oob_tcp_keepalive_probes")


def launcher_defaults() -> dict[str, str]:
    """hvdtrain's settings for the launcher itself (mpirun and its orted daemons; set by
    launch/mpirun.sh, launch/horovodrun.sh and the MPIJob manifest). Open MPI's own TCP
    keep-alive leaves a launcher waiting ~15 minutes for a vanished node; with these a silent
    daemon is declared lost within 36-46 s, so the whole job ends within 60 s."""
    return dict(zip(KEEPALIVE_VARIABLES, ("10", "6", "6")))


def keepalive_window_s(environ: Mapping[str, str] | None = None) -> float:
    """The longest time Open MPI's daemons take to declare a silent node lost, with the
    keep-alive settings a launcher forwarded to this rank (Open MPI's own where it did not)."""
    env = os.environ if environ is None else environ
    try:
        idle, interval, probes = (float(env.get(name, default)) for name, default
                                  in zip(KEEPALIVE_VARIABLES, OPEN_MPI_KEEPALIVE))
    except ValueError:          # Open MPI itself refuses such a value
        idle, interval, probes = OPEN_MPI_KEEPALIVE
    return idle + interval * probes


# Seconds Open MPI waits before it ends a rank whose local daemon (mpirun or orted) is gone.
LOST_DAEMON_GRACE_S = 120


def hold_open_mpi_abort() -> None:
    """Before MPI starts, in a rank that stops itself when its launcher dies (the trainer's
    ranks: ``liveness/watch.py``): Open MPI ends such a rank (exit 195) as soon as it
    notices that its daemon is gone, even mid-checkpoint; delayed, the rank's own stop
    (checkpoint, exit 75) comes first. A setting of the user's wins."""
    os.environ.setdefault("OMPI_MCA_mpi_abort_delay", str(LOST_DAEMON_GRACE_S))


def apply_runtime_defaults(gpus_visible: bool) -> None:
    """Set ``runtime_defaults`` in this process's environment, before MPI and Horovod start;
    a variable the user has set keeps the user's value."""
    for name, value in runtime_defaults(gpus_visible).items():
        os.environ.setdefault(name, value)


# The daemon forwards a rank's last line before the rank ends it.
OUTPUT_GRACE_S = 1.5
# A rank under orted waits for the launcher's keep-alive to end the job when it takes at most
# this long (launcher_defaults: 46 s); Open MPI's own (480 s) is not waited for.
KEEPALIVE_WAIT_LIMIT_S = 60.0
HNP_PROBE_S = 1.0


def end_open_mpi_daemon(parent: int) -> None:
    """End the Open MPI process that started this rank, if one did and it would wait for ever.

    Measured with a node cut off: mpirun (which starts the ranks of its own node) and orted
    (which mpirun starts on every other node over ssh, or srun under Slurm) both wait for the
    lost node's acknowledgement of the abort, until TCP gives up (about 15 minutes). mpirun
    answers a first SIGTERM with an "abort already in progress" and keeps waiting, so it gets
    SIGKILL, and so do the ssh and srun clients it started (they would wait for the lost node
    as long); its other nodes' orteds then lose their connection to it and end their ranks.

    Under orted the launcher is elsewhere, possibly outside the nodes, where no rank can end
    it. Ending orted makes mpirun start to end the job, and its messages to the lost node then
    wait for TCP's retransmissions; so when the launcher's keep-alive (``world.
    launcher_defaults``) will find the lost node soon and this rank's node still reaches the
    launcher, the rank leaves the ending to it (orted ends its ranks then) and ends orted only
    if that has not happened in time. A rank that cannot reach the launcher is on the lost side:
    its orted's own messages to mpirun are stuck, so it is ended at once. Slurm's and Gloo's
    launchers are left alone: they end a failed rank's job themselves.
    """
    try:
        name = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:
        return
    if name not in ("orted", "mpirun", "orterun"):
        return
    time.sleep(OUTPUT_GRACE_S)   # the daemon forwards this rank's line first
    if name == "orted":
        window = keepalive_window_s()
        if window <= KEEPALIVE_WAIT_LIMIT_S and launcher_answers(os.environ):
            time.sleep(window + OUTPUT_GRACE_S)
            if os.getppid() != parent:   # orted is gone (and its pid may be another's now)
                return
        victims, signal_number = [parent], signal.SIGTERM
    else:
        victims = [parent] + children_named(parent, "ssh") + children_named(parent, "srun")
        signal_number = signal.SIGKILL
    for pid in victims:
        try:
            os.kill(pid, signal_number)
        except ProcessLookupError:
            pass


def launcher_answers(environ: Mapping[str, str]) -> bool:
    """True when this rank's mpirun (Open MPI's HNP, whose addresses Open MPI gives every rank
    in ``OMPI_MCA_orte_hnp_uri``) accepts a connection: this rank's node is still on the
    network. False when it does not answer, or its address is unknown."""
    uri = environ.get("OMPI_MCA_orte_hnp_uri", "")
    for addresses, port in re.findall(r"tcp://([^;\[]+):(\d+)", uri):
        for address in addresses.split(","):
            try:
                with socket.create_connection((address, int(port)), timeout=HNP_PROBE_S):
                    return True
            except OSError:
                continue
    return False


def children_named(parent: int, name: str) -> list[int]:
    """Pids of ``parent``'s children whose command is ``name`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        command, fields = text[text.index("(") + 1:text.rindex(")")], text.rsplit(")", 1)[1]
        if command == name and int(fields.split()[1]) == parent:
            found.append(int(stat.parent.name))
    return found
