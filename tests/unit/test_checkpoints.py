"""Checkpoints and resuming from them. In one process: a crash during a write or between the
renames of a swap loses nothing, pruning keeps the newest, a damaged newest checkpoint is set
aside for the one before, the state a checkpoint writes and reads back (``CheckpointState``),
what a resume accepts or refuses, a checkpoint's checksums and every rank's generator states.
With real ranks: a rank killed while a checkpoint is written, a kill and resume equal to an
uninterrupted run, and a full disk at a checkpoint or a metrics write (at the final save, in one
process): one line, and the last checkpoint whole."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import (LAUNCHER, assert_same_weights, final_weights, launch, rank_pid,
                      read_metrics, read_summary, train, wait_for)
from hvdtrain.checkpoint import Checkpoint, CheckpointError, CheckpointStore
from hvdtrain.checkpoint_state import NOT_RECORDED, CheckpointState
from hvdtrain.cli import main
from hvdtrain.config import ModelConfig
from hvdtrain.models import build_model
from hvdtrain.training.resume_check import MixedRuns, check_resumable, optimizers_changed
from jobs import ABORT_BOUND_S, assert_nothing_left, flip_a_byte, start


def _tiny_model_and_optimizer():
    import keras

    model = build_model(ModelConfig(hidden_units=[4]), (3,), 2)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def test_checkpoint_survives_a_crash_during_the_next_write(tmp_path):
    model, optimizer = _tiny_model_and_optimizer()
    store = CheckpointStore(tmp_path, keep=2)
    store.save(model, optimizer, CheckpointState(epoch=1, model="mlp"))
    # A crash mid-write leaves only a partial directory behind: the newest checkpoint stays.
    (tmp_path / "checkpoints" / ".partial-epoch-0002-999").mkdir()
    assert store.latest().name == "epoch-0001"
    before = [w.copy() for w in model.get_weights()]
    model.set_weights([w + 1 for w in before])
    optimizer.iterations.assign(7)
    store.latest().restore(model, optimizer)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    assert int(optimizer.iterations.numpy()) == 0


def test_checkpoints_are_pruned_to_the_newest(tmp_path):
    model, optimizer = _tiny_model_and_optimizer()
    store = CheckpointStore(tmp_path, keep=2)
    for epoch in (1, 2, 3):
        store.save(model, optimizer, CheckpointState(epoch=epoch))
    assert [p.name for p in store.complete()] == ["epoch-0002", "epoch-0003"]
    assert store.latest().read_state().epoch == 3


def test_a_crash_between_the_renames_of_a_swap_loses_nothing(tmp_path):
    """Replacing epoch-0001 renames it aside first; a crash before the new one lands leaves only
    the aside copy, which the next save puts back."""
    model, optimizer = _tiny_model_and_optimizer()
    store = CheckpointStore(tmp_path, keep=1)
    first = store.save(model, optimizer, CheckpointState(epoch=1))
    os.rename(first.path, first.path.parent / ".stale-epoch-0001-4242")     # the crash point
    assert store.latest() is None
    store.save(model, optimizer, CheckpointState(epoch=2))
    assert [p.name for p in store.complete()] == ["epoch-0002"]       # keep=1 after recovery
    assert not list((tmp_path / "checkpoints").glob(".stale-*"))


def test_a_damaged_newest_checkpoint_is_set_aside_for_the_previous(tmp_path):
    import keras

    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model

    model = build_model(ModelConfig(hidden_units=[8]), (4,), 3)
    optimizer = keras.optimizers.SGD()
    optimizer.build(model.trainable_variables)
    store = CheckpointStore(tmp_path, 5)
    older = store.save(model, optimizer, CheckpointState(epoch=1))
    newer = store.save(model, optimizer, CheckpointState(epoch=1, step=20))
    assert [p.name for p in store.complete()] == ["epoch-0001", "epoch-0001-step-000020"]
    flip_a_byte(newer.path / "weights.npz")
    lines: list[str] = []
    assert store.newest_intact(lines.append) == older
    assert len(lines) == 1 and "epoch-0001-step-000020 is damaged (weights.npz does not " \
                               "match its SHA-256)" in lines[0], lines
    assert store.complete() == [older] and (tmp_path / "checkpoints" /
                                            ".damaged-epoch-0001-step-000020").is_dir()


# What a run records about itself, as the checkpoint's JSON holds it.
RUN_FACTS = {"model": "mlp", "dataset": "digits", "input_shape": [8, 8, 1], "num_classes": 10,
             "examples": 1437, "optimizer_classes": {"optimizer": "SGD"}, "world_size": 2,
             "config": {"model": {"hidden_units": [16]}, "optim": {"learning_rate": None},
                        "train": {"epochs": 3}}}
# The same facts as a run builds them (tuples), before JSON.
RUN = CheckpointState(**{**RUN_FACTS, "input_shape": (8, 8, 1), "config": {
    "model": {"hidden_units": (16,)}, "optim": {"learning_rate": None},
    "train": {"epochs": 3}}})
STORE_ADDS = {"optimizers": {"optimizer": ["sequential/dense/kernel"]},
              "files": {"weights.npz": "00ff", "optimizer.npz": "ff00"}}


@pytest.mark.parametrize("live, position", [
    ({"rates": {"optimizer": 1.0}}, {"epoch": 2, "metrics": {"loss": 0.5, "val_loss": 0.6}}),
    ({"rates": {"optimizer": 0.5}, "plateau": {"best": 0.4, "wait": 1, "scale": 0.5}},
     {"epoch": 1, "step": 20, "epoch_state": ([3.0, 40.0], 7.0)}),
], ids=["epoch-end", "within-an-epoch"])
def test_checkpoint_state_writes_the_json_it_always_wrote_and_reads_it_back(live, position):
    """The keys, their order and values are those of the dict the writers assembled before the
    state was typed: the run's facts, the live state, the position, then what the store adds."""
    assembled = {**RUN_FACTS, **live, **position, **STORE_ADDS}
    state = replace(RUN, **live, **position, **STORE_ADDS)
    assert state.to_json() == json.dumps(assembled, indent=2) + "\n"
    assert CheckpointState.from_json(state.to_json()) == replace(
        RUN.as_saved(), **live, **position, **STORE_ADDS)
    assert CheckpointState.from_json(state.to_json()).to_json() == state.to_json()


