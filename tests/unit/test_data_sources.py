"""The data sources: the built-in loaders (digits, npz, CSV, TFRecord, the Keras datasets from
their standard files) and the files they refuse with a message naming the problem, float and
shaped targets from every file format, and the image-folder converter. TFRecord and CSV data
sharded by file or by element and trained on 2 ranks:
tests/distributed/training/test_data_on_two_ranks.py."""

from __future__ import annotations

import gzip
import pickle

import numpy as np
import pytest
import tensorflow as tf

from conftest import launch
from hvdtrain.collectives import World
from hvdtrain.config import DataConfig, ModelConfig
from hvdtrain.data.contract import DataError
from hvdtrain.data.convert import convert
from hvdtrain.data.files import tfrecord_split
from hvdtrain.data.keras_files import FASHION_FILES
from hvdtrain.data.load import load_source
from hvdtrain.data.pipeline import ShardSpec
from hvdtrain.models import ModelError, build_model
from hvdtrain.plugins import PluginError


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


def test_converter_writes_images_and_metadata_that_parse_back(tmp_path):
    folder = tmp_path / "images"
    originals = {}
    for label, name in enumerate(["cat", "dog"]):
        (folder / name).mkdir(parents=True)
        for i in range(3):
            image = np.full((5, 6, 3), 40 * i + label, np.uint8)
            (folder / name / f"{i}.png").write_bytes(tf.io.encode_png(image).numpy())
            originals[(label, i)] = image
    metadata = convert(folder, tmp_path / "out", shards=2)
    assert metadata["classes"] == ["cat", "dog"] and metadata["shape"] == [5, 6, 3]
    assert sum(metadata["counts"].values()) == 6 and metadata["encoding"] == "png"
    split, classes = tfrecord_split(DataConfig(), str(tmp_path / "out" / "train-*"), "glob")
    assert classes == 2
    parsed = [split.parse(r) for f in split.files for r in tf.data.TFRecordDataset(f)]
    pixels = sorted((int(y), float(x.numpy()[0, 0, 0])) for x, y in parsed)
    expected = sorted((label, (40 * i + label) / 255) for label, i in originals)
    assert [label for label, _ in pixels] == [label for label, _ in expected]
    assert [v for _, v in pixels] == pytest.approx([v for _, v in expected])


def _write_standard_files(directory, rng):
    x = rng.integers(0, 256, (30, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, 30).astype(np.uint8)
    np.savez(directory / "mnist.npz", x_train=x[:20], y_train=y[:20], x_test=x[20:],
             y_test=y[20:])
    for name, array in zip(FASHION_FILES, (x[:20], y[:20], x[20:], y[20:])):
        header = bytes([0, 0, 8, array.ndim]) + b"".join(
            d.to_bytes(4, "big") for d in array.shape)
        with gzip.open(directory / name, "wb") as handle:
            handle.write(header + array.tobytes())
    batches = directory / "cifar-10-batches-py"
    batches.mkdir()
    images = rng.integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
    for i, name in enumerate(["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4",
                              "data_batch_5", "test_batch"]):
        chosen = images[2 * i: 2 * i + 2]
        data = {b"data": chosen.transpose(0, 3, 1, 2).reshape(2, -1), b"labels": [i, i + 1]}
        (batches / name).write_bytes(pickle.dumps(data))
    return x, y, images


def test_keras_datasets_load_from_standard_files_in_data_dir(tmp_path):
    x, y, images = _write_standard_files(tmp_path, np.random.default_rng(3))
    for name in ("mnist", "fashion_mnist"):
        bundle = load_source(DataConfig(dataset=name, data_dir=str(tmp_path)), 0)
        assert bundle.input_shape == (28, 28, 1) and bundle.num_classes == 10
        assert bundle.train.num_examples == 20 and bundle.val.num_examples == 10
        np.testing.assert_allclose(bundle.train.x[..., 0], x[:20] / 255, atol=1e-7)
        assert np.array_equal(bundle.val.y, y[20:])
    cifar = load_source(DataConfig(dataset="cifar10", data_dir=str(tmp_path)), 0)
    assert cifar.input_shape == (32, 32, 3) and cifar.train.num_examples == 10
    np.testing.assert_allclose(cifar.train.x[0], images[0] / 255, atol=1e-7)
    assert cifar.val.y.tolist() == [5, 6]


def test_a_tampered_cifar_pickle_is_refused(tmp_path):
    batches = tmp_path / "cifar-10-batches-py"
    batches.mkdir()
    (batches / "data_batch_1").write_bytes(pickle.dumps(print))   # would call code on load
    result = launch("none", 1, ["--dataset", "cifar10", "--data-dir", str(tmp_path),
                                "--run-dir", str(tmp_path / "run")])
    assert result.returncode == 2
    assert "refusing to load builtins.print" in result.stderr


def test_keras_dataset_without_data_dir_or_internet_says_what_to_do(tmp_path):
    result = launch("none", 1, ["--dataset", "fashion_mnist", "--run-dir", str(tmp_path / "r")],
                    KERAS_HOME=str(tmp_path / "keras"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("hvdtrain: error: cannot load fashion_mnist with Keras' "
                                "downloader")
    assert "pass --data-dir DIR holding train-images-idx3-ubyte.gz" in lines[-1]
    assert "Traceback" not in result.stderr
