"""Single-process unit tests of the step math and the objective (LocalCollectives, no MPI):
Keras computes the loss and the metrics, so one step of hvdtrain's equals one step of Keras'
own ``train_step`` for the same compiled model; what each loss divides by is measured right;
accumulation equals a larger batch, a non-finite loss skips the update, padding and filler rows
count nowhere, the model is not called on real rows before training, and a metric that cannot
be summed is named."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from hvdtrain.collectives import LocalCollectives
from hvdtrain.data.pipeline import real_rows_only
from hvdtrain.training.step.objective import (LossShare, ObjectiveError, build_for_training,
                                              measured_share)
from hvdtrain.training.step.core import StepMath, StepOptions, divided
from workloads import two_tower_data, two_tower_model


def _two_tower(seed: int = 0):
    keras.utils.set_random_seed(seed)
    data = two_tower_data()
    shapes = {name: values.shape[1:] for name, values in data.x.items()}
    model = two_tower_model(shapes, 10)
    model.optimizer = keras.optimizers.SGD(0.1)   # compiled without one: Keras' default
    return model, data


def _rows(values, count):
    return {name: value[:count] for name, value in values.items()}


def test_one_step_equals_keras_own_train_step_for_a_compiled_two_output_model():
    """Dict inputs and outputs, dict losses with loss_weights, sample weights, a short batch
    padded to the batch size: hvdtrain's step on the real rows updates the weights and reports
    the metrics that Keras' own ``train_on_batch`` does for the same model and rows."""
    keras_model, data = _two_tower()
    ours, _ = _two_tower()
    ours.set_weights(keras_model.get_weights())
    x, y, sample_weight = _rows(data.x, 48), _rows(data.y, 48), data.sample_weight[:48]
    expected = keras_model.train_on_batch(_rows(x, 40), _rows(y, 40), sample_weight[:40],
                                          return_dict=True)
    weights = np.where(np.arange(48) < 40, 1 / 40, 0.0).astype(np.float32)   # 8 padding rows
    batch = next(iter(real_rows_only(tf.data.Dataset.from_tensors(
        (x, y, sample_weight, weights)))))
    build_for_training(ours, batch, "two towers")
    step = StepMath(ours, ours.optimizer, LocalCollectives(), options=StepOptions(global_batch=48))
    logs = tf.function(step.keras_step)(batch)
    for a, b in zip(keras_model.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert sorted(logs) == sorted(expected)
    for name, value in expected.items():
        assert float(logs[name]) == pytest.approx(value, rel=1e-5), name


def contrastive(y_true, y_pred):
    """Each prediction against the batch's mean: a loss that couples a batch's rows."""
    return ops.mean(ops.square(y_pred - ops.mean(y_pred, axis=0)) - y_true * y_pred)


def batch_mean(y_true, y_pred):
    return ops.mean(ops.square(y_true - y_pred))       # one value for the whole batch


class OwnCall(keras.losses.Loss):
    def __call__(self, y_true, y_pred, sample_weight=None):
        return ops.mean(ops.square(y_true - y_pred))


@pytest.mark.parametrize("loss, expected", [
    ("mse", ("rows", False)),
    (keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"), ("sample_weight", False)),
    (keras.losses.MeanSquaredError(reduction="sum"), ("sum", False)),
    (batch_mean, ("rows", False)),
    (OwnCall(), ("rows", False)),
    (contrastive, ("rows", True)),
])
def test_what_the_loss_divides_by_is_measured_with_keras_own_code(loss, expected):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)),
                              keras.layers.Dense(1, kernel_regularizer="l2")])
    model.compile(loss=loss, optimizer="sgd")
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((8, 3)).astype(np.float32),
             rng.standard_normal((8, 1)).astype(np.float32), tf.ones(8), tf.fill([8], 0.125))
    share = measured_share(model, batch)
    assert (share.divisor, share.coupled) == expected
    if share.coupled:
        assert share.named == "the compiled loss contrastive"
        assert share.on_ranks(2, "").divisor == "gathered"
        assert "contrastive couples" in share.on_ranks(2, "because").describe()


