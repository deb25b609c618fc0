"""Trainer breadth: file formats, Keras datasets, converter, ResNet, compression, Adasum,
accumulation, mixed precision, schedules, TensorBoard, plots, evaluate and predict."""

from __future__ import annotations

import csv
import gzip
import json
import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import (EXACT, assert_partition, assert_same_weights, final_weights, launch,
                      probe_shards, read_metrics, read_summary, train)
from hvdtrain.config import DataConfig, OptimConfig
from hvdtrain.data.convert import convert
from hvdtrain.data.files import tfrecord_split
from hvdtrain.data.keras_files import FASHION_FILES
from hvdtrain.data.load import load_source
from hvdtrain.training.callbacks import PlateauDecay
from hvdtrain.training.schedule import make_schedule


# --- data: TFRecord, CSV, Keras datasets, converter -------------------------------------------

def _id_dataset(tmp_path, n: int, shards: int):
    """TFRecords whose labels are the example ids, so a probe can check the partition."""
    rng = np.random.default_rng(1)
    x = (rng.random((n, 4, 4, 1)) * 255).astype(np.uint8)
    np.savez(tmp_path / "ids.npz", x=x, y=np.arange(n))
    convert(tmp_path / "ids.npz", tmp_path / f"ids-{shards}", shards)
    return str(tmp_path / f"ids-{shards}" / "train-*")


@pytest.mark.distributed
@pytest.mark.parametrize("shards, mode, steps", [(5, "file", 11), (1, "element", 9)])
def test_tfrecord_sharding_is_a_partition_in_both_modes(tmp_path, shards, mode, steps):
    # 203 records, 2 ranks x 12. File mode: shards of 41, 41, 41, 41, 39; the largest share a
    # rank can draw is 3 files = 123 records -> 11 steps. Element mode: 102 -> 9 steps.
    records = probe_shards(tmp_path, "tfrecord", _id_dataset(tmp_path, 203, shards), 12)
    assert {r["mode"] for r in records} == {mode}
    assert_partition(records, 203, steps=steps)


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


