"""Single-process checks of the sharding plan, the sources, the schedule and checkpoints."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.checkpoint import Checkpoint, CheckpointError, CheckpointStore
from hvdtrain.checkpoint_state import NOT_RECORDED, CheckpointState
from hvdtrain.config import DataConfig, ModelConfig, OptimConfig
from hvdtrain.data.contract import DataError
from hvdtrain.data.load import load_source
from hvdtrain.data.pipeline import ShardSpec, array_dataset, epoch_plan
from hvdtrain.models import ModelError, build_model
from hvdtrain.plugins import PluginError
from hvdtrain.training.resume_check import MixedRuns, check_resumable, optimizers_changed
from hvdtrain.training.schedule import make_schedule, scale_factor
from hvdtrain.world import World


def plans(n: int, size: int, batch: int, remainder: str = "pad", epoch: int = 0):
    specs = [ShardSpec(n, World(rank, size), batch, remainder, True, 5) for rank in range(size)]
    return specs, [tuple(t.numpy() for t in epoch_plan(spec, epoch)) for spec in specs]


@pytest.mark.parametrize("n, size, batch", [(100, 2, 8), (101, 2, 8), (37, 3, 4), (5, 2, 4)])
def test_pad_policy_partitions_every_epoch(n, size, batch):
    specs, shards = plans(n, size, batch)
    ids = np.concatenate([s[0].ravel() for s in shards])
    assert sorted(ids[ids >= 0].tolist()) == list(range(n))       # each example exactly once
    assert len({s[0].shape for s in shards}) == 1                  # same step count per rank
    weights = sum(s[1].sum(axis=1) for s in shards)                # per-step weights sum to 1
    np.testing.assert_allclose(weights, np.ones(specs[0].steps_per_epoch), rtol=1e-6)


def test_drop_policy_skips_only_the_partial_global_batch():
    specs, shards = plans(101, 2, 8, "drop")
    ids = np.concatenate([s[0].ravel() for s in shards])
    assert specs[0].steps_per_epoch == 6 and len(set(ids.tolist())) == 96 and ids.min() >= 0


def test_shuffle_is_seeded_and_changes_each_epoch():
    first = plans(64, 2, 8, epoch=0)[1][0][0]
    again = plans(64, 2, 8, epoch=0)[1][0][0]
    second = plans(64, 2, 8, epoch=1)[1][0][0]
    assert np.array_equal(first, again) and not np.array_equal(first, second)


def test_global_batches_match_one_process_with_the_larger_batch():
    """Rank blocks of each global batch, side by side, are the single process's batch."""
    _, two = plans(50, 2, 4)
    _, one = plans(50, 1, 8)
    side_by_side = np.concatenate([two[0][0], two[1][0]], axis=1)
    assert np.array_equal(side_by_side, one[0][0])


def test_an_epoch_resumed_with_another_world_size_is_still_a_partition():
    """Elastic training: 3 global batches on 2 ranks, then the rest of the epoch on 3 ranks
    from the offset: together every example exactly once."""
    first = [epoch_plan(ShardSpec(101, World(r, 2), 5, "pad", True, 9), 4)[0].numpy()[:3]
             for r in range(2)]
    rest = [epoch_plan(ShardSpec(101, World(r, 3), 5, "pad", True, 9, offset=30), 4)[0].numpy()
            for r in range(3)]
    ids = np.concatenate([a.ravel() for a in first + rest])
    assert sorted(ids[ids >= 0].tolist()) == list(range(101))


def test_dataset_gathers_features_for_the_planned_ids():
    x = np.arange(10, dtype=np.float32)[:, None] * 10
    y = np.arange(10)
    spec = ShardSpec(10, World(1, 2), 3, "pad", True, 1)
    ids, _ = epoch_plan(spec, 0)
    for (features, labels, _, weights), row in zip(array_dataset(x, y, spec), ids.numpy()):
        real = row >= 0
        assert np.array_equal(labels.numpy()[real], row[real])
        assert np.array_equal(features.numpy()[real, 0], row[real] * 10)
        assert np.all(weights.numpy()[~real] == 0)


def test_sources_split_and_report_shapes(tmp_path):
    digits = load_source(DataConfig(), seed=0)
    assert digits.input_shape == (8, 8, 1) and digits.num_classes == 10
    assert digits.train.num_examples + digits.val.num_examples == 1797
    path = tmp_path / "mine.npz"
    np.savez(path, x=np.zeros((20, 3)), y=np.arange(20) % 4)
    mine = load_source(DataConfig(dataset="npz", data_path=str(path)), seed=0)
    assert mine.num_classes == 4 and mine.input_shape == (3,) and mine.val.num_examples == 4


