"""Faults caused for real: a rank killed mid-epoch, a kill while a checkpoint is written, a
kill and resume, and a loss that turns NaN. No job may hang and no checkpoint may be lost."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (BIN, REPO, assert_same_weights, final_weights, processes_mentioning,
                      rank_env, rank_pid, read_metrics, read_summary, train, wait_for)
from hvdtrain.checkpoint import CheckpointStore
from hvdtrain.writes import json_rows

pytestmark = pytest.mark.distributed
# A killed rank must end the whole job within this many seconds (measured: a few seconds).
ABORT_BOUND_S = 30


def start(launcher: list[str], run_dir: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*launcher, str(BIN / "python"), "-m", "hvdtrain", "--run-dir",
                             str(run_dir), "--no-progress", *args],
                            env=rank_env(), cwd=run_dir.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)


LAUNCHERS = {
    "horovodrun": [str(BIN / "horovodrun"), "-np", "2"],
    "mpirun": [str(REPO / "launch" / "mpirun.sh"), "-np", "2", "--command"],
}


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_a_killed_rank_ends_the_job_quickly_and_leaves_nothing(tmp_path, launcher):
    run_dir = tmp_path / f"killed-{launcher}"
    if launcher == "mpirun":   # --command takes the whole program as one string
        command = " ".join([str(BIN / "python"), "-m", "hvdtrain", "--run-dir", str(run_dir),
                            "--no-progress", "--epochs", "500"])
        job = subprocess.Popen([*LAUNCHERS[launcher], command], env=rank_env(), cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               stdin=subprocess.DEVNULL)
    else:
        job = start(LAUNCHERS[launcher], run_dir, "--epochs", "500")
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
    time.sleep(2)
    assert processes_mentioning(str(run_dir)) == {}, "processes left behind"
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
    time.sleep(2)
    assert processes_mentioning(str(run_dir)) == {}


def test_a_kill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path):
    """Large weights make each save take a while; rank 0 is killed while a partial checkpoint
    directory exists, which proves the kill landed mid-write."""
    run_dir = tmp_path / "mid-write"
    args = ["--epochs", "40", "--hidden-units", "2048", "2048", "--batch-size", "256"]
    for attempt in range(5):
        job = start(LAUNCHERS["horovodrun"], run_dir, *args,
                    *(["--resume"] if attempt else []))
        try:
            checkpoints = run_dir / "checkpoints"
            wait_for(lambda: checkpoints.is_dir() and any(checkpoints.glob("epoch-*")), 240,
                     every=0.05)
            partial = wait_for(lambda: next(checkpoints.glob(".partial-*"), None), 240,
                               every=0.002)
            writer = wait_for(lambda: rank_pid(str(run_dir), 0), 10, every=0.01)
            os.kill(writer, signal.SIGKILL)
            job.wait(timeout=ABORT_BOUND_S + 60)
        finally:
            if job.poll() is None:
                job.kill()
        if partial.exists():       # killed mid-write: the case under test
            break
    else:
        pytest.fail("never managed to kill rank 0 while it was writing a checkpoint")
    store = CheckpointStore(run_dir, 3)
    latest = store.latest()
    state = latest.read_state()
    assert not latest.name.startswith(".")
    # The previous checkpoint loads: weights and optimizer state restore without error.
    from hvdtrain.config import ModelConfig, OptimConfig
    from hvdtrain.models import build_model
    from hvdtrain.training.schedule import make_optimizer, make_schedule

    model = build_model(ModelConfig(hidden_units=[2048, 2048]), (8, 8, 1), 10)
    optimizer = make_optimizer(OptimConfig(), make_schedule(OptimConfig(), 2, 3, 40))
    optimizer.build(model.trainable_variables)
    latest.restore(model, optimizer)
    assert int(optimizer.iterations.numpy()) > 0
    # And --resume continues from it to the end, every epoch once.
    resumed = train(tmp_path, "mid-write", *args[:1], str(state.epoch + 2), *args[2:],
                    "--resume")
    epochs = [row["epoch"] for row in read_metrics(resumed)]
    assert epochs == list(range(1, state.epoch + 3))
    assert not list((run_dir / "checkpoints").glob(".partial-*"))


def test_kill_and_resume_matches_an_uninterrupted_run(tmp_path):
    # 20 short epochs (~0.3 s each here): the kill, at most 1 s after the first checkpoint,
    # always lands mid-run.
    epochs = 20
    args = ["--epochs", str(epochs), "--deterministic", "--hidden-units", "64", "--seed", "5"]
    straight = train(tmp_path, "straight", *args)
    run_dir = tmp_path / "interrupted"
    job = start(LAUNCHERS["horovodrun"], run_dir, *args)
    try:
        wait_for(lambda: CheckpointStore(run_dir, 1).latest() is not None, 180, every=0.02)
        time.sleep(float(np.random.default_rng().uniform(0.0, 1.0)))   # a random step
        os.kill(wait_for(lambda: rank_pid(str(run_dir), 1), 10, every=0.01), signal.SIGKILL)
        job.wait(timeout=ABORT_BOUND_S + 60)
    finally:
        if job.poll() is None:
            job.kill()
    done = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    assert len(done) < epochs, "the kill came too late to interrupt the run"
    train(tmp_path, "interrupted", *args, "--resume")
    assert [row["epoch"] for row in read_metrics(run_dir)] == list(range(1, epochs + 1))
    assert_same_weights(final_weights(straight), final_weights(run_dir), atol=1e-6)
    ours, theirs = read_summary(run_dir)["metrics"], read_summary(straight)["metrics"]
    assert ours["val_accuracy"] == pytest.approx(theirs["val_accuracy"], abs=1e-6)


def test_nan_loss_stops_every_rank_and_keeps_the_last_good_checkpoint(tmp_path):
    """Two good epochs, then a resume at an absurd learning rate: the weights blow up and the
    loss stops being finite during epoch 3."""
    run_dir = train(tmp_path, "diverge", "--epochs", "2", "--hidden-units", "32")
    checkpoint = CheckpointStore(run_dir, 1).latest()
    before = {p.name: p.read_bytes() for p in checkpoint.path.iterdir()}
    job = start(LAUNCHERS["horovodrun"], run_dir, "--epochs", "4", "--hidden-units", "32",
                "--learning-rate", "1e12", "--resume", "--accept-changes")
    output, _ = job.communicate(timeout=240)
    assert job.returncode != 0
    # Counted in the whole output: horovodrun may join two ranks' lines into one.
    errors = re.findall(r"hvdtrain: error: (.*?check the data for NaN/Inf)", output)
    assert len(errors) == 2 and errors[0] == errors[1], output[-3000:]   # every rank, alike
    assert re.match(r"loss became (nan|inf|-inf) at epoch 3, step \d+; stopped on every rank",
                    errors[0]), errors[0]
    assert f"the last good checkpoint {checkpoint} is kept" in errors[0]
    assert "Traceback" not in output
    assert CheckpointStore(run_dir, 1).latest() == checkpoint
    assert {p.name: p.read_bytes() for p in checkpoint.path.iterdir()} == before
    assert [row["epoch"] for row in read_metrics(run_dir)] == [1, 2]


def start_elastic(tmp_path: Path, discovery: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """An elastic job of 1 to 2 ranks on the hosts that the shell lines ``discovery`` print
    (batch 8, no warmup); returns it and its run directory."""
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\n{discovery}\n")
    discover.chmod(0o755)
    run_dir = tmp_path / "elastic"
    job = subprocess.Popen(
        [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
         "--host-discovery-script", str(discover), "--network-interface", "lo",
         str(BIN / "python"), "-m", "hvdtrain", "--elastic", "--run-dir", str(run_dir),
         "--batch-size", "8", "--warmup-epochs", "0", "--no-progress", *args],
        env=rank_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, stdin=subprocess.DEVNULL)
    return job, run_dir


def test_elastic_run_survives_a_slot_leaving_and_joining(tmp_path):
    """Start on 2 slots, drop one mid-epoch, add it back: all epochs finish, the world-size
    changes are logged, the rate follows the world size, and every epoch is a full pass."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:2\n")
    epochs = 8
    job, run_dir = start_elastic(tmp_path, f"cat {hosts}", "--epochs", str(epochs),
                                 "--commit-every", "4")

    def logged() -> list[dict]:
        return json_rows(run_dir / "elastic.jsonl")

    def while_running(condition, timeout: float) -> None:
        wait_for(lambda: job.poll() is not None or condition(), timeout)
        assert job.poll() is None, f"the job ended early:\n{job.stdout.read()[-3000:]}"

    try:
        while_running(lambda: any(s["epoch"] == 2 for s in logged()), 240)
        time.sleep(1.0)                                  # into epoch 2
        hosts.write_text("localhost:1\n")
        while_running(lambda: any(s["world_size"] == 1 for s in logged()), 120)
        hosts.write_text("localhost:2\n")
        while_running(lambda: logged()[-1]["world_size"] == 2, 120)
        output, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-3000:]
    sizes = [s["world_size"] for s in logged()]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2
    assert any(s["offset"] > 0 for s in logged()), "no world change came mid-epoch"
    for epoch in range(1, epochs + 1):       # each epoch starts at 0 and only moves forward
        offsets = [s["offset"] for s in logged() if s["epoch"] == epoch]
        assert offsets[0] == 0 and offsets == sorted(offsets)
    for segment in logged():                  # linear scaling follows the world size
        assert segment["lr"] == pytest.approx(0.05 * segment["world_size"])
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == list(range(1, epochs + 1))
    for row in rows:
        assert row["lr"] == pytest.approx(0.05 * row["world_size"])
    assert read_summary(run_dir)["weights_identical"]