@pytest.mark.distributed
def test_tfrecord_and_csv_train_on_two_ranks(tmp_path):
    rng = np.random.default_rng(2)
    teacher = rng.standard_normal((5, 3))
    x = rng.standard_normal((400, 5)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1)
    np.savez(tmp_path / "t.npz", x=x[:300], y=y[:300], x_val=x[300:], y_val=y[300:])
    convert(tmp_path / "t.npz", tmp_path / "rec", shards=1)    # 1 file < 2 ranks: by element
    run = train(tmp_path, "tfrecord", "--dataset", "tfrecord", "--data-path",
                str(tmp_path / "rec" / "train-*"), "--val-data-path",
                str(tmp_path / "rec" / "validation-*"), "--epochs", "8", "--cache",
                "--lr-schedule", "step", "--lr-decay-epochs", "3", "--lr-decay-factor", "0.5",
                "--warmup-epochs", "0")
    assert "sharding 1 file(s) across 2 rank(s) by element" in run.with_suffix(".log").read_text()
    assert read_summary(run)["metrics"]["val_accuracy"] > 0.8
    # 150 records per rank / 32 = 5 steps an epoch; x0.5 every 15 steps, after linear scaling.
    assert [row["lr"] for row in read_metrics(run)] == pytest.approx(
        [0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025])
    for name, rows in (("train", range(300)), ("val", range(300, 400))):
        with open(tmp_path / f"{name}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["a", "b", "label", "c", "d", "e"])
            for i in rows:
                writer.writerow([*x[i, :2], y[i], *x[i, 2:]])
    run = train(tmp_path, "csv", "--dataset", "csv", "--data-path", str(tmp_path / "train.csv"),
                "--val-data-path", str(tmp_path / "val.csv"), "--epochs", "8")
    assert read_summary(run)["metrics"]["val_accuracy"] > 0.8
    assert read_summary(run)["weights_identical"]


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


# --- step: accumulation, compression, Adasum, mixed precision --------------------------------

@pytest.mark.distributed
def test_accumulation_equals_a_k_times_larger_batch(session_tmp):
    accumulated = train(session_tmp, "accumulated", *EXACT, "--batch-size", "16",
                        "--accumulation-steps", "2", "--learning-rate", "0.05")
    large = train(session_tmp, "large-batch", *EXACT, "--batch-size", "64",
                  "--learning-rate", "0.1", np=1)
    assert_same_weights(final_weights(accumulated), final_weights(large), atol=2e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("flag, value", [("--compression", "fp16"), ("--reduction", "adasum")])
def test_compression_and_adasum_train_and_change_the_reduction(session_tmp, exact_runs, flag,
                                                               value):
    run = train(session_tmp, f"reduction-{value}", *EXACT, "--batch-size", "16",
                "--learning-rate", "0.05", flag, value)
    summary = read_summary(run)
    exact = read_summary(exact_runs["fit", 2])
    assert summary["weights_identical"]
    assert summary["fingerprints"][0] != exact["fingerprints"][0]   # the option took effect
    if value == "fp16":   # fp16 rounding only: close to the exact reduction
        assert_same_weights(final_weights(run), final_weights(exact_runs["fit", 2]), atol=5e-3)
        assert summary["metrics"]["val_accuracy"] == pytest.approx(
            exact["metrics"]["val_accuracy"], abs=0.02)
    else:                 # Adasum keeps the single-rank rate (no linear scaling) and learns
        assert read_metrics(run)[0]["lr"] == pytest.approx(0.05)
        losses = [row["loss"] for row in read_metrics(run)]
        assert losses[-1] < losses[0] and summary["metrics"]["val_accuracy"] > 0.6


@pytest.mark.distributed
@pytest.mark.parametrize("precision, loop", [("mixed_float16", "fit"),
                                             ("mixed_float16", "custom"),
                                             ("mixed_bfloat16", "fit")])
def test_mixed_precision_trains_and_saves_float32(session_tmp, precision, loop):
    run = train(session_tmp, f"{precision}-{loop}", "--precision", precision, "--loop", loop,
                "--epochs", "4", "--hidden-units", "64")
    summary = read_summary(run)
    assert summary["weights_identical"] and summary["metrics"]["val_accuracy"] > 0.85
    model = keras.saving.load_model(run / "model.keras", safe_mode=True)
    assert model.dtype_policy.name == "float32"
    assert all(w.dtype == np.float32 for w in model.get_weights())
    x = load_source(DataConfig(), 42).val.x
    assert model.predict(x[:8], verbose=0).dtype == np.float32


# --- model: ResNet with batch norm -----------------------------------------------------------

@pytest.fixture(scope="module")
def resnet_run(session_tmp):
    return train(session_tmp, "resnet", "--model", "resnet", "--resnet-blocks", "1",
                 "--dataset", "synthetic", "--synthetic-shape", "16", "16", "3",
                 "--synthetic-examples", "320", "--epochs", "3", "--batch-size", "32")


@pytest.mark.distributed
def test_resnet_batch_norm_statistics_agree_across_ranks(resnet_run):
    summary = read_summary(resnet_run)
    assert summary["weights_identical"], summary["fingerprints"]
    model = keras.saving.load_model(resnet_run / "model.keras", safe_mode=True)
    norms = [layer for layer in model.layers
             if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) >= 7
    assert any(np.abs(layer.moving_mean.numpy()).max() > 1e-3 for layer in norms)


# --- observability and the evaluate / predict commands --------------------------------------

@pytest.mark.distributed
def test_tensorboard_events_and_curves_png(resnet_run):
    events = list((resnet_run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    seen: dict[str, list[int]] = {}
    for event in tf.compat.v1.train.summary_iterator(str(events[0])):
        for value in event.summary.value:
            seen.setdefault(value.tag, []).append(event.step)
    for tag in ("loss", "accuracy", "val_loss", "val_accuracy", "lr", "examples_per_second"):
        assert seen[tag] == [1, 2, 3], tag
    import matplotlib.image

    png = resnet_run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(png).shape[:2]
    assert width > 3 * height > 600


@pytest.mark.distributed
def test_evaluate_is_exact_on_two_ranks_and_predict_prints_classes(resnet_run, tmp_path):
    report = tmp_path / "evaluation.json"
    result = launch("horovodrun", 2, ["evaluate", str(resnet_run), "--output", str(report)])
    assert result.returncode == 0, result.stdout + result.stderr
    reported = json.loads(report.read_text())
    summary = read_summary(resnet_run)["metrics"]
    assert (reported["examples"], reported["ranks"]) == (64, 2)
    assert reported["accuracy"] == pytest.approx(summary["val_accuracy"], abs=1e-9)
    assert reported["loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    np.save(tmp_path / "inputs.npy", np.zeros((3, 16, 16, 3), np.float32))
    result = launch("none", 1, ["predict", str(resnet_run), "--input",
                                str(tmp_path / "inputs.npy"), "--output",
                                str(tmp_path / "p.npy")])
    assert result.returncode == 0, result.stderr
    assert [line.split(":")[0] for line in result.stdout.splitlines()[:3]] == ["0", "1", "2"]
    assert np.load(tmp_path / "p.npy").shape == (3, 10)


# --- schedules (single process) --------------------------------------------------------------

def test_cosine_and_step_schedules_after_warmup():
    cosine = make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=1, lr_schedule="cosine"),
                           2, 10, epochs=5)
    assert float(cosine(5)) == pytest.approx(0.15)          # warming up: 0.1 -> 0.2
    assert float(cosine(10)) == pytest.approx(0.2)          # warmup done: the scaled rate
    assert float(cosine(30)) == pytest.approx(0.1)          # half way through the cosine
    assert float(cosine(50)) == pytest.approx(0.0, abs=1e-7)
    step = make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=0, lr_schedule="step",
                                     lr_decay_epochs=2, lr_decay_factor=0.5), 4, 10, epochs=9)
    assert [float(step(s)) for s in (0, 19, 20, 45)] == pytest.approx([0.4, 0.4, 0.2, 0.1])
    sqrt = make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=0, lr_scaling="sqrt"),
                         4, 10, epochs=1)
    assert float(sqrt(0)) == pytest.approx(0.2)


def test_plateau_decay_waits_for_patience_and_survives_a_restore():
    schedule = make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=0,
                                         lr_schedule="plateau"), 1, 10, epochs=10)
    plateau = PlateauDecay(schedule, factor=0.5, patience=2)
    for epoch, val_loss in enumerate([1.0, 0.9, 0.95, 0.92, 0.91, 0.8]):
        plateau.on_epoch_end(epoch, {"val_loss": val_loss})
    assert float(schedule(0)) == pytest.approx(0.05)        # one decay, after two stalls
    saved = plateau.state()
    fresh = PlateauDecay(make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=0,
                                                   lr_schedule="plateau"), 1, 10, epochs=10),
                         0.5, 2)
    fresh.load(saved)
    assert fresh.state() == saved and float(fresh.schedule(0)) == pytest.approx(0.05)
