"""A real job that a test starts, interrupts or damages, and what the job must leave behind:
shared by the rank-failure, checkpoint and stop tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import BIN, REPO, processes_mentioning, rank_env, wait_for

# A killed rank must end the whole job within this many seconds (measured: a few seconds).
ABORT_BOUND_S = 30
# Every process of an ended job must be gone within this many seconds.
GONE_WITHIN_S = 60


def start(launcher: str, run_dir: Path, *args: str) -> subprocess.Popen:
    """Train into ``run_dir`` on 2 ranks under ``launcher`` (a ``LAUNCHERS`` name) without
    waiting, output in one pipe, so the test can interrupt the job."""
    program = [str(BIN / "python"), "-m", "hvdtrain", "--run-dir", str(run_dir), "--no-progress",
               *args]
    if launcher == "mpirun":   # --command takes the whole program as one string
        program = [" ".join(program)]
    return subprocess.Popen([*LAUNCHERS[launcher], *program], env=rank_env(), cwd=run_dir.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)


LAUNCHERS = {
    "horovodrun": [str(BIN / "horovodrun"), "-np", "2"],
    "mpirun": [str(REPO / "launch" / "mpirun.sh"), "-np", "2", "--command"],
}


def assert_nothing_left(run_dir: Path) -> None:
    """Every process of the job on ``run_dir`` ends, within ``GONE_WITHIN_S``."""
    wait_for(lambda: not processes_mentioning(str(run_dir)), GONE_WITHIN_S)


def flip_a_byte(path: Path) -> None:
    """Damage ``path`` as a bad disk would: same size, one byte changed."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
