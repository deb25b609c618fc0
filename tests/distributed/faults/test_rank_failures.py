"""A rank that fails, for real: killed mid-epoch (under horovodrun, mpirun.sh or Slurm), it
ends the whole job within seconds, leaving no process behind and every saved checkpoint; a loss
that turns NaN stops every rank with one line and keeps the last good checkpoint."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from shutil import copytree

import pytest

from conftest import LAUNCHER, processes_mentioning, rank_pid, read_metrics, wait_for
from hvdtrain.checkpoints.store import CheckpointStore
from hvdtrain.cli import main
from jobs import ABORT_BOUND_S, start

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_a_killed_rank_ends_the_job_quickly_and_leaves_nothing(tmp_path, launcher):
    run_dir = tmp_path / f"killed-{launcher}"
    job = start(launcher, run_dir, "--epochs", "500")
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 180)   # training for real
        victim = wait_for(lambda: rank_pid(str(run_dir), 1), 30)
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        code = job.wait(timeout=ABORT_BOUND_S + 60)
        took = time.time() - killed
    finally:
        if job.poll() is None:
            job.kill()
    output = job.stdout.read()
    assert code != 0, output[-2000:]
    assert took < ABORT_BOUND_S, f"the job took {took:.1f} s to end"
    wait_for(lambda: processes_mentioning(str(run_dir)) == {}, 2)   # none left behind
    assert CheckpointStore(run_dir, 1).latest() is not None    # what was saved is still there


def test_a_killed_rank_fails_the_slurm_job(slurm):
    run_dir = slurm.directory / "killed-slurm"
    job = slurm.submit("--epochs", "500", "--no-progress", "--run-dir", str(run_dir))
    wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 180)
    victim = wait_for(lambda: rank_pid(str(run_dir), 1), 30)
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    record = wait_for(lambda: slurm.finished(job), ABORT_BOUND_S + 60, every=0.5)
    took = time.time() - killed
    print(f"slurm abort took {took:.1f} s")
    assert took < ABORT_BOUND_S
    assert record["JobState"] in ("FAILED", "CANCELLED") and record["ExitCode"] != "0:0"
    wait_for(lambda: processes_mentioning(str(run_dir)) == {}, 2)


def test_nan_loss_stops_every_rank_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    """Two good epochs, then a 2-rank resume at an absurd learning rate: the weights blow up and
    the loss stops being finite during epoch 3. The good epochs train in this process at the
    same global batch (1 x 64 for 2 x 32, the update batch the resume continues at), a launch
    fewer, into a directory copied for the ranks (this process keeps it locked): only the
    resumed epochs are under test."""
    good = tmp_path / "good"
    assert main(["--run-dir", str(good), "--no-progress", "--epochs", "2", "--hidden-units",
                 "32", "--batch-size", "64"]) == 0, capsys.readouterr().err
    run_dir = Path(copytree(good, tmp_path / "diverge"))
    checkpoint = CheckpointStore(run_dir, 1).latest()
    before = {p.name: p.read_bytes() for p in checkpoint.path.iterdir()}
    job = start(LAUNCHER, run_dir, "--epochs", "4", "--hidden-units", "32",
                "--learning-rate", "1e12", "--resume", "--accept-changes")
    output, _ = job.communicate(timeout=240)
    assert job.returncode != 0
    # Counted in the whole output: a launcher may join two ranks' lines into one.
    errors = re.findall(r"hvdtrain: error: (.*?check the data for NaN/Inf)", output)
    assert len(errors) == 2 and errors[0] == errors[1], output[-3000:]   # every rank, alike
    assert re.match(r"loss became (nan|inf|-inf) at epoch 3, step \d+; stopped on every rank",
                    errors[0]), errors[0]
    assert f"the last good checkpoint {checkpoint} is kept" in errors[0]
    assert "Traceback" not in output
    assert CheckpointStore(run_dir, 1).latest() == checkpoint
    assert {p.name: p.read_bytes() for p in checkpoint.path.iterdir()} == before
    assert [row["epoch"] for row in read_metrics(run_dir)] == [1, 2]