class Counting(keras.Model):
    """A subclassed model that counts the calls a program could see."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2, activation="softmax")
        self.eager_calls = 0

    def call(self, x):
        if tf.executing_eagerly():
            self.eager_calls += 1
        return self.dense(x)


def test_a_masked_loss_divides_by_the_unmasked_entries():
    """Keras' mean of a masked output's loss is over its unmasked tokens, so a rank's share is
    its count of them, not its rows."""
    model = keras.Sequential([keras.Input((5,), dtype="int32"),
                              keras.layers.Embedding(9, 4, mask_zero=True),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd")
    x = np.array([[1, 2, 0, 0, 0], [3, 4, 5, 0, 0]], np.int32)
    batch = (x, np.zeros((2, 5), np.int64), tf.ones(2), tf.fill([2], 0.5))
    share = build_for_training(model, batch, "tagger", sample_weights=False)
    assert share.masked and share.divisor == "rows"
    assert float(share.of(2, None, model(x))) == 5.0


def test_nothing_is_called_on_real_rows_or_counted_before_training():
    model = Counting()
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  optimizer="sgd")
    batch = (np.ones((4, 3), np.float32), np.array([0, 1, 0, 1]), tf.ones(4), tf.fill([4], 0.25))
    build_for_training(model, batch, "counting")
    assert model.eager_calls == 0
    assert all(float(value) == 0.0 for value in model.get_metrics_result().values())


def _regression_step(accumulation: int) -> tuple[StepMath, keras.Model]:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(loss="mse")
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    step = StepMath(model, optimizer, LocalCollectives(), LossShare(),
                    StepOptions(accumulation_steps=accumulation, global_batch=16))
    return step, model


def test_two_accumulated_micro_steps_equal_one_step_of_twice_the_batch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    y = rng.standard_normal((16, 1)).astype(np.float32)
    ones, weights = tf.ones(16), tf.fill([16], 1.0 / 16)
    big, big_model = _regression_step(1)
    big.train_step(x, y, ones, weights)
    small, small_model = _regression_step(2)
    small.train_step(x[:8], y[:8], ones[:8], weights[:8])
    assert int(small.optimizer.iterations) == 0          # nothing applied after one micro-step
    small.train_step(x[8:], y[8:], ones[8:], weights[8:])
    for a, b in zip(big_model.get_weights(), small_model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_non_finite_loss_skips_the_update_and_is_reported():
    step, model = _regression_step(1)
    before = [w.copy() for w in model.get_weights()]
    x = np.full((4, 3), np.nan, np.float32)
    step.train_step(x, np.zeros((4, 1), np.float32), tf.ones(4), tf.fill([4], 0.25))
    assert not np.isfinite(float(step.global_loss.numpy()))
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_padding_rows_count_nowhere_and_a_filler_batch_weighs_nothing():
    step, model = _regression_step(1)
    x = np.ones((4, 3), np.float32)
    y = np.array([[1.0], [2.0], [3.0], [100.0]], np.float32)
    predicted = step.model(x).numpy()
    padded = tf.data.Dataset.from_tensors((x, y, tf.ones(4), tf.constant([1 / 3] * 3 + [0.0])))
    step.train_step(*next(iter(real_rows_only(padded))))
    expected = float(np.mean((predicted[:3] - y[:3]) ** 2))
    assert float(step.global_loss.numpy()) == pytest.approx(expected, rel=1e-5)
    before = [w.copy() for w in model.get_weights()]
    step.train_step(x, y, tf.ones(4), tf.zeros(4))               # a filler batch
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert float(model.get_metrics_result()["loss"]) == pytest.approx(expected, rel=1e-5)


class LastValue(keras.metrics.Metric):
    """A metric whose state is not a sum: it cannot be reduced exactly across ranks."""

    def __init__(self, name="last_value"):
        super().__init__(name=name)
        self.value = self.add_variable((), initializer="zeros", name="value",
                                       aggregation="mean")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.value.assign(tf.reduce_mean(tf.cast(y_pred, tf.float32)))

    def result(self):
        return self.value


def test_a_metric_without_additive_state_is_refused_by_name():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(loss="mse", metrics=[LastValue()], optimizer="sgd")
    batch = (np.zeros((2, 3), np.float32), np.zeros((2, 1), np.float32), tf.ones(2),
             tf.fill([2], 0.5))
    with pytest.raises(ObjectiveError, match="metric 'last_value' keeps state 'value' with "
                                             "aggregation 'mean'"):
        build_for_training(model, batch, "last value")


def test_the_models_jit_compile_compiles_the_forward_and_backward_pass_alone():
    """``jit_compile=True``: the loss and gradients are one XLA cluster (TensorFlow must compile
    it), the collectives and the update stay outside, and three steps end where the same steps
    without XLA end (to float32 rounding); validation's forward pass is compiled too and
    measures the same."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    batch = (x, rng.integers(0, 3, 32), tf.ones(32), tf.fill([32], 1 / 32))
    weights, validated = {}, {}
    for xla in (False, True):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), jit_compile=True,
                      loss="sparse_categorical_crossentropy")
        build_for_training(model, batch, "xla")
        step = StepMath(model, model.optimizer, LocalCollectives(),
                        options=StepOptions(xla=xla, global_batch=32))
        train = tf.function(step.keras_step, jit_compile=False)
        for _ in range(3):
            train(batch)
        weights[xla] = model.get_weights()
        validate = step.validation()
        validated[xla] = validate(tf.data.Dataset.from_tensors(batch))
        if xla:
            compiled = step._forward_backward.get_concrete_function(*batch).function_def
            assert compiled.attr["_XlaMustCompile"].b
            assert not any("Horovod" in node.op or "Collective" in node.op
                           for node in compiled.node_def)
            evaluation = validate.__self__
            assert evaluation._forward.get_concrete_function(*batch).function_def.attr[
                "_XlaMustCompile"].b
    for plain, compiled in zip(weights[False], weights[True]):
        np.testing.assert_allclose(compiled, plain, rtol=1e-5, atol=1e-6)
    assert validated[True] == pytest.approx(validated[False], rel=1e-5)


