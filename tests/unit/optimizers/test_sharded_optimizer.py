"""ZeRO in one process: which optimizers and settings are refused (one line each), the cut of a
variable into pieces, and what Keras may not do with a sharded optimizer during the run."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.collectives import GradientReduction, LocalCollectives
from hvdtrain.config import ConfigError, build_config
from hvdtrain.errors import UserError
from hvdtrain.training.checks import check_callbacks
from hvdtrain.optimizers.sharding import Piece, Sharding
from hvdtrain.optimizers.zero import check_shardable


@pytest.mark.parametrize("optimizer, says", [
    (lambda: keras.optimizers.Lamb(), "its update of an element depends on other elements"),
    (lambda: keras.optimizers.Adafactor(), "its update of an element depends on other"),
    (lambda: keras.optimizers.Adam(use_ema=True), "with use_ema"),
])
def test_an_optimizer_sharding_would_change_is_refused_in_one_line(optimizer, says):
    with pytest.raises(UserError, match=says) as refused:
        check_shardable(optimizer())
    assert "\n" not in str(refused.value) and "--zero-stage 0" in str(refused.value)


class GlobalNormSGD(keras.optimizers.SGD):
    """A user's optimizer that scales each call's gradients by their joint norm: elementwise
    within one call's gradients only when every piece is in the call."""

    def apply(self, grads, trainable_variables=None):
        norm = tf.linalg.global_norm(grads)
        return super().apply([g / norm for g in grads], trainable_variables)


def test_an_optimizer_whose_call_spans_all_gradients_is_refused():
    """Each rank applies its pieces alone, so the probe gives each piece its own copy."""
    with pytest.raises(UserError, match="depends on other elements"):
        check_shardable(GlobalNormSGD(0.1))


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.Adam(clipvalue=0.5),
    lambda: keras.optimizers.Nadam(),
    lambda: keras.optimizers.Ftrl(),
    lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.AdamW(weight_decay=0.1)),
])
def test_elementwise_optimizers_are_accepted(optimizer):
    check_shardable(optimizer())


@pytest.mark.parametrize("setting, says", [
    ({"reduction": "adasum"}, "cannot shard Adasum"),
    ({"elastic": True, "run_dir": "runs/elastic"}, "with --elastic is not supported"),
])
def test_settings_sharding_cannot_honour_are_refused_by_the_config(setting, says):
    with pytest.raises(ConfigError, match=says):
        build_config({"zero_stage": 2, **setting})


def test_a_piece_is_a_slice_of_the_flattened_variable_padded_to_the_world():
    piece = Piece.of(np.zeros((5, 2)), 3)
    assert (piece.size, piece.length, piece.ranks) == (10, 4, 3)
    value = tf.reshape(tf.range(10.0), (5, 2))
    assert piece.padded(value).numpy().tolist() == [*range(10), 0, 0]
    pieces = [piece.own(value, rank).numpy().tolist() for rank in range(3)]
    assert pieces == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]
    assert piece.whole(tf.constant(sum(pieces, [])), (5, 2)).numpy().ravel().tolist() == \
        list(range(10))


def test_a_sparse_gradient_is_refused_rather_than_summed_densely():
    embedding = keras.Variable(np.zeros((4, 2), np.float32), name="embeddings")
    sharding = Sharding(LocalCollectives(), 2, GradientReduction())
    sharding.register([embedding])
    sparse = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([1]), tf.constant([4, 2]))
    with pytest.raises(UserError, match="cannot shard the sparse gradient"):
        sharding.scatter([sparse], [embedding])


def test_a_float8_scale_is_refused_in_one_line():
    scale = keras.Variable(np.ones((1,), np.float32), name="scale")
    scale.overwrite_with_gradient = True
    with pytest.raises(UserError, match="takes its gradient as its value"):
        Sharding(LocalCollectives(), 1, GradientReduction()).register([scale])


@pytest.mark.parametrize("callback", [
    lambda path: keras.callbacks.ModelCheckpoint(str(path / "m.weights.h5"),
                                                 save_weights_only=True),
    lambda path: keras.callbacks.BackupAndRestore(str(path / "backup")),
])
def test_callbacks_that_save_rank_0s_optimizer_are_refused_when_sharded(tmp_path, callback):
    config = build_config({"zero_stage": 1})
    with pytest.raises(UserError, match="saves rank 0's optimizer state"):
        check_callbacks(config, [callback(tmp_path)])
    check_callbacks(build_config({}), [callback(tmp_path)])


def test_keras_saving_a_sharded_optimizer_during_the_run_is_refused_in_one_line(tmp_path):
    """A user's own ``model.save`` mid-run would store this rank's pieces as the state."""
    from hvdtrain.optimizers.zero import sharded_for_the_run

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(), "mse")
    sharding = Sharding(LocalCollectives(), 2, GradientReduction())
    with sharded_for_the_run([model.optimizer], sharding, model.trainable_variables):
        with pytest.raises(UserError, match="Keras cannot save it during the run") as refused:
            model.save(tmp_path / "mid-run.keras")
    assert "\n" not in str(refused.value)
    model.save(tmp_path / "after.keras")     # whole again once the run is over


class WarmUpCosine(keras.optimizers.schedules.LearningRateSchedule):
    """A schedule written as Keras' examples write them: no ``get_config``."""

    def __call__(self, step):
        return 0.01 * tf.cos(tf.cast(step, tf.float32) / 100.0)


def test_an_optimizer_on_a_schedule_without_a_config_is_probed_and_accepted():
    """The probe copies the optimizer; its schedule, which cannot be serialised, stays the
    user's and is not needed to tell that Adam updates element by element."""
    optimizer = keras.optimizers.Adam(WarmUpCosine())
    check_shardable(optimizer)
    assert isinstance(optimizer._learning_rate, WarmUpCosine)
