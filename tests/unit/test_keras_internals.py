"""Every Keras (and tf.data) internal hvdtrain relies on, checked against the installed version
in one process: a Keras upgrade that moves one fails here, by name, instead of deep in a run."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from conftest import REPO
from hvdtrain import keras_internals as internals


def _compiled() -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], loss_weights=None)
    return model


def test_the_keras_pin_is_the_tested_range():
    """pyproject.toml lets pip install exactly the Keras versions this file was run on (a wider
    pin must come with a run of these tests), and ``keras_version`` reads the installed one."""
    [pin] = [Requirement(line) for line in re.findall(r'^\s*"(keras\b[^"]*)"',
                                                      (REPO / "pyproject.toml").read_text(), re.M)]
    (low_major, low_minor), (high_major, high_minor) = internals.TESTED_KERAS
    assert pin.specifier == SpecifierSet(f">={low_major}.{low_minor},<{high_major}.{high_minor}")
    assert internals.keras_version() == Version(keras.__version__).release[:2]


def test_backup_and_restore_sets_the_epoch_fit_starts_at(tmp_path):
    """Keras' ``BackupAndRestore`` tells ``fit`` where to start in the attribute
    ``initial_epoch_of`` reads: a run stopped after its second epoch starts again at 2. (Eager
    steps: tracing ``fit``'s function twice cost 10 s of this test.)"""
    x, y = np.zeros((4, 4)), np.zeros(4)
    seen = []

    def compiled() -> keras.Model:
        model = _compiled()
        model.run_eagerly = True
        return model

    class Interrupt(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.append(internals.initial_epoch_of(self.model))

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    def fit(model: keras.Model) -> keras.callbacks.History:
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        return model.fit(x, y, epochs=4, verbose=0, callbacks=[backup, Interrupt()])

    with pytest.raises(RuntimeError, match="interrupted"):
        fit(compiled())
    resumed = compiled()
    assert fit(resumed).epoch == [2, 3]
    assert seen == [0, 2] and internals.initial_epoch_of(resumed) == 2


def test_compile_arguments():
    model = _compiled()
    arguments = internals.compile_arguments(model)
    assert arguments["loss"] == "sparse_categorical_crossentropy"
    assert arguments["metrics"] == ["accuracy"] and "optimizer" in arguments


def test_sublayers_and_optimizer_variables():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="inner")
    outer = keras.Sequential([keras.Input((4,)), inner, keras.layers.Dense(1)])
    assert any(layer.name == "inner" for layer in internals.sublayers(outer))
    assert len([layer for layer in internals.sublayers(outer)
                if isinstance(layer, keras.layers.Dense)]) == 2
    optimizer = keras.optimizers.Adam()
    optimizer.build(outer.trainable_variables)
    assert [v.path for v in internals.optimizer_variables_built_for(optimizer)] == [
        v.path for v in outer.trainable_variables]


def test_initial_epoch_is_what_fit_starts_at():
    model = _compiled()
    internals.set_initial_epoch(model, 2)
    history = model.fit(np.zeros((4, 4)), np.zeros(4), epochs=3, verbose=0)
    assert history.epoch == [2]
    internals.set_initial_epoch(model, None)


def test_batched_datasets_are_recognised():
    rows = tf.data.Dataset.from_tensor_slices(np.arange(10.0))
    assert not internals.dataset_is_batched(rows)
    assert internals.dataset_is_batched(rows.batch(2).map(lambda x: x).prefetch(1))
    assert internals.dataset_is_batched(rows.padded_batch(2))
    assert not internals.dataset_is_batched(rows.batch(2).unbatch())
    assert internals.dataset_is_batched(keras.utils.timeseries_dataset_from_array(
        np.zeros((20, 2)), None, sequence_length=4, batch_size=3))


def test_the_symbolic_build_builds_loss_and_metrics_without_counting_a_batch():
    """Keras' own build before ``fit`` builds the compiled loss and metrics from a batch's
    shapes (Keras reads them at epoch ends) without an update; the outputs' specs come from
    the same symbolic pass; the loss tracker is the metric reported as ``loss``; a masked
    output's first rows keep their mask cut alike."""
    model = _compiled()
    x, y = np.ones((2, 4), np.float32), np.array([0, 1])
    internals.build_symbolically(model, x, y, None)
    assert model._compile_metrics.built and model._compile_loss.built
    assert all(float(np.sum(v.numpy())) == 0.0 for v in model._compile_metrics.variables)
    specs, masked = internals.symbolic_outputs(model, x)
    assert specs.shape == (2, 3) and not masked
    assert internals.loss_tracker(model).name == "loss"
    probabilities = keras.layers.Dense(3, activation="softmax")(tf.ones((2, 4)))
    assert internals.keras_logits(probabilities) is not None
    assert internals.keras_logits(internals.with_logits(tf.ones(2), tf.zeros(2))) is not None


def test_random_states_and_op_determinism_round_trip():
    """TensorFlow's global seed and operation-seed counter, Keras' global seed generator and
    op determinism are where hvdtrain reads and restores them."""
    keras.utils.set_random_seed(5)
    float(tf.random.uniform(()))
    float(keras.random.uniform(()))
    tf_state, keras_state = internals.tf_random_state(), internals.keras_random_state()
    expected = float(tf.random.uniform(())), float(keras.random.uniform(()))
    keras.utils.set_random_seed(9)
    internals.set_tf_random_state(tf_state)
    internals.set_keras_random_state(keras_state)
    assert (float(tf.random.uniform(())), float(keras.random.uniform(()))) == expected
    before = internals.op_determinism_enabled()
    internals.set_op_determinism(not before)
    assert internals.op_determinism_enabled() == (not before)
    internals.set_op_determinism(before)


def test_synchronized_moments_are_computed_by_the_function_sync_moments_replaced_sets():
    """``ops.moments(..., synchronized=True)`` (a synchronized BatchNormalization's statistics)
    reaches the replacement, float16 inputs cast to float32 first; Keras' own afterwards."""
    from keras.src.backend.tensorflow import nn

    seen = []

    def moments(x, axes, keepdims):
        seen.append((x.dtype, list(axes), keepdims))
        return tf.zeros([3]), tf.ones([3])

    keras_own = nn._compute_moments_sync
    with internals.sync_moments_replaced(moments):
        mean, variance = keras.ops.moments(tf.ones([4, 3], tf.float16), axes=[0],
                                           synchronized=True)
    assert nn._compute_moments_sync is keras_own
    assert seen == [(tf.float32, [0], False)]
    assert mean.dtype == tf.float16 and float(variance[0]) == 1.0


def test_keras_callbacks_print_through_the_function_silenced_on_other_ranks(capsys):
    """Keras' printing callbacks (``EarlyStopping(verbose=1)`` here) and its progress bar print
    through the function ``keras_messages_silenced`` replaces: nothing inside it, Keras' own
    printing again after it (and always where it is not asked to silence)."""
    stopping = keras.callbacks.EarlyStopping(verbose=1)
    stopping.stopped_epoch = 3                   # what it prints at train end: it stopped
    bar = keras.callbacks.ProgbarLogger()
    bar.set_params({"verbose": 1, "epochs": 2, "steps": 1})

    def print_both() -> str:
        stopping.on_train_end()
        bar.on_epoch_begin(0)
        return capsys.readouterr().out

    with internals.keras_messages_silenced():
        assert print_both() == ""
    with internals.keras_messages_silenced(False):
        assert "Epoch 1/2" in print_both()
    assert print_both() == "Epoch 4: early stopping\nEpoch 1/2\n"
