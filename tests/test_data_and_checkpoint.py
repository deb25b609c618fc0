"""Single-process checks of the sharding plan, the sources, the schedule and checkpoints."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hvdtrain.checkpoint import CheckpointStore
from hvdtrain.config import DataConfig, ModelConfig, OptimConfig
from hvdtrain.data.contract import DataError
from hvdtrain.data.load import load_source
from hvdtrain.data.pipeline import ShardSpec, array_dataset, epoch_plan
from hvdtrain.models import ModelError, build_model
from hvdtrain.plugins import PluginError
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
    store.save(model, optimizer, {"epoch": 1, "model": "mlp"})
    # A crash mid-write leaves only a partial directory behind: the newest checkpoint stays.
    (tmp_path / "checkpoints" / ".partial-epoch-0002-999").mkdir()
    assert store.latest().name == "epoch-0001"
    before = [w.copy() for w in model.get_weights()]
    model.set_weights([w + 1 for w in before])
    optimizer.iterations.assign(7)
    store.restore(store.latest(), model, optimizer)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    assert int(optimizer.iterations.numpy()) == 0


def test_checkpoints_are_pruned_to_the_newest(tmp_path):
    model, optimizer = _tiny_model_and_optimizer()
    store = CheckpointStore(tmp_path, keep=2)
    for epoch in (1, 2, 3):
        store.save(model, optimizer, {"epoch": epoch})
    assert [p.name for p in store.complete()] == ["epoch-0002", "epoch-0003"]
    assert store.read_state(store.latest())["epoch"] == 3


def test_a_crash_between_the_renames_of_a_swap_loses_nothing(tmp_path):
    """Replacing epoch-0001 renames it aside first; a crash before the new one lands leaves only
    the aside copy, which the next save puts back."""
    model, optimizer = _tiny_model_and_optimizer()
    store = CheckpointStore(tmp_path, keep=1)
    first = store.save(model, optimizer, {"epoch": 1})
    os.rename(first, first.parent / ".stale-epoch-0001-4242")       # the crash point
    assert store.latest() is None
    store.save(model, optimizer, {"epoch": 2})
    assert [p.name for p in store.complete()] == ["epoch-0002"]       # keep=1 after recovery
    assert not list((tmp_path / "checkpoints").glob(".stale-*"))


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
