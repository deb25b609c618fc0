"""Checkpoints under faults, with real ranks: a rank killed while a checkpoint is written keeps
the previous one, a kill and resume ends equal to an uninterrupted run, and a full disk at a
checkpoint or at a metrics write stops every rank with one line, the last checkpoint whole
(tests/support/full_disk.py). The one-process checkpoint tests are in
tests/unit/checkpoints/test_checkpoints.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from shutil import copytree, ignore_patterns

import numpy as np
import pytest

from conftest import (LAUNCHER, assert_same_weights, final_weights, launch, rank_pid, read_metrics,
                      read_summary, train, wait_for)
from full_disk import fill, one_write_error, small_disk
from hvdtrain.checkpoints.store import Checkpoint, CheckpointStore
from hvdtrain.cli import main
from jobs import ABORT_BOUND_S, assert_nothing_left, finish, start, start_wrapper
from uninterrupted_runs import ARGS

EPOCHS = int(ARGS[ARGS.index("--epochs") + 1])


@pytest.mark.distributed
def test_a_kill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path, capsys):
    """Large weights make each save take a while; rank 0 is killed while a partial checkpoint
    directory exists, which proves the kill landed mid-write."""
    run_dir = tmp_path / "mid-write"
    args = ["--epochs", "40", "--hidden-units", "2048", "2048", "--batch-size", "256"]
    for attempt in range(5):
        job = start(LAUNCHER, run_dir, *args,
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
    from hvdtrain.training.step.schedule import make_optimizer, make_schedule

    model = build_model(ModelConfig(hidden_units=[2048, 2048]), (8, 8, 1), 10)
    optimizer = make_optimizer(OptimConfig(), make_schedule(OptimConfig(), 2, 3, 40))
    optimizer.build(model.trainable_variables)
    latest.restore(model, optimizer)
    assert int(optimizer.iterations.numpy()) > 0
    # And --resume continues from it to the end, every epoch once: in this process at the
    # same global batch (1 x 512 for 2 x 256; the checkpoint, not the ranks, is under test).
    assert main(["--run-dir", str(run_dir), "--no-progress", "--epochs", str(state.epoch + 2),
                 "--hidden-units", "2048", "2048", "--batch-size", "512", "--resume"]) == 0, \
        capsys.readouterr().err
    epochs = [row["epoch"] for row in read_metrics(run_dir)]
    assert epochs == list(range(1, state.epoch + 3))
    assert not list((run_dir / "checkpoints").glob(".partial-*"))


@pytest.mark.distributed
def test_kill_and_resume_matches_an_uninterrupted_run(tmp_path, uninterrupted):
    """Rank 1 SIGKILLed at a random step after the first checkpoint, the end of epoch 1 (no
    step checkpoints here: the resume starts at an epoch boundary, the step checkpoints' resumes
    are the stop tests'); --resume then ends equal to the uninterrupted run, every epoch once.
    Checkpoints change no step, so the reference is the one with step checkpoints. The killed
    job's steps are slowed to SLOW_CYCLE_MS (timing, not the math; 45 steps an epoch), so the
    kill, at most 1 s after the checkpoint, always lands mid-run."""
    args = [*without_step_checkpoints(ARGS), "--loop", "fit"]
    run_dir = tmp_path / "interrupted"
    job = start_wrapper("mpirun.sh", run_dir, *args)
    try:
        wait_for(lambda: CheckpointStore(run_dir, 1).latest() is not None, 180, every=0.02)
        time.sleep(float(np.random.default_rng().uniform(0.0, 1.0)))   # a random step
        os.kill(wait_for(lambda: rank_pid(str(run_dir), 1), 10, every=0.01), signal.SIGKILL)
        job.wait(timeout=ABORT_BOUND_S + 60)
    finally:
        finish(job, 60)
    done = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    assert len(done) < EPOCHS, "the kill came too late to interrupt the run"
    train(tmp_path, "interrupted", *args, "--resume")
    straight = uninterrupted("horovod", "fit")
    assert [row["epoch"] for row in read_metrics(run_dir)] == list(range(1, EPOCHS + 1))
    assert_same_weights(final_weights(straight), final_weights(run_dir), atol=1e-6)
    ours, theirs = read_summary(run_dir)["metrics"], read_summary(straight)["metrics"]
    assert ours["val_accuracy"] == pytest.approx(theirs["val_accuracy"], abs=1e-6)


def without_step_checkpoints(args: list[str]) -> list[str]:
    at = args.index("--checkpoint-every-steps")
    return args[:at] + args[at + 2:]


@pytest.mark.distributed
@pytest.mark.parametrize("zero, free_kib", [([], 100), (["--zero-stage", "2"], 300)])
def test_a_full_disk_during_a_checkpoint_stops_with_one_line_and_keeps_the_previous(
        tmp_path, capsys, zero, free_kib):
    """The run directory on a 4 MiB tmpfs, filled up after epoch 1: the epoch 2 checkpoint
    cannot be written. Both ranks stop with the same line and exit 74; epoch 1's checkpoint is
    whole and loads. Sharded (ZeRO), the weights' file fits and the optimizer's fails part way
    through its gathers, which rank 0 finishes so that rank 1 is not left waiting. Epoch 1 is
    trained in this process at the same global batch (1 x 64 for 2 x 32: the update batch the
    2-rank resume continues at), a launch fewer, and copied onto the small disk (this process
    keeps its run directory locked): only epoch 2 is under test."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                      capture_output=True, timeout=30).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        args = ["--hidden-units", "256", "128", "--no-tensorboard", *zero]
        epoch_1 = tmp_path / "epoch-1"
        assert main(["--run-dir", str(epoch_1), "--no-progress", "--epochs", "1",
                     "--batch-size", "64", *args]) == 0, capsys.readouterr().err
        run_dir = Path(copytree(epoch_1, mount / "run", ignore=ignore_patterns(
            "model.keras")))
        filler = mount / "filler"
        with open(filler, "wb") as handle:   # fill the disk, then free 100 KiB
            try:
                while True:
                    handle.write(b"\0" * 65536)
                    handle.flush()
            except OSError:
                pass
        os.truncate(filler, filler.stat().st_size - free_kib * 1024)
        result = launch(LAUNCHER, 2, ["--run-dir", str(run_dir), "--no-progress",
                                      "--epochs", "2", "--resume", *args], cwd=tmp_path)
        output = result.stdout + result.stderr
        assert result.returncode == 74, output[-3000:]
        errors = re.findall(r"hvdtrain: error: (could not write checkpoint epoch-0002 .*?"
                            r"--resume auto)", output)
        assert len(errors) == 2 and errors[0] == errors[1], output[-3000:]
        assert "No space left on device (ENOSPC); the previous checkpoint " in errors[0]
        assert "Traceback" not in output
        store = CheckpointStore(run_dir, 3)
        assert [p.name for p in store.complete()] == ["epoch-0001"]
        assert store.latest().damage() is None
        assert not list(store.directory.glob(".partial-*"))
        state = json.loads((store.latest().path / "state.json").read_text())
        assert state["epoch"] == 1 and set(state["files"]) == {"weights.npz",
                                                               "optimizer.npz"}
        import keras

        from hvdtrain.config import ModelConfig, OptimConfig
        from hvdtrain.models import build_model
        from hvdtrain.training.step.schedule import make_optimizer, make_schedule

        model = build_model(ModelConfig(hidden_units=[256, 128]), (8, 8, 1), 10)
        optimizer = make_optimizer(OptimConfig(), make_schedule(OptimConfig(), 2, 23, 2))
        optimizer.build(model.trainable_variables)
        store.latest().restore(model, optimizer)
        assert int(optimizer.iterations.numpy()) == 23
        assert isinstance(model, keras.Model)
    finally:
        subprocess.run(["umount", "-l", str(mount)], timeout=30)


@pytest.mark.distributed
def test_a_full_disk_at_a_metrics_write_stops_with_one_line_and_resume_auto_continues(
        tmp_path, capsys):
    """metrics.jsonl on a full disk (a link to a full tmpfs; the checkpoints have room): epoch
    1's checkpoint is written, its metrics row is not. Rank 0 stops with one line and exit 74;
    rank 1, left waiting, leaves without a line; --resume auto continues (the row comes back
    from the checkpoint) and finishes."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = ["--run-dir", str(run_dir), "--no-progress", "--epochs", "2", "--hidden-units", "16",
            "--resume", "auto"]
    with small_disk(tmp_path / "full", "64k") as disk:
        (disk / "metrics.jsonl").touch()
        fill(disk, 0)
        (run_dir / "metrics.jsonl").symlink_to(disk / "metrics.jsonl")
        result = launch(LAUNCHER, 2, args, cwd=tmp_path)
        output = result.stdout + result.stderr
        assert result.returncode == 74, output[-3000:]
        one_write_error(output, "the metrics files", run_dir, "epoch-0001")
        assert Checkpoint(run_dir / "checkpoints" / "epoch-0001").damage() is None
        assert_nothing_left(run_dir)
        # one process at the same global batch (2 x 32 = 1 x 64): the same plan
        assert main([*args, "--batch-size", "64"]) == 0, capsys.readouterr().err
    assert [row["epoch"] for row in read_metrics(run_dir)] == [1, 2]
