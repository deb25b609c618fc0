"""A real job that a test starts, interrupts or damages, and what the job must leave behind:
shared by the rank-failure, checkpoint and stop tests."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from conftest import BIN, REPO, SLOW_CYCLE_MS, processes_mentioning, rank_env, wait_for
from hvdtrain.checkpoints.store import Checkpoint, CheckpointStore

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


# --- a job stopped by a signal to its launcher -----------------------------------------------

def start_wrapper(wrapper: str, run_dir: Path, *args: str, slow: bool = True,
                  **env: str) -> subprocess.Popen:
    """A 2-rank job through launch/<wrapper>, in its own session (so signals reach only it);
    ``slow``: its steps slowed to ``SLOW_CYCLE_MS``, for a job the test interrupts."""
    if slow:
        env = {"HOROVOD_CYCLE_TIME": SLOW_CYCLE_MS, **env}
    return subprocess.Popen([str(REPO / "launch" / wrapper), "-np", "2", "--", "--run-dir",
                             str(run_dir), "--no-progress", *args],
                            env=rank_env(**env), cwd=run_dir.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def newest_checkpoint(run_dir: Path) -> Checkpoint | None:
    return CheckpointStore(run_dir, 1).latest()


def step_checkpoint_after(run_dir: Path, name: str = "") -> Checkpoint | None:
    """The newest checkpoint if it is a mid-epoch one newer than ``name``."""
    newest = newest_checkpoint(run_dir)
    if newest is not None and "-step-" in newest.name and newest.name > name:
        return newest
    return None


def finish(job: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        output, _ = job.communicate(timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return job.returncode, output


def stop_after_a_step_checkpoint(run_dir: Path, *args: str, **env: str) -> tuple[int, str]:
    """Start a 2-rank mpirun.sh job, SIGTERM it once it has written a mid-epoch checkpoint;
    its (exit code, output)."""
    job = start_wrapper("mpirun.sh", run_dir, *args, **env)
    try:
        wait_for(lambda: step_checkpoint_after(run_dir) or job.poll() is not None, 240)
        os.kill(job.pid, signal.SIGTERM)
    finally:
        code, output = finish(job, 120)
    return code, output
