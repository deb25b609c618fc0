"""ZeRO stage 3's refusals and its run's end, in one process (a world of one: the pieces are
the whole variables, and every code path but the exchange is the ranks'). The exactness on
real ranks is ``tests/distributed/training/test_zero.py``'s."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvdtrain
from hvdtrain.errors import UserError

ROWS = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")


class Penalized(keras.Model):
    """A model's own ``train_step`` that reads a kernel outside its layer's call."""

    def __init__(self) -> None:
        super().__init__()
        self.body = keras.layers.Dense(4, name="body")
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.body(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = (tf.reduce_mean(tf.square(self(x, training=True) - y))
                    + 0.01 * tf.reduce_sum(tf.square(self.body.kernel)))
        self.optimizer.apply(tape.gradient(loss, self.trainable_weights), self.trainable_weights)
        return {"loss": loss}


class Tied(keras.layers.Layer):
    """A layer computing with another layer's kernel (a tied output embedding's shape)."""

    def __init__(self, other: keras.layers.Dense) -> None:
        super().__init__()
        self.other = other

    def build(self, shape):
        self.tied = self.other.kernel

    def call(self, x):
        return x @ keras.ops.transpose(self.tied)


def _fit(model: keras.Model, tmp_path, **options) -> None:
    hvdtrain.fit(model, ROWS, ROWS[:, :1], batch_size=8, epochs=1, zero_stage=3,
                 run_dir=str(tmp_path / "run"), progress=False, tensorboard=False, **options)


def test_a_weight_read_outside_its_layers_call_is_refused(tmp_path):
    """Refused while the step is traced (on every rank alike), after which the model is whole
    again, as it came."""
    model = Penalized()
    model.compile(optimizer="adam")
    model(ROWS[:1])
    before = model.get_weights()
    with pytest.raises(UserError, match=r"^--zero-stage 3 holds '.*body/kernel' in pieces "
                                        r"outside its layer's call.*or use --zero-stage 2$"):
        _fit(model, tmp_path)
    for ours, theirs in zip(model.get_weights(), before):
        np.testing.assert_array_equal(ours, theirs)


def test_a_weight_two_layers_own_is_refused(tmp_path):
    keras.utils.set_random_seed(1)
    dense = keras.layers.Dense(8, name="embed")
    inputs = keras.Input((8,))
    model = keras.Model(inputs, Tied(dense)(dense(inputs)))
    model.compile(optimizer="adam", loss="mse")
    with pytest.raises(UserError, match=r"--zero-stage 3 cannot shard 'embed/kernel': layers "
                                        r"'embed' and 'tied.*' both use it"):
        hvdtrain.fit(model, ROWS, ROWS, batch_size=8, epochs=1, zero_stage=3,
                     run_dir=str(tmp_path / "run"), progress=False, tensorboard=False)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_a_recurrent_layer_gathers_and_recomputes_outside_its_loop(tmp_path, remat):
    """An LSTM (and a GRU inside Bidirectional) gathers its cells' weights once per call and
    recomputes the whole layer, not each step's cell inside TensorFlow's while loop, which a
    recomputation cannot reach into: stage 3 trains what stage 0 trains."""
    sequences = ROWS.reshape(8, 4, 8)

    def trained(stage: int) -> list[np.ndarray]:
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.Input((4, 8)), keras.layers.LSTM(6, return_sequences=True),
            keras.layers.Bidirectional(keras.layers.GRU(3)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        hvdtrain.fit(model, sequences, sequences[:, 0, :1], batch_size=4, epochs=1,
                     zero_stage=stage, remat=remat, shuffle=False, deterministic=True,
                     run_dir=str(tmp_path / f"s{stage}"), progress=False, tensorboard=False)
        return model.get_weights()

    for ours, theirs in zip(trained(3), trained(0)):
        np.testing.assert_array_equal(ours, theirs)


def test_xla_is_refused(tmp_path):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    with pytest.raises(UserError, match="jit_compile"):
        _fit(model, tmp_path)


def test_the_model_and_its_optimizer_leave_fit_whole_as_stage_0_leaves_them(tmp_path):
    def trained(stage: int) -> keras.Model:
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        hvdtrain.fit(model, ROWS, ROWS[:, :1], batch_size=8, epochs=2, zero_stage=stage,
                     shuffle=False, deterministic=True, run_dir=str(tmp_path / f"s{stage}"),
                     progress=False, tensorboard=False)
        return model

    ours, theirs = trained(3), trained(0)
    for a, b in zip(ours.get_weights() + [np.asarray(v) for v in ours.optimizer.variables],
                    theirs.get_weights() + [np.asarray(v) for v in theirs.optimizer.variables]):
        np.testing.assert_array_equal(a, b)
    assert all(type(v) is type(w) for v, w in zip(ours.weights, theirs.weights))