def test_a_state_written_without_the_optional_fields_reads_with_the_defaults():
    """Older checkpoints hold no example count or optimizer classes (before resume checks), no
    optimizers' variables (before several optimizers), no checksums; an epoch's end holds no
    step, a run without plateau decay no plateau state. What is not recorded is not compared."""
    older = {key: RUN_FACTS[key] for key in ("model", "dataset", "input_shape", "num_classes",
                                             "world_size", "config")}
    state = CheckpointState.from_json(json.dumps({**older, "epoch": 2, "a_later_key": 1}))
    assert (state.epoch, state.step, state.epoch_state, state.metrics) == (2, 0, (), {})
    assert (state.rates, state.plateau, state.files) == ({}, None, {})
    assert state.optimizers == {"optimizer": None}     # the model's optimizer, as it builds
    assert state.examples is NOT_RECORDED and state.optimizer_classes is NOT_RECORDED
    current = replace(RUN, examples=10, optimizer_classes={"optimizer": "Adam"})
    assert check_resumable(state, current, Path("old"), accept_changes=False) == []
    assert not optimizers_changed(state, current)
    bare = CheckpointState.from_json('{"epoch": 3}')
    assert bare.model is None and bare.dataset is NOT_RECORDED and bare.config == {}
    assert "dataset" not in json.loads(bare.to_json())      # still not recorded when written


@pytest.mark.parametrize("text, why", [
    ("{not json", "Expecting property name"), ("[1, 2]", "not a mapping"),
    ('{"model": "mlp"}', "it holds no epoch"), ('{"epoch": null}', "not a number"),
    ('{"epoch": "three"}', "invalid literal")])
def test_text_that_is_no_checkpoint_state_is_refused(text, why):
    with pytest.raises(ValueError, match=why):
        CheckpointState.from_json(text)


SAVED = CheckpointState.from_json(json.dumps({**RUN_FACTS, "epoch": 1}))


@pytest.mark.parametrize("changes, message", [
    ({"model": "cnn"}, "model 'mlp', not 'cnn'; resume with the same --model"),
    ({"input_shape": (4, 4, 1)}, "example shape [8, 8, 1], not [4, 4, 1]; resume with the same "
                                 "model, or start a new --run-dir"),
    ({"num_classes": 3}, "class count 10, not 3; resume with the same model, or start a new "
                         "--run-dir"),
    ({"config": {**RUN.config, "model": {"hidden_units": (32,)}}},
     "--hidden-units [16], not [32]: another model; start a new --run-dir"),
], ids=["model", "input-shape", "classes", "model-option"])
def test_a_resume_with_another_model_is_refused_even_with_accept_changes(changes, message):
    for accept_changes in (False, True):
        with pytest.raises(MixedRuns) as refused:
            check_resumable(SAVED, replace(RUN, **changes), Path("ckpt"), accept_changes)
        assert str(refused.value) == "ckpt was trained with " + message