@pytest.mark.parametrize("arrays, message", [
    ({"x": np.zeros((3, 2))}, "has no array 'y'"),
    ({"x": np.zeros((3, 2)), "y": np.zeros(2, int)}, "'x' has 3 examples but 'y' has 2"),
    ({"x": np.zeros((3, 2)), "y": np.array(["a", "b", "c"])}, "'y': targets must be numbers"),
    ({"x": np.zeros((3, 2)), "y": np.array([0, 1, 5]), "num_classes": 3},
     r"labels must lie in \[0, 2\]"),
])
def test_bad_npz_files_are_named(tmp_path, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=message):
        load_source(DataConfig(dataset="npz", data_path=str(path)), seed=0)


def test_missing_data_file_and_unknown_names(tmp_path):
    with pytest.raises(DataError, match="does not exist; check --data-path"):
        load_source(DataConfig(dataset="npz", data_path=str(tmp_path / "nope.npz")), 0)
    with pytest.raises(DataError, match="unknown dataset 'imagenet'"):
        load_source(DataConfig(dataset="imagenet"), 0)
    with pytest.raises(ModelError, match="unknown model 'vgg'"):
        build_model(ModelConfig(model="vgg"), (4,), 2)
    with pytest.raises(PluginError, match="cannot import model module 'no_such_module'"):
        build_model(ModelConfig(model="no_such_module:build"), (4,), 2)


def test_cnn_matches_the_classic_layout():
    model = build_model(ModelConfig(model="cnn"), (28, 28, 1), 10)
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == ["Conv2D", "Conv2D", "MaxPooling2D", "Dropout", "Flatten", "Dense"]
    assert [model.layers[0].filters, model.layers[1].filters] == [64, 128]
    assert model.layers[3].rate == 0.5 and model.output_shape == (None, 10)


def test_schedule_warms_up_to_the_scaled_rate():
    schedule = make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=2), 4, 10, epochs=5)
    assert float(schedule(0)) == pytest.approx(0.1)
    assert float(schedule(10)) == pytest.approx(0.25)     # half way to 0.4
    assert float(schedule(20)) == pytest.approx(0.4)
    assert float(schedule(500)) == pytest.approx(0.4)
    assert scale_factor("sqrt", 4) == 2.0 and scale_factor("none", 4) == 1.0


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


def test_files_and_npz_carry_float_and_shaped_targets(tmp_path):
    """Regression targets from every file source: an .npz keeps y's dtype and shape, a CSV
    label column with fractions is a float target, TFRecord takes --label-dtype/--label-shape;
    none of them needs a class count."""
    import csv

    import tensorflow as tf

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "r.npz", x=rng.random((20, 3)), y=rng.random((20, 2)))
    npz = load_source(DataConfig(dataset="npz", data_path=str(tmp_path / "r.npz")), 0)
    assert npz.num_classes is None and npz.train.y.dtype == np.float32
    assert npz.train.y.shape[1:] == (2,)

    for name in ("train", "val"):
        with open(tmp_path / f"{name}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["a", "b", "label"])
            writer.writerows([[i, i * 2, i * 0.5] for i in range(6)])
    table = load_source(DataConfig(dataset="csv", data_path=str(tmp_path / "train.csv"),
                                   val_data_path=str(tmp_path / "val.csv")), 0)
    _, targets, _, _ = next(iter(table.train.dataset(ShardSpec(6, World(), 6))))
    assert table.num_classes is None and targets.dtype == tf.float32
    assert sorted(targets.numpy().tolist()) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]

    with tf.io.TFRecordWriter(str(tmp_path / "t.tfrecord")) as writer:
        for i in range(4):
            feature = {"image": tf.train.Feature(float_list=tf.train.FloatList(value=[i, i])),
                       "label": tf.train.Feature(float_list=tf.train.FloatList(
                           value=[i / 2, i / 4, i / 8]))}
            writer.write(tf.train.Example(features=tf.train.Features(
                feature=feature)).SerializeToString())
    records = load_source(DataConfig(
        dataset="tfrecord", data_path=str(tmp_path / "t.tfrecord"),
        val_data_path=str(tmp_path / "t.tfrecord"), feature_shape=[2],
        feature_encoding="float", label_dtype="float32", label_shape=[3]), 0)
    _, targets, _, _ = next(iter(records.train.dataset(ShardSpec(4, World(), 4, shuffle=False))))
    assert records.num_classes is None and targets.shape == (4, 3)
    assert sorted(targets.numpy()[:, 0].tolist()) == [0.0, 0.5, 1.0, 1.5]
