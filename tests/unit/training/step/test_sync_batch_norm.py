"""Synchronized batch normalisation in one process (a world of one, no MPI): the cross-rank
sum and its gradient, the statistics over the real rows only, Keras' own function put back and
the layers left as they were, the run's note and refusal. The 2-rank exactness is checked with
real ranks (``fit_api_checks``, ``collective_rank_checks``)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.collectives import LocalCollectives, differentiable_sum
from hvdtrain.errors import AgreedError
from hvdtrain.training.step.sync_batch_norm import (batch_norm_note, batch_rows, global_moments,
                                                    synchronized_batch_norm)


def _model(synchronized: bool) -> keras.Model:
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, use_bias=False),
                              keras.layers.BatchNormalization(synchronized=synchronized),
                              keras.layers.LayerNormalization(),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(2.0, 3.0, (64, 6)).astype(np.float32), rng.integers(0, 3, 64)


def test_differentiable_sum_of_a_world_of_one_is_each_tensor_with_its_gradient():
    values = tf.Variable([1.0, 2.0, 3.0])
    with tf.GradientTape() as tape:
        [total] = differentiable_sum(LocalCollectives(), [values * 2.0])
        loss = tf.reduce_sum(total * [1.0, 10.0, 100.0])
    np.testing.assert_array_equal(total, [2.0, 4.0, 6.0])
    np.testing.assert_array_equal(tape.gradient(loss, values), [2.0, 20.0, 200.0])
    assert differentiable_sum(LocalCollectives(), []) == []


@pytest.mark.parametrize("every_layer", [False, True])
def test_training_in_a_world_of_one_is_keras_own_and_everything_is_put_back(every_layer):
    """With the replacement in place, ``fit`` ends with exactly the weights of Keras' own
    synchronized path (a world of one sums nothing); afterwards Keras' function and the
    layers' ``synchronized`` are as they were, also after an error inside."""
    from keras.src.backend.tensorflow import nn

    x, y = _data()
    reference = _model(True)
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    ours = _model(not every_layer)
    keras_own = nn._compute_moments_sync
    with synchronized_batch_norm(ours, LocalCollectives(), every_layer):
        assert nn._compute_moments_sync is not keras_own
        assert ours.layers[1].synchronized
        ours.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert nn._compute_moments_sync is keras_own
    assert ours.layers[1].synchronized is (not every_layer)
    for a, b in zip(reference.get_weights(), ours.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(RuntimeError, match="inside"):
        with synchronized_batch_norm(ours, LocalCollectives(), every_layer):
            raise RuntimeError("inside")
    assert nn._compute_moments_sync is keras_own
    assert ours.layers[1].synchronized is (not every_layer)


def test_a_model_without_synchronized_layers_is_left_alone():
    from keras.src.backend.tensorflow import nn

    keras_own = nn._compute_moments_sync
    with synchronized_batch_norm(_model(False), LocalCollectives(), every_layer=False):
        assert nn._compute_moments_sync is keras_own


@pytest.mark.parametrize("steps", [1, 3])
def test_statistics_and_their_gradients_count_the_real_rows_only(steps):
    """Filler rows (far from the real ones) move neither the statistics nor any gradient; a
    layer that sees ``steps`` entries per row (``TimeDistributed``) repeats each row's flag.
    Keras' own path over the real rows alone is the reference."""
    rng = np.random.default_rng(1)
    real = tf.constant([True, True, False, True, False])
    values = rng.normal(1.0, 2.0, (5, steps, 4)).astype(np.float32)
    values[~real.numpy()] = 1e4
    x = tf.Variable(values.reshape(5 * steps, 4))
    weights = tf.range(4, dtype=tf.float32) + 1.0
    from keras.src.backend.tensorflow import nn

    with tf.GradientTape(persistent=True) as tape:
        with batch_rows(real):
            mean, variance = global_moments(LocalCollectives(), x, [0], keepdims=False)
        kept = tf.reshape(tf.boolean_mask(tf.reshape(x, [5, steps, 4]), real), [-1, 4])
        mean_ref, variance_ref = nn._compute_moments_sync(kept, [0], False)
        loss = tf.reduce_sum(mean * weights) + tf.reduce_sum(variance * weights)
        loss_ref = tf.reduce_sum(mean_ref * weights) + tf.reduce_sum(variance_ref * weights)
    np.testing.assert_allclose(mean, mean_ref, rtol=1e-6)
    np.testing.assert_allclose(variance, variance_ref, rtol=1e-5)
    np.testing.assert_allclose(tape.gradient(loss, x), tape.gradient(loss_ref, x), atol=1e-6)


def test_a_rank_without_real_rows_adds_nothing_and_gets_no_nan():
    x = tf.Variable(tf.fill([4, 3], 7.0))
    with tf.GradientTape() as tape:
        with batch_rows(tf.zeros([4], tf.bool)):
            mean, variance = global_moments(LocalCollectives(), x, [0], keepdims=True)
        loss = tf.reduce_sum(mean + variance)
    np.testing.assert_array_equal(mean, np.zeros((1, 3)))
    np.testing.assert_array_equal(variance, np.zeros((1, 3)))
    np.testing.assert_array_equal(tape.gradient(loss, x), np.zeros((4, 3)))


def test_the_note_names_unsynchronized_layers_on_two_ranks_only():
    note = batch_norm_note(_model(False), 2, 32, every_layer=False)
    assert note == ("note: 1 BatchNormalization layer(s) normalise by each rank's own batch "
                    "(16 rows), not by the global batch (32 rows) as one process would; "
                    "--sync-batch-norm (sync_batch_norm=True), or synchronized=True in the "
                    "layer, uses the global batch's statistics")
    assert batch_norm_note(_model(False), 1, 32, every_layer=False) is None
    assert batch_norm_note(_model(False), 2, 32, every_layer=True) is None
    assert batch_norm_note(_model(True), 2, 32, every_layer=False) is None
    assert batch_norm_note(_model(False), 2, 32, every_layer=False, xla=True) is not None


def test_xla_with_synchronized_layers_on_two_ranks_is_refused():
    with pytest.raises(AgreedError, match="jit_compile=False"):
        batch_norm_note(_model(True), 2, 32, every_layer=False, xla=True)
    with pytest.raises(AgreedError, match="jit_compile=False"):
        batch_norm_note(_model(False), 2, 32, every_layer=True, xla=True)
    assert batch_norm_note(_model(True), 1, 32, every_layer=False, xla=True) is None
