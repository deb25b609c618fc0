"""History is Keras' History: the logs a user's callbacks, ``CSVLogger`` and ``History`` see
under ``hvdtrain.fit`` hold exactly the keys one plain ``model.fit`` produces for the same
program, in its order, and Keras' own progress bar shows them, while the run's own columns
(rate, throughput) still reach the run's files, its checkpoints and ``RunResult`` (single
process: ``hvdtrain.fit`` runs in one too)."""

from __future__ import annotations

import csv
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvdtrain
from hvdtrain.checkpoints.store import CheckpointStore
from hvdtrain.training.loops.run_columns import NoteRunColumns, RunColumnsLog, Throughput

EPOCHS = 2


class LogKeys(keras.callbacks.Callback):
    """Notes the keys of every epoch's logs, in order, as a user's callback sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[str]] = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(list(logs))


def _program() -> tuple[keras.Model, dict]:
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 4)).astype(np.float32), rng.integers(0, 3, 64)
    return model, {"x": x, "y": y, "validation_data": (x[:16], y[:16]), "epochs": EPOCHS,
                   "batch_size": 16}


def _callbacks(directory) -> tuple[LogKeys, list[keras.callbacks.Callback]]:
    keys = LogKeys()
    return keys, [keras.callbacks.ReduceLROnPlateau(patience=1),     # adds learning_rate
                  keras.callbacks.CSVLogger(str(directory / "log.csv")), keys]


def _header(path) -> list[str]:
    with open(path, newline="") as handle:
        return next(csv.reader(handle))


def test_history_and_user_callbacks_see_the_keys_of_one_plain_keras_process(tmp_path, capsys):
    (tmp_path / "keras").mkdir()
    (tmp_path / "ours").mkdir()
    model, fit = _program()
    plain_keys, plain_callbacks = _callbacks(tmp_path / "keras")
    plain = model.fit(callbacks=plain_callbacks, verbose=0, **fit)
    model, fit = _program()
    our_keys, our_callbacks = _callbacks(tmp_path / "ours")
    run_dir = tmp_path / "run"
    result = hvdtrain.fit(model, fit.pop("x"), fit.pop("y"), callbacks=our_callbacks,
                          run_dir=str(run_dir), stall_timeout=0, **fit)

    # Keras' order: its CallbackList sorts an epoch's logs, training and validation together;
    # ReduceLROnPlateau adds its key after that.
    assert list(result.history.history) == list(plain.history) == [
        "accuracy", "loss", "val_accuracy", "val_loss", "learning_rate"]
    assert our_keys.seen == plain_keys.seen
    assert _header(tmp_path / "ours" / "log.csv") == _header(tmp_path / "keras" / "log.csv")
    # Keras' progress bar (verbose="auto"), not hvdtrain's lines, ending each epoch with its
    # exact values.
    shown = capsys.readouterr().out
    assert "ex/s" not in shown and shown.count("Epoch 2/2") == 1
    history = result.history.history
    for epoch in range(EPOCHS):
        assert (f"loss: {history['loss'][epoch]:.4f} - val_accuracy: "
                f"{history['val_accuracy'][epoch]:.4f} - val_loss: "
                f"{history['val_loss'][epoch]:.4f}") in shown, shown

    # The run's own columns: in RunResult, the metrics files, TensorBoard and the
    # checkpoint's row, after Keras' logs.
    assert [row.epoch for row in result.run_columns] == [1, 2]
    assert all(set(row.learning_rates) == {"optimizer"} and row.examples_per_second > 0
               and row.world_size is None for row in result.run_columns)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [list(row)[-2:] for row in rows] == [["lr", "examples_per_second"]] * EPOCHS
    for row, own in zip(rows, result.run_columns):
        assert row["lr"] == own.learning_rates["optimizer"] == pytest.approx(0.01)
        assert row["examples_per_second"] == own.examples_per_second
    assert _header(run_dir / "metrics.csv")[-2:] == ["lr", "examples_per_second"]
    checkpoint = CheckpointStore(run_dir, 1).latest().read_state()
    assert checkpoint.metrics == {name: value for name, value in rows[-1].items()
                                  if name != "epoch"}
    [events] = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    tags = {value.tag for event in tf.compat.v1.train.summary_iterator(str(events))
            for value in event.summary.value}
    assert {"lr", "examples_per_second", "loss", "val_accuracy"} <= tags


def test_several_optimizers_get_a_rate_column_each_and_the_logs_none():
    """A GAN's optimizers: ``<attribute>_lr`` columns; Keras' logs stay as they were."""
    variable = keras.Variable(np.ones(2, np.float32))
    optimizers = {"d_optimizer": keras.optimizers.Adam(0.001),
                  "g_optimizer": keras.optimizers.Adam(0.002),
                  "unused": keras.optimizers.SGD(0.1)}     # never built: not trained
    for optimizer in list(optimizers.values())[:2]:
        optimizer.build([variable])
    log = RunColumnsLog()
    note = NoteRunColumns(Throughput(32), optimizers, log)
    logs = {"d_loss": 0.5, "g_loss": 0.7}
    note.on_epoch_end(0, logs)
    assert logs == {"d_loss": 0.5, "g_loss": 0.7}
    assert log.columns(0) == {"d_optimizer_lr": pytest.approx(0.001),
                              "g_optimizer_lr": pytest.approx(0.002),
                              "examples_per_second": 0.0}
    assert log.columns(1) == {}
    elastic = RunColumnsLog()
    NoteRunColumns(Throughput(32), {"optimizer": optimizers["d_optimizer"]}, elastic,
                   world_size=2).on_epoch_end(0, {})
    NoteRunColumns(Throughput(16), {"optimizer": optimizers["d_optimizer"]}, elastic,
                   world_size=1).on_epoch_end(0, {})           # the epoch redone by a new world
    assert [(row.epoch, row.world_size) for row in elastic.rows] == [(1, 1)]
    assert list(elastic.columns(0)) == ["lr", "examples_per_second", "world_size"]
