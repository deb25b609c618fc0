"""The data sources: the built-in loaders (digits, npz, CSV, TFRecord, the Keras datasets from
their standard files) and the files they refuse with a message naming the problem, float and
shaped targets from every file format, the image-folder converter, and a user's arrays in every
structure Keras' ``model.fit`` takes (lists, tuples, dicts, nests; targets and sample weights per
output). TFRecord and CSV data sharded by file or by element and trained on 2 ranks:
tests/distributed/training/test_data_on_two_ranks.py."""

from __future__ import annotations

import gzip
import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvdtrain
from conftest import fails_with, launch
from hvdtrain.collectives import World
from hvdtrain.config import DataConfig, ModelConfig
from hvdtrain.data.contract import DataError
from hvdtrain.data.convert import convert
from hvdtrain.data.files import tfrecord_split
from hvdtrain.data.keras_files import FASHION_FILES
from hvdtrain.data.load import load_source
from hvdtrain.data.pipeline import ShardSpec
from hvdtrain.data.user import KerasData, user_bundle
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


def test_a_tampered_cifar_pickle_is_refused(tmp_path, capsys):
    batches = tmp_path / "cifar-10-batches-py"
    batches.mkdir()
    (batches / "data_batch_1").write_bytes(pickle.dumps(print))   # would call code on load
    fails_with(capsys, ["--dataset", "cifar10", "--data-dir", str(tmp_path),
                        "--run-dir", str(tmp_path / "run")], "refusing to load builtins.print")