@pytest.mark.parametrize("changes, change", [
    ({"dataset": "synthetic"}, "--dataset 'digits' -> 'synthetic'"),
    ({"examples": 100}, "training examples 1437 -> 100"),
    ({"optimizer_classes": {"optimizer": "Adam"}},
     "optimizer {'optimizer': 'SGD'} -> {'optimizer': 'Adam'}"),
    ({"config": {**RUN.config, "optim": {"learning_rate": 0.01}}},
     "--learning-rate None -> 0.01"),
    ({"config": {**RUN.config, "train": {"epochs": 9}}, "world_size": 4}, None),
], ids=["dataset", "examples", "optimizer", "setting", "operational"])
def test_other_data_optimizers_or_settings_need_accept_changes(changes, change):
    current = replace(RUN, **changes)
    assert optimizers_changed(SAVED, current) == ("optimizer_classes" in changes)
    if change is None:    # changes freely
        assert check_resumable(SAVED, current, Path("ckpt"), accept_changes=False) == []
        return
    with pytest.raises(MixedRuns) as refused:
        check_resumable(SAVED, current, Path("ckpt"), accept_changes=False)
    assert str(refused.value) == (f"ckpt was trained with other data or settings ({change}); "
                                  "pass --accept-changes to continue with the new ones, or "
                                  "start a new --run-dir")
    assert check_resumable(SAVED, current, Path("ckpt"), accept_changes=True) == [change]


def test_a_checkpoint_holds_its_state_its_checksums_and_every_rank_s_generators(tmp_path):
    model, optimizer = _tiny_model_and_optimizer()
    store = CheckpointStore(tmp_path, keep=3)
    ranks = [[np.array([1, 2], np.int64)], [np.array([3, 4], np.int64)]]
    checkpoint = store.save(model, optimizer, replace(RUN, epoch=1, step=5,
                                                      epoch_state=(7.0,)), ranks)
    assert checkpoint == Checkpoint(tmp_path / "checkpoints" / "epoch-0001-step-000005")
    assert str(checkpoint) == str(checkpoint.path) and store.complete() == [checkpoint]
    state = checkpoint.read_state()
    assert (checkpoint.path / "state.json").read_text() == state.to_json()
    assert state == replace(RUN.as_saved(), epoch=1, step=5, epoch_state=(7.0,),
                            optimizers={"optimizer": [v.path for v in
                                                      model.trainable_variables]},
                            files=state.files)
    assert sorted(state.files) == ["optimizer.npz", "weights.npz"]
    assert [[a.tolist() for a in arrays] for arrays in checkpoint.rank_states()] == [
        [[1, 2]], [[3, 4]]]
    assert checkpoint.damage() is None

    (checkpoint.path / "optimizer.npz").write_bytes(b"other bytes")
    assert checkpoint.damage() == "optimizer.npz does not match its SHA-256"
    (checkpoint.path / "optimizer.npz").unlink()
    assert checkpoint.damage().startswith("optimizer.npz: ")
    (checkpoint.path / "state.json").write_text("[]")
    assert checkpoint.damage() == "state.json is unreadable: not a mapping"
    with pytest.raises(CheckpointError, match="is unreadable .*; delete it to resume from the "
                                              "one before"):
        checkpoint.read_state()
    with pytest.raises(CheckpointError, match=r"no intact checkpoint in .* \(epoch-0001-step-"
                                              r"000005: state.json is unreadable: not a "
                                              r"mapping\); start a new --run-dir"):
        store.newest_intact(print)
    assert store.complete() == [checkpoint]              # nothing set aside


def test_a_checkpoint_without_the_optimizers_record_restores_the_model_optimizer(tmp_path):
    """Checkpoints of earlier versions name no optimizer: their state is the model's."""
    model, optimizer = _tiny_model_and_optimizer()
    optimizer.iterations.assign(5)
    checkpoint = CheckpointStore(tmp_path, keep=1).save(model, optimizer,
                                                        CheckpointState(epoch=1))
    older = json.loads((checkpoint.path / "state.json").read_text())
    del older["optimizers"], older["files"]
    (checkpoint.path / "state.json").write_text(json.dumps(older))
    optimizer.iterations.assign(0)
    checkpoint.restore(model, optimizer)
    assert int(optimizer.iterations.numpy()) == 5


