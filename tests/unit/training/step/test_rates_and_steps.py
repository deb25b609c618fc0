"""Single-process checks of the pieces behind ``hvdtrain.fit``'s Keras fidelity: which step a
model gets, the rate callbacks may set, a model's own step on a world of one."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.collectives import LocalCollectives
from hvdtrain.config import OptimConfig
from hvdtrain.data.contract import ArraySplit, DataBundle
from hvdtrain.training.step.own import OwnStep, own_step_methods, owned_optimizers
from hvdtrain.training.step.schedule import RateControl, make_schedule
from hvdtrain.training.step.trainable import own_step_reason, settable_rate


class Counting(keras.Model):
    def train_step(self, data):
        return super().train_step(data)


def _bundle(targets: bool = True) -> DataBundle:
    x = np.zeros((4, 3), np.float32)
    return DataBundle(ArraySplit(x, np.zeros(4, np.int64) if targets else ()), None, 2,
                      targets=targets)


def test_which_step_trains_a_model():
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="softmax")])
    assert own_step_reason(plain, _bundle()) is None                   # uncompiled: default
    plain.compile(loss="sparse_categorical_crossentropy")
    assert own_step_reason(plain, _bundle()) is None
    assert own_step_reason(plain, _bundle(targets=False)) == "the data has no targets"
    plain.compile(optimizer="adam")                                      # add_loss models
    assert "without a loss" in own_step_reason(plain, _bundle())
    inputs = keras.Input((3,))
    custom = Counting(inputs, keras.layers.Dense(2)(inputs))
    assert own_step_methods(custom) == ["train_step"]
    assert own_step_reason(custom, _bundle()) == "it defines train_step"


def test_every_optimizer_a_model_holds_is_found_once():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.d_optimizer = keras.optimizers.Adam()
    model.again = model.optimizer
    assert list(owned_optimizers(model)) == ["optimizer", "d_optimizer"]


def test_callbacks_that_set_the_rate_keep_their_change_on_top_of_the_schedule():
    """Warmup from 0.1 to 0.4 over 10 updates (4 ranks); a callback halves the rate at step 5:
    the schedule goes on at half its value; the factor survives a restore."""
    variable = keras.Variable(np.ones(2, np.float32))
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build([variable])
    schedule = make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=1), 4, 10, 5)
    rates = RateControl(schedule, {"optimizer": (optimizer, 0.1)})
    rates.on_train_begin()
    seen = []
    for step in range(12):
        if step == 5:
            optimizer.learning_rate = float(optimizer.learning_rate) * 0.5   # ReduceLROnPlateau
        rates.on_train_batch_begin(step)
        seen.append(float(optimizer.learning_rate))
        optimizer.apply([tf.zeros(2)], [variable])
    assert seen[0] == pytest.approx(0.1) and seen[4] == pytest.approx(0.22)
    assert seen[5] == pytest.approx(0.25 * 0.5) and seen[11] == pytest.approx(0.2)
    fresh = RateControl(schedule, {"optimizer": (optimizer, 0.1)})
    fresh.load(rates.state())
    assert fresh.factors == {"optimizer": pytest.approx(0.5 * 0.22 / 0.22)}


def test_a_rate_schedule_object_is_not_settable_and_a_second_fit_starts_from_the_base():
    assert settable_rate(keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9))) is None
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.learning_rate = 0.4                      # a run scaled it for 4 ranks
    optimizer._hvdtrain_rates = (0.1, float(optimizer.learning_rate))
    assert settable_rate(optimizer) == pytest.approx(0.1)
    optimizer.learning_rate = 0.3                      # the user set another since
    assert settable_rate(optimizer) == pytest.approx(0.3)


def test_a_models_own_step_on_one_rank_reports_its_metrics_exactly():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = Counting(inputs, keras.layers.Dense(2, activation="softmax")(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    bundle = _bundle()
    step = OwnStep(model, LocalCollectives(), bundle.keras_element)
    x = tf.constant(np.random.default_rng(0).random((4, 3)), tf.float32)
    y = tf.constant([0, 1, 1, 0])
    step.begin_epoch()
    with step.training():
        for _ in range(3):
            logs = step.keras_step((x, y, tf.ones(4), tf.ones(4)))
    assert type(model.optimizer) is keras.optimizers.SGD            # its own class back
    results = step.epoch_results({name: float(value) for name, value in logs.items()})
    assert results["loss"] == pytest.approx(float(logs["loss"]))
    assert set(results) == {"loss", "accuracy"}
    assert float(step.global_loss.numpy()) == pytest.approx(results["loss"])