@pytest.mark.slow
def test_keras_dataset_without_data_dir_or_internet_says_what_to_do(tmp_path):
    """A fresh process: Keras reads KERAS_HOME (an empty cache here) when it is imported."""
    result = launch("none", 1, ["--dataset", "fashion_mnist", "--run-dir", str(tmp_path / "r")],
                    KERAS_HOME=str(tmp_path / "keras"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("hvdtrain: error: cannot load fashion_mnist with Keras' "
                                "downloader")
    assert "pass --data-dir DIR holding train-images-idx3-ubyte.gz" in lines[-1]
    assert "Traceback" not in result.stderr


# --- Arrays in every structure Keras' model.fit takes (issue 46) --------------------------------

def _column(key: int, width: int, rows: int = 12) -> np.ndarray:
    """Rows that say which array and which example they are (row i of array k: 10 i + k)."""
    return np.repeat(np.arange(rows, dtype=np.float32)[:, None] * 10 + key, width, axis=1)


X1, X2, X3, Y1, Y2 = _column(1, 3), _column(2, 5), _column(3, 2), _column(4, 1), _column(5, 2)
W1, W2 = np.arange(12, dtype=np.float32) + 1, np.arange(12, dtype=np.float32) + 100


def _first_batch(split, batch: int = 4) -> tuple:
    spec = ShardSpec(split.num_examples, World(), batch, shuffle=False)
    return next(iter(split.dataset(spec)))


def _assert_batch(found, given, rows: int = 4) -> None:
    """``found`` is the first ``rows`` of ``given`` in the structure Keras' array adapter hands a
    model (``tree.lists_to_tuples``: tf.data would stack a list)."""
    expected = tf.nest.map_structure(lambda a: np.asarray(a)[:rows],
                                     keras.tree.lists_to_tuples(given))
    tf.nest.assert_same_structure(found, expected, check_types=True)
    for got, want in zip(tf.nest.flatten(found), tf.nest.flatten(expected)):
        np.testing.assert_array_equal(np.asarray(got), want.reshape(np.shape(got)))


@pytest.mark.parametrize("x, y, weights", [
    ([X1, _column(2, 3)], Y1, None),                            # a list of equal shapes
    ([X1, X2], Y1, W1),                                         # a list of different shapes
    ((X1, X2), Y1, None),                                       # a tuple
    ({"pair": [X1, X2], "c": X3}, Y1, None),                    # a dict holding a list
    (X1, [Y1, Y2], W1),                                         # two outputs, one weight
    (X1, [Y1, Y2], [W1, W2]),                                   # a weight per output
    (X1, {"a": Y1, "b": Y2}, {"a": W1, "b": W2}),
    (X1, [Y1, Y2], [W1, W2[:, None]]),                          # shapes (N,) and (N, 1)
    (X1, Y1, W1.tolist()),                                      # a list of numbers
])
def test_array_structures_reach_the_batches_as_keras_hands_them(x, y, weights):
    bundle = user_bundle(KerasData(x, y, weights, validation_data=(x, y, weights)),
                         DataConfig(), 0)
    one_each = weights is None or np.ndim(tf.nest.flatten(weights)[0]) == 0   # a list of numbers
    wanted = np.ones(12, np.float32) if weights is None else (
        np.asarray(weights) if one_each else weights)
    for split in (bundle.train, bundle.val):
        features, targets, found_weights, _ = _first_batch(split)
        _assert_batch(features, x)
        _assert_batch(targets, y)
        _assert_batch(found_weights, wanted)
    assert bundle.sample_weights == (weights is not None)


def test_a_tuple_is_fits_inputs_but_a_data_functions_x_and_y():
    given = user_bundle(KerasData((X1, X2)), DataConfig(), 0)    # Keras: two inputs, no y
    assert not given.targets and given.input_shape == ((3,), (5,))
    _assert_batch(_first_batch(given.train)[0], (X1, X2))
    returned = user_bundle((X1, Y1), DataConfig(validation_split=0.25), 0)   # --dataset fn
    assert returned.targets and returned.input_shape == (3,) and returned.val.num_examples == 3
    assert user_bundle(KerasData(lambda: (X1, Y1)), DataConfig(), 0).targets


@pytest.mark.parametrize("arguments, message", [
    ({"y": Y1, "sample_weight": [W1, W2]}, "sample_weight is a list or dict but y is one array"),
    ({"y": {"a": Y1, "b": Y2}, "sample_weight": {"a": W1, "c": W2}},
     "sample_weight has another structure than y"),
    ({"y": [Y1, Y2], "sample_weight": [W1]}, "sample_weight has another structure than y"),
    ({"y": Y1, "sample_weight": np.ones((12, 3))}, r"sample weights of shape \(12, 3\) weigh "
                                                   "parts of an example"),
    ({"y": Y1, "validation_data": (X1, Y1, W1, W1)}, "validation_data has 4 parts"),
    ({"x": [X1, 2.0], "y": Y1}, "features hold a single value"),
])
def test_structures_keras_would_not_take_are_refused_in_one_line(arguments, message):
    with pytest.raises(DataError, match=message):
        user_bundle(KerasData(**{"x": X1, **arguments}), DataConfig(), 0)


def test_fit_trains_on_every_structure_as_model_fit_does(tmp_path):
    """One process, the same start and order, as ``model.fit``: a siamese model's list of
    inputs of two shapes, two outputs with a sample weight per output, and validation
    ``(x_list, y_list, sample_weight)`` under hvdtrain's step; per-output weights under the
    model's own train_step."""
    class OwnStep(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    def outputs(hidden: keras.KerasTensor) -> list:
        return [keras.layers.Dense(1, name="one")(hidden),
                keras.layers.Dense(2, name="two")(hidden)]

    def siamese():
        a, b = keras.Input((3,)), keras.Input((5,))
        joined = keras.layers.Concatenate()([keras.layers.Dense(4, activation="tanh")(a), b])
        return keras.Model([a, b], outputs(joined))

    def own_step():
        a = keras.Input((3,))
        return OwnStep(a, outputs(keras.layers.Dense(4, activation="tanh")(a)))

    rng = np.random.default_rng(3)
    x1, x2, y1, y2 = (rng.standard_normal((12, width)).astype(np.float32)
                      for width in (3, 5, 1, 2))
    weights = [W1 / 12, W2 / 100]
    cases = [(siamese, {"x": [x1, x2], "y": [y1, y2], "sample_weight": weights,
                        "validation_data": ([x1, x2], [y1, y2], W1 / 12)}),
             (own_step, {"x": x1, "y": [y1, y2], "sample_weight": weights})]
    for build, data in cases:
        keras.utils.set_random_seed(1)
        ours, theirs = build(), build()
        theirs.set_weights(ours.get_weights())
        for model in (ours, theirs):
            model.compile(keras.optimizers.SGD(0.1), "mse")
        expected = theirs.fit(**data, batch_size=4, shuffle=False, verbose=0).history
        result = hvdtrain.fit(ours, **data, batch_size=4, epochs=1, shuffle=False, verbose=0,
                              run_dir=str(tmp_path / build.__name__))
        assert result.history.history.keys() == expected.keys()
        for key, values in expected.items():
            np.testing.assert_allclose(result.history.history[key], values, rtol=1e-5)
        for found, wanted in zip(result.model.get_weights(), theirs.get_weights()):
            np.testing.assert_allclose(found, wanted, atol=1e-6)