def test_xla_keeps_the_masks_and_logits_keras_metrics_read():
    """A masked output computed by the compiled forward pass: its accuracy counts the
    unmasked tokens alone, as without XLA (the compiled function's outputs lose the mask)."""
    x = np.array([[1, 2, 0, 0], [3, 4, 5, 0]], np.int32)
    batch = (x, np.ones((2, 4), np.int64), tf.ones(2), tf.fill([2], 0.5))
    accuracy = {}
    for xla in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,), dtype="int32"),
                                  keras.layers.Embedding(9, 4, mask_zero=True),
                                  keras.layers.Dense(3, activation="softmax")])
        model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd",
                      metrics=["accuracy"])
        share = build_for_training(model, batch, "tagger", sample_weights=False)
        step = StepMath(model, model.optimizer, LocalCollectives(), share,
                        StepOptions(xla=xla, global_batch=2, sample_weights=False))
        accuracy[xla] = float(tf.function(step.keras_step)(batch)["accuracy"])
    assert accuracy[True] == accuracy[False]


def test_gradients_over_summed_shares_of_one_are_left_as_they_are_and_divided_otherwise():
    """Full batches' shares sum to 1: the step then skips the pass that divides by it, which
    changes no bit; any other sum divides, dense and sparse alike, and None stays None."""
    dense = tf.constant([[3.0, -1.5], [0.25, 7.0]])
    sparse = tf.IndexedSlices(tf.constant([[2.0, 4.0]]), tf.constant([1]), tf.constant([3, 2]))

    @tf.function
    def over(total):
        return divided([dense, None, sparse], total)

    kept, nothing, kept_rows = over(tf.constant(1.0))
    assert nothing is None and isinstance(kept_rows, tf.IndexedSlices)
    np.testing.assert_array_equal(kept, dense)
    np.testing.assert_array_equal(kept_rows.values, sparse.values)
    halved, _, halved_rows = over(tf.constant(2.0))
    np.testing.assert_array_equal(halved, dense / 2)
    np.testing.assert_array_equal(halved_rows.values, sparse.values / 2)
    np.testing.assert_array_equal(halved_rows.indices, sparse.indices)
    np.testing.assert_array_equal(over(tf.constant(0.0))[0], np.zeros((2, 2)))   # no NaN
