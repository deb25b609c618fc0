"""Checkpoints and resuming from them. In one process: a crash during a write or between the
renames of a swap loses nothing, pruning keeps the newest, a damaged newest checkpoint is set
aside for the one before, the state a checkpoint writes and reads back (``CheckpointState``),
what a resume accepts or refuses, a checkpoint's checksums and every rank's generator states,
and a full disk at the final save: one line, and the last checkpoint whole. With real ranks (a
kill during a write, kill and resume, a full disk at a checkpoint or a metrics write):
tests/distributed/faults/test_checkpoint_faults.py."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from full_disk import fill, one_write_error, small_disk
from hvdtrain.checkpoints.store import Checkpoint, CheckpointError, CheckpointStore
from hvdtrain.checkpoints.state import NOT_RECORDED, CheckpointState
from hvdtrain.cli import main
from hvdtrain.config import ModelConfig
from hvdtrain.models import build_model
from hvdtrain.checkpoints.resume_check import (MixedRuns, check_resumable, kept_rate_scale,
                                               optimizers_changed, resumed_step)
from conftest import fails_with
from jobs import flip_a_byte


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


def _layout(ranks: int, batch: int, accumulation: int = 1, scaling: str = "linear",
            elastic: bool = False, **fields) -> CheckpointState:
    """RUN on ``ranks`` x ``batch`` x ``accumulation`` steps, its rate scaled by ``scaling``."""
    return replace(RUN, world_size=ranks, config={
        "model": RUN.config["model"],
        "optim": {"learning_rate": None, "accumulation_steps": accumulation,
                  "lr_scaling": scaling, "reduction": "mean"},
        "train": {"epochs": 3, "batch_size": batch, "elastic": elastic}}, **fields)


@pytest.mark.parametrize("saved, current, change", [
    ((2, 16), (1, 32), None),
    ((2, 16), (4, 8), None),
    ((2, 16), (1, 16, 2), None),
    ((1, 16, 2), (2, 16), None),
    ((2, 16), (1, 16), "global batch 32 (2 ranks x 16) -> 16 (1 rank x 16)"),
    ((2, 16), (2, 32), "global batch 32 (2 ranks x 16) -> 64 (2 ranks x 32)"),
    ((2, 16), (1, 16, 3), "update batch (global batch x accumulation steps) 32 (2 ranks x 16) "
                          "-> 48 (1 rank x 16 x 3 accumulation steps)"),
], ids=["2x16-1x32", "2x16-4x8", "2x16-1x16x2", "1x16x2-2x16", "2x16-1x16", "2x16-2x32",
        "2x16-1x16x3"])
def test_a_resume_on_another_world_size_is_the_same_run_when_its_update_batch_is(
        saved, current, change):
    """The optimizer sees ranks x batch x accumulation steps: that is compared, not the world
    size or the per-rank batch alone."""
    saved_state = _layout(*saved).as_saved()
    if change is None:
        assert check_resumable(saved_state, _layout(*current), Path("ckpt"), False) == []
        return
    with pytest.raises(MixedRuns) as refused:
        check_resumable(saved_state, _layout(*current), Path("ckpt"), accept_changes=False)
    assert str(refused.value) == (f"ckpt was trained with other data or settings ({change}); "
                                  "pass --accept-changes to continue with the new ones, or "
                                  "start a new --run-dir")
    assert check_resumable(saved_state, _layout(*current), Path("ckpt"), True) == [change]


def test_elastic_runs_and_older_checkpoints_compare_the_batch_per_rank():
    """An elastic run's global batch follows its world by design; a checkpoint that recorded
    no world size has no global batch to compare."""
    saved = _layout(2, 16).as_saved()
    assert check_resumable(saved, _layout(1, 16, elastic=True), Path("ckpt"), False) == []
    unrecorded = replace(saved, world_size=NOT_RECORDED)
    for before, now in ((saved, _layout(1, 32, elastic=True)), (unrecorded, _layout(1, 32))):
        with pytest.raises(MixedRuns, match=r"\(--batch-size 16 -> 32\); pass --accept"):
            check_resumable(before, now, Path("ckpt"), accept_changes=False)


def test_a_resume_with_the_same_update_batch_keeps_the_rate_and_the_examples_done():
    """The position within an epoch is the examples of its permutation done, in this run's
    steps; the rate keeps the world-size factor the checkpoint trained with."""
    saved = _layout(2, 16, step=6).as_saved()
    for current, step in (((1, 32), 6), ((4, 8), 6), ((1, 16, 2), 12), ((1, 16), 12),
                          ((1, 48), 4)):
        assert resumed_step(saved, _layout(*current)) == step, current
    assert resumed_step(saved, _layout(1, 16, 2, elastic=True)) == 6    # elastic: by epoch
    assert kept_rate_scale(saved, _layout(1, 32)) == 2.0
    assert kept_rate_scale(saved, _layout(4, 8)) == 2.0
    assert kept_rate_scale(saved, _layout(1, 16, 2)) == 2.0
    assert kept_rate_scale(_layout(2, 16, scaling="sqrt").as_saved(),
                           _layout(1, 32, scaling="sqrt")) == pytest.approx(2 ** 0.5)
    # A run that kept a factor saves it: resumed again, the factor is the one it trained with.
    assert kept_rate_scale(replace(_layout(1, 32), rate_scale=2.0).as_saved(),
                           _layout(4, 8)) == 2.0
    for current in (_layout(2, 16), _layout(1, 16), _layout(1, 32, scaling="none"),
                    _layout(1, 32, elastic=True)):
        assert kept_rate_scale(saved, current) is None    # its own, or the accepted change's


def test_a_two_rank_checkpoint_resumes_on_one_process_by_its_global_batch(tmp_path, capsys,
                                                                          caplog):
    """A checkpoint of 2 ranks x 16 (written by one process with batch 32, its state made to
    say 2 x 16) continues on 1 x 32 without --accept-changes, at the rate of 2 ranks, which its
    own checkpoints then record; on 1 x 16 it is refused in one line, nothing changed."""
    run = tmp_path / "run"
    args = ["--run-dir", str(run), "--no-progress", "--no-tensorboard", "--hidden-units", "16",
            "--warmup-epochs", "0", "--learning-rate", "0.01"]
    assert main([*args, "--epochs", "1", "--batch-size", "32"]) == 0
    written = run / "checkpoints" / "epoch-0001" / "state.json"
    state = json.loads(written.read_text())
    assert (state["world_size"], state["rate_scale"]) == (1, 1.0)
    state.update(world_size=2, rate_scale=2.0)
    state["config"]["train"]["batch_size"] = 16
    written.write_text(json.dumps(state))
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
              and p.name != ".lock"}
    capsys.readouterr()
    fails_with(capsys, [*args, "--resume", "--epochs", "2", "--batch-size", "16"],
               "was trained with other data or settings (global batch 32 (2 ranks x 16) -> 16 "
               "(1 rank x 16)); pass --accept-changes to continue with the new ones, or start a "
               "new --run-dir")
    assert {p: p.read_bytes() for p in before} == before
    assert main([*args, "--resume", "--epochs", "2", "--batch-size", "32"]) == 0
    assert ("update batch 32 (2 ranks x 16), now 32 (1 rank x 32): the same run, so the rate "
            "keeps its world-size factor x2") in caplog.text
    latest = json.loads((run / "checkpoints" / "epoch-0002" / "state.json").read_text())
    assert (latest["world_size"], latest["rate_scale"]) == (1, 2.0)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["lr"] == pytest.approx(0.02)


def test_a_mid_epoch_checkpoint_resumes_with_another_accumulation_at_its_examples(tmp_path):
    """A checkpoint 4 steps into epoch 1 of 2 ranks x 16 (written by one process with batch
    32, its state made to say 2 x 16) resumes on 1 x 16 x 2 accumulation steps at step 8, the
    same examples done, and ends the epoch where the uninterrupted run did."""
    run = tmp_path / "run"
    args = ["--run-dir", str(run), "--no-progress", "--no-tensorboard", "--hidden-units", "16",
            "--dataset", "synthetic", "--synthetic-examples", "256", "--synthetic-shape", "8",
            "--epochs", "1", "--checkpoint-every-steps", "4"]
    assert main([*args, "--batch-size", "32"]) == 0
    checkpoints = run / "checkpoints"
    with np.load(checkpoints / "epoch-0001" / "weights.npz") as archive:
        uninterrupted = {name: archive[name] for name in archive.files}
    for later in sorted(checkpoints.iterdir())[1:]:
        shutil.rmtree(later)
    written = checkpoints / "epoch-0000-step-000004" / "state.json"
    state = json.loads(written.read_text())
    state.update(world_size=2)
    state["config"]["train"]["batch_size"] = 16
    written.write_text(json.dumps(state))
    assert main([*args, "--resume", "--batch-size", "16", "--accumulation-steps", "2"]) == 0
    with np.load(checkpoints / "epoch-0001" / "weights.npz") as archive:
        for name, weights in uninterrupted.items():
            np.testing.assert_allclose(archive[name], weights, rtol=0, atol=1e-6)


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


def test_the_final_model_in_a_relative_run_directory_keeps_its_assets(tmp_path, monkeypatch):
    """An adapted lookup keeps its vocabulary as a Keras asset; the final model, written
    unzipped then archived, must carry it also when the run directory is relative."""
    import keras
    import tensorflow as tf

    from hvdtrain.training.closing import save_model

    monkeypatch.chdir(tmp_path)
    lookup = keras.layers.StringLookup()
    lookup.adapt(tf.constant(["red", "green", "blue", "green"]))
    words = keras.Input((1,), dtype="string")
    model = keras.Model(words, keras.layers.Dense(1)(
        keras.layers.CategoryEncoding(lookup.vocabulary_size(), "one_hot")(lookup(words))))
    model.compile("adam", "mse")
    model.fit(tf.constant([["red"], ["blue"]]), np.ones((2, 1)), verbose=0)   # state to save
    run_dir = Path("run")
    run_dir.mkdir()
    saved = save_model(run_dir, model)
    sample = tf.constant([["green"], ["blue"], ["mauve"]])
    loaded = keras.saving.load_model(saved)
    np.testing.assert_array_equal(loaded.predict(sample, verbose=0),
                                  model.predict(sample, verbose=0))
    assert sorted(p.name for p in run_dir.iterdir()) == ["model.keras"]