def test_elastic_run_continues_on_the_survivor_when_a_rank_is_terminated(tmp_path):
    """2 -> 1: rank 1 gets SIGTERM mid-epoch (under --elastic a signalled rank leaves at once);
    the survivor's step fails in its grouped allreduce, which Horovod's elastic loop alone would
    take for the end of training. It must re-form the world on its own, continue from the last
    commit and finish every epoch. Commits only at epoch ends: a commit also checks for host
    changes, which would otherwise often reach the survivor before its step fails. Two host
    names for one machine: Horovod blacklists the host of a failed rank, and a job whose every
    host is blacklisted stops."""
    epochs = 3
    job, run_dir = start_elastic(tmp_path, "echo localhost:1; echo 127.0.0.1:1", "--epochs",
                                 str(epochs), "--commit-every", "1000", "--dataset", "synthetic",
                                 "--synthetic-examples", "8000", "--synthetic-shape", "16",
                                 "--hidden-units", "16")

    def logged() -> list[dict]:
        return json_rows(run_dir / "elastic.jsonl")

    try:
        wait_for(lambda: job.poll() is not None or any(s["epoch"] == 2 for s in logged()), 240)
        assert job.poll() is None, job.stdout.read()[-3000:]
        time.sleep(1.0)                                  # into epoch 2
        os.kill(wait_for(lambda: rank_pid(str(run_dir), 1), 30), signal.SIGTERM)
        output, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-3000:]
    # (A world change during start-up can add a segment of 2 ranks at epoch 1's start.)
    segments_seen = [(s["epoch"], s["world_size"]) for s in logged()]
    assert segments_seen[-3:] == [(2, 2), (2, 1), (3, 1)], logged()
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == list(range(1, epochs + 1))
    assert rows[-1]["world_size"] == 1
    assert read_summary(run_dir)["world_size"] == 1
    assert processes_mentioning(str(run_dir)) == {}
