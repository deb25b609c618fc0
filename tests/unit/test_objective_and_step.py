"""Single-process unit tests of the step math and the objective (LocalCollectives, no MPI):
hvdtrain's loss and metrics equal Keras' own for the same compiled model, accumulation equals a
larger batch, a non-finite loss skips the update, padding counts nowhere, and the mistakes a
user's model can make are named before training."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.collectives import LocalCollectives
from hvdtrain.training.objective import BatchShares, Objective, ObjectiveError, check_output_kind
from hvdtrain.training.step import StepMath, StepOptions
from workloads import two_tower_data, two_tower_model


def _two_tower(seed: int = 0):
    keras.utils.set_random_seed(seed)
    data = two_tower_data()
    shapes = {name: values.shape[1:] for name, values in data.x.items()}
    return two_tower_model(shapes, 10), data


def test_loss_and_metrics_equal_keras_evaluate_for_a_compiled_two_output_model():
    """Dict inputs and outputs, dict losses with loss_weights, sample weights: hvdtrain's
    per-example loss, weighted and summed over the batch, and its metrics are what Keras'
    own ``evaluate`` reports for the same model and batch."""
    model, data = _two_tower()
    rows = slice(0, 64)
    x = {name: values[rows] for name, values in data.x.items()}
    y = {name: values[rows] for name, values in data.y.items()}
    weights = data.sample_weight[rows]
    expected = model.evaluate(x, y, sample_weight=weights, batch_size=64, verbose=0,
                              return_dict=True)

    objective = Objective.for_model(model)
    predictions = model(x, training=False)
    total, parts = objective.per_example_losses(y, predictions)
    loss = float(tf.reduce_sum(total * weights) / 64)
    assert loss == pytest.approx(expected["loss"], rel=1e-5)
    metrics = objective.new_metrics()
    metrics.build(y, predictions)
    metrics.update(y, predictions, total, parts, tf.constant(weights), tf.ones(64, tf.bool))
    ours = metrics.global_results(LocalCollectives())
    for name in ("digit_loss", "ink_loss", "digit_accuracy", "ink_mae"):
        assert ours[name] == pytest.approx(expected[name], rel=1e-5), name


def test_per_output_losses_are_keras_means_of_batch_means():
    """Keras 3 reports ``digit_loss``/``ink_loss`` as the plain mean of its batches' means (a
    short last batch counts as much as a full one), the total loss and compiled metrics as
    means over examples: 64 rows in batches of 48 and 16, each a global batch of two ranks'
    halves, give Keras' columns."""
    model, data = _two_tower()
    x = {name: values[:64] for name, values in data.x.items()}
    y = {name: values[:64] for name, values in data.y.items()}
    weights = data.sample_weight[:64]
    expected = model.evaluate(x, y, sample_weight=weights, batch_size=48, verbose=0,
                              return_dict=True)
    objective = Objective.for_model(model)
    metrics = objective.new_metrics()
    for batch in (slice(0, 48), slice(48, 64)):
        rows = batch.stop - batch.start
        for half in (slice(batch.start, batch.start + rows // 2),
                     slice(batch.start + rows // 2, batch.stop)):
            xs = {name: values[half] for name, values in x.items()}
            ys = {name: values[half] for name, values in y.items()}
            predictions = model(xs, training=False)
            metrics.build(ys, predictions)
            total, parts = objective.per_example_losses(ys, predictions)
            count = half.stop - half.start
            metrics.update(ys, predictions, total, parts, tf.constant(weights[half]),
                           tf.ones(count, tf.bool),
                           batch_shares=BatchShares(tf.fill([count], 1.0 / rows), 0.5))
    ours = metrics.global_results(LocalCollectives())
    assert set(ours) == set(expected)
    for name in expected:
        assert ours[name] == pytest.approx(expected[name], rel=1e-5), name


def test_padding_rows_count_in_no_metric():
    model, data = _two_tower()
    x = {name: values[:8] for name, values in data.x.items()}
    y = {name: values[:8] for name, values in data.y.items()}
    objective = Objective.for_model(model)
    predictions = model(x)
    total, parts = objective.per_example_losses(y, predictions)
    full, half = objective.new_metrics(), objective.new_metrics()
    for metrics in (full, half):
        metrics.build(y, predictions)
    real = tf.constant([True] * 4 + [False] * 4)
    half.update(y, predictions, total, parts, tf.ones(8), real)
    first = lambda values: {k: v[:4] for k, v in values.items()}   # noqa: E731
    total4, parts4 = objective.per_example_losses(first(y), first(predictions))
    full.update(first(y), first(predictions), total4, parts4, tf.ones(4), tf.ones(4, tf.bool))
    expected = full.global_results(LocalCollectives())
    assert half.global_results(LocalCollectives()) == pytest.approx(expected, rel=1e-6)


def _regression_step(accumulation: int) -> tuple[StepMath, keras.Model]:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(loss="mse")
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    step = StepMath(model, optimizer, LocalCollectives(), Objective.for_model(model),
                    StepOptions(accumulation_steps=accumulation))
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


def test_weights_make_the_step_loss_the_mean_over_real_examples():
    step, _ = _regression_step(1)
    x = np.ones((4, 3), np.float32)
    y = np.array([[1.0], [2.0], [3.0], [100.0]], np.float32)
    weights = tf.constant([1 / 3, 1 / 3, 1 / 3, 0.0])          # the last row is padding
    predicted = step.model(x).numpy()
    step.train_step(x, y, tf.ones(4), weights)
    expected = float(np.mean((predicted[:3] - y[:3]) ** 2))
    assert float(step.global_loss.numpy()) == pytest.approx(expected, rel=1e-5)


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
    model.compile(loss="mse", metrics=[LastValue()])
    objective = Objective.for_model(model)
    x, y = np.zeros((2, 3), np.float32), np.zeros((2, 1), np.float32)
    with pytest.raises(ObjectiveError, match="metric 'last_value' keeps state 'value' with "
                                             "aggregation 'mean'"):
        objective.new_metrics().build(y, model(x))


@pytest.mark.parametrize("activation, loss, message", [
    (None, "sparse_categorical_crossentropy", "is not a probability distribution"),
    ("softmax", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
     "is already a probability distribution"),
    (None, "binary_crossentropy", "has values outside \\[0, 1\\]"),
    ("sigmoid", keras.losses.BinaryCrossentropy(from_logits=True), "lies entirely in \\[0, 1\\]"),
])
def test_outputs_that_do_not_fit_their_loss_are_named(activation, loss, message):
    keras.utils.set_random_seed(2)
    units = 1 if "binary" in str(getattr(loss, "name", loss)) else 4
    layer = keras.layers.Dense(units, activation=activation, bias_initializer="ones")
    model = keras.Sequential([keras.Input((3,)), layer])
    model.compile(loss=loss)
    x = np.random.default_rng(0).standard_normal((32, 3)).astype(np.float32) * 3
    with pytest.raises(ObjectiveError, match=message):
        check_output_kind(Objective.for_model(model), model(x))


def test_an_uncompiled_model_gets_the_default_objective():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="softmax")])
    objective = Objective.for_model(model)
    assert not objective.compiled.compiled
    metrics = objective.new_metrics()
    y, predictions = np.array([0, 1]), model(np.zeros((2, 3), np.float32))
    metrics.build(y, predictions)
    assert set(metrics.local_results()) == {"loss", "accuracy"}


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
        model.optimizer.build(model.trainable_variables)
        step = StepMath(model, model.optimizer, LocalCollectives(), Objective.for_model(model),
                        StepOptions(xla=xla))
        train = tf.function(step.keras_step, jit_compile=False)
        for _ in range(3):
            train(batch)
        weights[xla] = model.get_weights()
        validate, _ = step.validation()
        validated[xla] = validate(tf.data.Dataset.from_tensors(batch))
        if xla:
            compiled = step._forward_backward.get_concrete_function(*batch).function_def
            assert compiled.attr["_XlaMustCompile"].b
            assert not any("Horovod" in node.op or "Collective" in node.op
                           for node in compiled.node_def)
            evaluation = validate.__self__
            assert evaluation._forward.get_concrete_function(*batch[:2]).function_def.attr[
                "_XlaMustCompile"].b
    for plain, compiled in zip(weights[False], weights[True]):
        np.testing.assert_allclose(compiled, plain, rtol=1e-5, atol=1e-6)
    assert validated[True] == pytest.approx(validated[False], rel=1e-5)