@pytest.mark.distributed
def test_a_kill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path):
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


@pytest.mark.distributed
def test_kill_and_resume_matches_an_uninterrupted_run(tmp_path):
    # 20 short epochs (~0.3 s each here): the kill, at most 1 s after the first checkpoint,
    # always lands mid-run.
    epochs = 20
    args = ["--epochs", str(epochs), "--deterministic", "--hidden-units", "64", "--seed", "5"]
    straight = train(tmp_path, "straight", *args)
    run_dir = tmp_path / "interrupted"
    job = start(LAUNCHER, run_dir, *args)
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


@pytest.mark.distributed
def test_a_full_disk_during_a_checkpoint_stops_with_one_line_and_keeps_the_previous(tmp_path):
    """The run directory on a 4 MiB tmpfs, filled up after epoch 1: the epoch 2 checkpoint
    cannot be written. Both ranks stop with the same line and exit 74; epoch 1's checkpoint is
    whole and loads."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                      capture_output=True, timeout=30).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        args = ["--hidden-units", "256", "128", "--no-tensorboard"]
        run_dir = train(mount, "run", "--epochs", "1", *args)
        (run_dir / "model.keras").unlink()
        filler = mount / "filler"
        with open(filler, "wb") as handle:   # fill the disk, then free 100 KiB
            try:
                while True:
                    handle.write(b"\0" * 65536)
                    handle.flush()
            except OSError:
                pass
        os.truncate(filler, filler.stat().st_size - 100 * 1024)
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
        from hvdtrain.training.schedule import make_optimizer, make_schedule

        model = build_model(ModelConfig(hidden_units=[256, 128]), (8, 8, 1), 10)
        optimizer = make_optimizer(OptimConfig(), make_schedule(OptimConfig(), 2, 23, 2))
        optimizer.build(model.trainable_variables)
        store.latest().restore(model, optimizer)
        assert int(optimizer.iterations.numpy()) == 23
        assert isinstance(model, keras.Model)
    finally:
        subprocess.run(["umount", "-l", str(mount)], timeout=30)


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of ``size`` at ``path`` (root only), unmounted afterwards."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True, timeout=30).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], timeout=30)


def fill(disk: Path, leave_bytes: int) -> Path:
    """Fill ``disk`` up, then free ``leave_bytes``; returns the filler file."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError:
            pass
    os.truncate(filler, max(0, filler.stat().st_size - leave_bytes))
    return filler


def one_write_error(output: str, what: str, run_dir: Path, checkpoint: str) -> None:
    """Exactly one error line, the failed write's, naming the whole checkpoint; no traceback."""
    assert re.findall(r"hvdtrain: error: .*", output) == [
        f"hvdtrain: error: could not write {what} in {run_dir}: No space left on device "
        f"(ENOSPC); the last checkpoint {run_dir}/checkpoints/{checkpoint} is whole; free "
        "space or fix the quota or permissions, then continue with --resume auto"], output[-3000:]
    assert "Traceback" not in output


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
        assert main(args) == 0, capsys.readouterr().err    # one process: the same plan
    assert [row["epoch"] for row in read_metrics(run_dir)] == [1, 2]


def test_a_full_disk_at_the_final_save_stops_with_one_line_and_resume_auto_finishes(
        tmp_path, capsys):
    """A finished epoch's checkpoint on disk, then too little room for the final model: exit 74,
    one line, no partial model left; with room again, --resume auto saves it."""
    with small_disk(tmp_path / "disk", "4m") as disk:
        run_dir = disk / "run"
        args = ["--run-dir", str(run_dir), "--no-progress", "--epochs", "1", "--hidden-units",
                "256", "128", "--resume", "auto"]
        assert main(args) == 0, capsys.readouterr().err
        (run_dir / "model.keras").unlink()
        capsys.readouterr()
        filler = fill(disk, 20 * 1024)
        assert main(args) == 74
        one_write_error(capsys.readouterr().err, "the final model", run_dir, "epoch-0001")
        assert not (run_dir / "model.keras").exists()
        assert not list(run_dir.glob(".model.partial*"))
        filler.unlink()
        assert main(args) == 0, capsys.readouterr().err
        assert (run_dir / "model.keras").exists()
