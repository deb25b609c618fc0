"""Checks of the Horovod drop-in (``hvdtrain.keras``, ``hvdtrain.tensorflow``) that every rank
of one ``horovodrun -np 2 python -m pytest tests/ranks/dropin_rank_checks.py`` runs, in the same
order, the way Horovod's own ``test/parallel`` tests run. Most re-express the applicable tests
of Horovod's ``test/parallel/test_tensorflow2_keras.py`` for Keras 3; the rest check the
behaviour a Horovod user relies on, including what ``test_tensorflow.py`` has beyond the
collective cases (``collective_rank_checks.py``): elastic states, ``broadcast_``, TensorFlow 1
graphs, and every collective on zero-sized, scalar and disagreeing shapes in each mode.
``test_horovod_dropin.py`` launches this file, on each backend (``HVDTRAIN_BACKEND`` on the
ranks); the normal test run does not collect it (no ``test_`` prefix). On TensorFlow's
collectives, what that backend refuses (elastic state and run, Adasum, process sets, the
timeline, join) is checked refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import keras
import pytest
import tensorflow as tf

import hvdtrain.keras as hvd
import hvdtrain.tensorflow as hvd_tf
from hvdtrain.dropin.core import reducing_class
from hvdtrain.errors import UserError
from workloads import WarmUpCosine

hvd.init()
ON_HOROVOD = hvd_tf.collectives().backend == "horovod"


def assert_refused(call, *args, **kwargs) -> None:
    """On TensorFlow's collectives: one line that names the Horovod backend as the fix."""
    with pytest.raises(UserError, match=r"^[^\n]* needs the Horovod backend, [^\n]*$"):
        call(*args, **kwargs)


def same_on_every_rank(value) -> bool:
    gathered = hvd.allgather(np.asarray(value, np.float64)[None]).numpy()
    return all(np.array_equal(gathered[0], other) for other in gathered[1:])


def rank_data(*shape: int) -> np.ndarray:
    """Different data on every rank, the same on every run."""
    return np.random.default_rng(100 + hvd.rank()).random(shape).astype("float32")


def dense_model(inputs: int, units: int) -> keras.Model:
    keras.utils.set_random_seed(1)          # the same initial weights on every rank
    return keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(units)])


class AddGradient(keras.optimizers.Optimizer):
    """Adds the gradient to the variable, so the applied gradients can be read off it."""

    def __init__(self, learning_rate=0.1, **kwargs) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)

    def update_step(self, gradient, variable, learning_rate) -> None:
        self.assign_add(variable, gradient)


class SetToGradient(keras.optimizers.Optimizer):
    """Overwrites the variable with the applied gradient."""

    def __init__(self, learning_rate=0.1, **kwargs) -> None:
        super().__init__(learning_rate=learning_rate, **kwargs)

    def update_step(self, gradient, variable, learning_rate) -> None:
        self.assign(variable, gradient)


def test_learning_rate_callbacks_follow_horovods_schedule_and_metrics_are_averaged():
    initial_lr = 0.1 * hvd.size()
    model = dense_model(3, 2)
    model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam()))
    seen_lr, raw_loss = [], []

    class RecordRate(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen_lr.append(float(self.model.optimizer.learning_rate))

    class RecordRawLoss(keras.callbacks.Callback):     # before MetricAverageCallback
        def on_epoch_end(self, epoch, logs=None):
            raw_loss.append(logs["loss"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        RecordRawLoss(),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=initial_lr, warmup_epochs=5),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=1e-1,
                                                   start_epoch=5, end_epoch=10),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=1e-2,
                                                   start_epoch=10, end_epoch=15),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr,
                                                   multiplier=lambda epoch: epoch,
                                                   start_epoch=15, end_epoch=20),
        RecordRate(),
    ]
    history = model.fit(rank_data(10, 3), rank_data(10, 2), batch_size=2, epochs=20,
                        callbacks=callbacks, verbose=0)

    size = hvd.size()
    expected = ([initial_lr / size * ((e + 1) * (size - 1) / 5 + 1) for e in range(5)]
                + [initial_lr * 0.1 ** (e - 5) for e in range(5, 10)]
                + [initial_lr * 0.01 ** (e - 10) for e in range(10, 15)]
                + [initial_lr * e for e in range(15, 20)])
    np.testing.assert_allclose(seen_lr, expected, rtol=1e-5)
    assert seen_lr[4] == pytest.approx(initial_lr)        # warmup ends at initial_lr
    np.testing.assert_allclose(history.history["lr"], expected, rtol=1e-5)
    assert not same_on_every_rank(raw_loss)               # each rank's own data
    assert same_on_every_rank(history.history["loss"])
    mean_raw = hvd.allreduce(np.array(raw_loss), op=hvd.Average).numpy()
    np.testing.assert_allclose(history.history["loss"], mean_raw, rtol=1e-6)


def test_sparse_gradients_make_the_update_one_process_makes_with_both_ranks_batches():
    """An Embedding's gradient is gathered row by row (repeated rows kept: Keras' RMSprop
    applies IndexedSlices row by row), so the update equals plain Keras in one process on the
    batch of both ranks; densified, it equals that process's update of the dense gradient."""
    start = np.random.default_rng(0).random((50, 4)).astype("float32")
    ids = np.random.default_rng(hvd.rank()).integers(0, 50, (8, 5))
    targets = rank_data(8, 5, 4)
    every_id = hvd.allgather(ids).numpy()
    every_target = hvd.allgather(targets).numpy()

    def embedding() -> keras.Model:
        model = keras.Sequential([keras.Input((5,), dtype="int32"),
                                  keras.layers.Embedding(50, 4)])
        model.set_weights([start])
        return model

    for sparse_as_dense in (False, True):
        model = embedding()
        model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(
            keras.optimizers.RMSprop(0.01), sparse_as_dense=sparse_as_dense))
        model.train_on_batch(ids, targets)
        alone = embedding()
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((alone(every_id) - every_target) ** 2)
        gradient = tape.gradient(loss, alone.trainable_variables)
        assert isinstance(gradient[0], tf.IndexedSlices)
        if sparse_as_dense:
            gradient = [tf.convert_to_tensor(g) for g in gradient]
        keras.optimizers.RMSprop(0.01).apply(gradient, alone.trainable_variables)
        np.testing.assert_allclose(model.get_weights()[0], alone.get_weights()[0], rtol=1e-5,
                                   atol=1e-7)
        assert same_on_every_rank(model.get_weights()[0])


@pytest.mark.parametrize("average", [True, False])
def test_gradients_aggregate_locally_over_backward_passes(average):
    passes = 4
    optimizer = hvd.DistributedOptimizer(AddGradient(), backward_passes_per_step=passes,
                                         average_aggregated_gradients=average,
                                         sparse_as_dense=True)
    x, y = keras.Variable([0.0]), keras.Variable([1.0, 2.0])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = x - tf.gather(y, [0])     # d/dx = 1, d/dy = [-1, 0] (sparse)
        optimizer.apply_gradients(zip(tape.gradient(loss, [x, y]), [x, y]))

    for call in range(10):
        step()
        updates = (call + 1) // passes
        applied = updates * (1.0 if average else passes)
        np.testing.assert_allclose(x.numpy(), [applied])
        np.testing.assert_allclose(y.numpy(), [1.0 - applied, 2.0])
        assert int(optimizer.iterations) == updates       # Keras 3: counts applied updates


def test_non_finite_gradients_do_not_leak_into_the_next_aggregation():
    optimizer = hvd.DistributedOptimizer(SetToGradient(), backward_passes_per_step=2)
    w = keras.Variable(0.0)
    calls = tf.Variable(0)

    def step():                               # eager, as a custom loop may run it
        calls.assign_add(1)
        factor = float("inf") if int(calls) == 1 else 1.0
        with tf.GradientTape() as tape:
            loss = w * factor
        optimizer.apply_gradients([(tape.gradient(loss, w), w)])

    step(), step()
    assert np.isinf(w.numpy())                # inf + 1 was applied
    step(), step()
    assert w.numpy() == 2.0                   # 1 + 1: the accumulator started again from 0


def test_from_config_round_trip_keeps_class_settings_and_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(schedule), op=hvd.Sum,
                                         backward_passes_per_step=2)
    config = optimizer.get_config()        # (Keras 3's from_config rewrites its argument)
    for copy in (optimizer.from_config(optimizer.get_config()),
                 type(optimizer).from_config(optimizer.get_config())):
        assert copy.get_config() == config
        assert type(copy) is type(optimizer)
        assert isinstance(copy, keras.optimizers.Adam)
    assert type(optimizer).__name__ == "Adam"
    assert keras.optimizers.deserialize(keras.optimizers.serialize(optimizer)).get_config() \
        == config


def test_a_schedule_without_get_config_trains_as_one_process_with_both_ranks_batches():
    """Keras examples' warm-up cosine schedule, a user's class with no ``get_config``: the
    optimizer holding it cannot be rebuilt from its config, so ``DistributedOptimizer`` makes
    that optimizer itself distributed. Four steps of 4 per rank end, on both ranks, where one
    process ends with the same schedule and both ranks' 8 examples per step."""
    steps, batch = 4, 4
    x, y = rank_data(steps * batch, 4), rank_data(steps * batch, 3)

    def optimizer() -> keras.optimizers.Optimizer:
        return keras.optimizers.SGD(WarmUpCosine(0.1, total_steps=steps, warmup_steps=2),
                                    momentum=0.9)

    users = optimizer()
    model = dense_model(4, 3)
    model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(users))
    assert model.optimizer is users
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    assert int(users.iterations) == steps
    # One process: step s takes rows s*batch... of every rank, in rank order.
    rows = steps * batch
    order = [r * rows + s * batch + i for s in range(steps) for r in range(hvd.size())
             for i in range(batch)]
    alone = dense_model(4, 3)
    alone.compile(loss="mse", optimizer=optimizer())
    alone.fit(hvd.allgather(x).numpy()[order], hvd.allgather(y).numpy()[order],
              batch_size=batch * hvd.size(), shuffle=False, verbose=0)
    for left, right in zip(model.get_weights(), alone.get_weights()):
        np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-6)
    assert same_on_every_rank(model.get_weights()[0])


def test_learning_rate_schedule_advances_with_applied_updates():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(schedule),
                                         backward_passes_per_step=2)
    w = keras.Variable(0.0)
    for _ in range(4):
        optimizer.apply([tf.constant(1.0)], [w])
    assert float(w) == pytest.approx(-(0.1 * 2 + 0.05 * 2))   # two updates of 1 + 1
    assert float(optimizer.learning_rate) == pytest.approx(0.025)


@pytest.mark.parametrize("state_class", ["hvdtrain.keras: KerasState",
                                         "hvdtrain.tensorflow: TensorFlowKerasState"])
def test_elastic_state_syncs_restores_and_commits(state_class):
    module, name = state_class.split(": ")
    State = getattr((hvd if module == "hvdtrain.keras" else hvd_tf).elastic, name)
    if not ON_HOROVOD:
        model = dense_model(2, 2)
        assert_refused(State, model, batch=0, epoch=0)
        assert_refused(hvd.elastic.run, lambda state: None)
        return
    value = 1.0 if hvd.rank() == 0 else 2.0
    model = keras.Sequential([keras.layers.Dense(2, activation="softmax")])
    model.build((2, 2))
    model.set_weights([np.full((2, 2), value, np.float32), np.full(2, value, np.float32)])
    other = [np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.zeros(2, np.float32)]
    state = State(model, keras.optimizers.Adam(0.001 * hvd.size()),
                  batch=20 + hvd.rank(), epoch=10 + hvd.rank())
    state.sync()
    for weight in state.model.get_weights():
        np.testing.assert_allclose(weight, np.ones_like(weight))
    assert (state.batch, state.epoch) == (20, 10)
    synced = model.get_weights()

    model.set_weights(other)
    state.batch, state.epoch = 21, 11
    state.restore()
    for weight, expected in zip(model.get_weights(), synced):
        np.testing.assert_allclose(weight, expected)
    assert (state.batch, state.epoch) == (20, 10)

    model.set_weights(other)
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()
    for weight, expected in zip(model.get_weights(), other):
        np.testing.assert_allclose(weight, expected)
    assert (state.batch, state.epoch) == (21, 11)


def test_tensorflow_elastic_state_and_object_state_sync_restore_and_commit():
    """Horovod's ``test_elastic_state`` (``hvd.elastic.TensorFlowState``) on TensorFlow and
    Keras 3 variables, and ``ObjectState``; refused on TensorFlow's collectives."""
    elastic = hvd_tf.elastic
    value = 1.0 if hvd.rank() == 0 else 2.0
    variables = [tf.Variable(np.full((2, 2), value)), keras.Variable(np.full(2, value))]
    if not ON_HOROVOD:
        assert_refused(elastic.TensorFlowState, variables, batch=0)
        assert_refused(elastic.ObjectState, hvd_tf.broadcast_object, hvd.rank, step=0)
        assert_refused(elastic.run, lambda state: None)
        return
    state = elastic.TensorFlowState(variables, batch=20 + hvd.rank(), epoch=10 + hvd.rank())
    state.sync()
    assert [v.numpy().tolist() for v in variables] == [[[1.0, 1.0]] * 2, [1.0, 1.0]]
    assert (state.batch, state.epoch) == (20, 10)
    other = [np.array([[1.0, 2.0], [3.0, 4.0]]), np.zeros(2)]

    def assign(values) -> None:
        for variable, new in zip(variables, values):
            variable.assign(new)
        state.batch, state.epoch = 21, 11

    assign(other)
    state.restore()
    assert [v.numpy().tolist() for v in variables] == [[[1.0, 1.0]] * 2, [1.0, 1.0]]
    assert (state.batch, state.epoch) == (20, 10)
    assign(other)
    state.commit()
    state.restore()
    np.testing.assert_array_equal(variables[0].numpy(), other[0])
    assert (state.batch, state.epoch) == (21, 11)
    objects = elastic.ObjectState(hvd_tf.broadcast_object, hvd.rank, step=hvd.rank())
    objects.sync()
    assert objects.step == 0
    with pytest.raises(ValueError, match="session"):
        elastic.TensorFlowState(variables, session=object())


@pytest.mark.skipif(not ON_HOROVOD, reason="no elastic state on TensorFlow's collectives "
                                           "(its refusal: the test above)")
def test_elastic_callbacks_track_batch_and_epoch_and_commit():
    model = dense_model(3, 1)
    model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    commits = []
    original_commit = state.commit
    state.commit = lambda: (commits.append(state.batch), original_commit())
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=2)]
    model.fit(rank_data(8, 3), rank_data(8, 1), batch_size=2, epochs=2, callbacks=callbacks,
              verbose=0)
    assert (state.batch, state.epoch) == (0, 2)
    assert commits == [1, 3, 0, 1, 3, 0]      # every 2nd batch and at each epoch end
    trained = model.get_weights()
    model.set_weights([np.zeros_like(w) for w in trained])
    state.restore()
    for weight, expected in zip(model.get_weights(), trained):
        np.testing.assert_allclose(weight, expected)


def test_broadcast_callback_keeps_local_variables():
    root = hvd.size() - 1
    keras.utils.set_random_seed(hvd.rank())
    constant = keras.initializers.Constant(float(hvd.rank()))
    model = keras.Sequential([keras.Input((3,))] + [
        keras.layers.Dense(3, kernel_initializer=constant, bias_initializer=constant,
                           trainable=False) for _ in range(3)])
    model.compile(loss="mse")
    local = list(model.layers[0].variables)
    model.fit(np.ones((1, 3)), np.ones((1, 3)), verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=root, local_variables=local)])
    local_ids = {id(v) for v in local}
    for variable in model.variables:
        expected = hvd.rank() if id(variable) in local_ids else root
        np.testing.assert_allclose(variable.numpy(), np.full(variable.shape, float(expected)))


def test_backward_passes_per_step_equals_a_k_times_larger_batch():
    x, y = rank_data(16, 4), rank_data(16, 3)

    def train(passes: int, batch_size: int):
        model = dense_model(4, 3)
        optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                             backward_passes_per_step=passes,
                                             average_aggregated_gradients=True)
        model.compile(loss="mse", optimizer=optimizer)
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        return model.get_weights(), int(optimizer.iterations)

    accumulated, accumulated_updates = train(passes=2, batch_size=4)
    large, large_updates = train(passes=1, batch_size=8)
    assert accumulated_updates == large_updates == 2
    for left, right in zip(accumulated, large):
        np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-6)
    assert same_on_every_rank(accumulated[0])


def rank_gradient(**tape_options) -> float:
    """d/dw of (rank + 1) * w, combined across ranks by a DistributedGradientTape."""
    w = keras.Variable(0.0)
    with tf.GradientTape() as tape:
        loss = w * float(hvd.rank() + 1)
    return float(hvd_tf.DistributedGradientTape(tape, **tape_options).gradient(loss, w))


def test_sum_average_adasum_and_predivide_combine_as_horovod():
    assert hvd.size() == 2                                     # expected values for 2 ranks
    assert rank_gradient() == 1.5
    assert rank_gradient(op=hvd.Sum) == 3.0
    if ON_HOROVOD:
        assert rank_gradient(op=hvd.Adasum) == pytest.approx(1.5)  # (1 - 2/2)*1 + (1 - 2/8)*2
    else:
        assert_refused(rank_gradient, op=hvd.Adasum)
        assert_refused(hvd.DistributedOptimizer, keras.optimizers.SGD(1.0), op=hvd.Adasum)
        assert_refused(hvd.allreduce, 1.0, op=hvd.Adasum)
    assert rank_gradient(gradient_predivide_factor=4.0) == 1.5
    for op, expected in ((hvd.Sum, -3.0), (hvd.Average, -1.5)):
        w = keras.Variable(0.0)
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=op)
        optimizer.apply([tf.constant(float(hvd.rank() + 1))], [w])
        assert float(w) == expected


def test_fp16_compression_rounds_on_the_wire():
    w = keras.Variable(0.0)
    with tf.GradientTape(persistent=True) as tape:
        loss = w * 1.0001                     # float16 has no 1.0001: it becomes 1.0
    exact = hvd_tf.DistributedGradientTape(tape).gradient(loss, w)
    compressed = hvd_tf.DistributedGradientTape(
        tape, compression=hvd.Compression.fp16).gradient(loss, w)
    assert float(exact) == np.float32(1.0001)
    assert float(compressed) == 1.0 and compressed.dtype == tf.float32
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                         compression=hvd.Compression.fp16)
    optimizer.apply([tf.constant(1.0001)], [w])
    assert float(w) == -1.0


def test_loss_scale_optimizer_skips_on_every_rank_when_any_rank_overflows():
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0))
    w = keras.Variable([1.0])
    overflow = float("inf") if hvd.rank() == 1 else 1.0
    optimizer.apply([tf.constant([overflow])], [w])
    assert w.numpy() == 1.0 and float(optimizer.dynamic_scale) == 2.0   # skipped everywhere
    optimizer.apply([tf.constant([2.0 * (hvd.rank() + 1)])], [w])       # scaled by 2
    np.testing.assert_allclose(w.numpy(), [1.0 - 0.1 * 1.5])
    assert int(optimizer.iterations) == 1


def test_mixed_float16_fit_with_loss_scale_optimizer():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = dense_model(4, 3)
        optimizer = hvd.DistributedOptimizer(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
        model.compile(loss="mse", optimizer=optimizer)
        assert model.optimizer is optimizer       # not wrapped a second time by compile
        model.fit(rank_data(8, 4), rank_data(8, 3), batch_size=4, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert int(optimizer.iterations) == 2
    assert same_on_every_rank(model.get_weights()[0])


def test_load_model_wraps_the_saved_optimizer_with_its_state(tmp_path):
    model = dense_model(4, 3)
    model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    x, y = rank_data(8, 4), rank_data(8, 3)
    model.fit(x, y, batch_size=8, verbose=0)
    path = tmp_path / f"model-{hvd.rank()}.keras"
    model.save(path)

    plain = keras.models.load_model(path)
    assert type(plain.optimizer) is keras.optimizers.Adam      # loads without hvdtrain
    loaded = hvd.load_model(path)
    assert type(loaded.optimizer) is reducing_class(keras.optimizers.Adam,
                                                    hvd_tf.gradient_reduction(), 1, False)
    assert int(loaded.optimizer.iterations) == 1
    loaded.fit(x, y, batch_size=8, verbose=0)
    model.fit(x, y, batch_size=8, verbose=0)
    for left, right in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_allclose(left, right, rtol=1e-6)
    assert same_on_every_rank(loaded.get_weights()[0])


def test_allreduce_and_broadcast_take_keras_variables():
    variable = keras.Variable([float(hvd.rank())] * 3)
    np.testing.assert_allclose(hvd_tf.allreduce(variable, op=hvd.Sum).numpy(), [1.0] * 3)
    (total,) = hvd_tf.grouped_allreduce([variable], op=hvd.Sum)
    np.testing.assert_allclose(total.numpy(), [1.0] * 3)
    hvd_tf.broadcast_variables([variable], root_rank=1)
    np.testing.assert_allclose(variable.numpy(), [1.0] * 3)
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)


def test_broadcast_in_place_overwrites_keras_and_tensorflow_variables():
    variables = [keras.Variable([float(hvd.rank())] * 3, name="floats"),   # (Horovod keys
                 tf.Variable([hvd.rank()] * 2, name="ints"),               # them by name)
                 tf.Variable(tf.cast([hvd.rank()], tf.int8), name="bytes")]
    values = hvd_tf.broadcast_(variables, 1)
    assert [v.numpy().tolist() for v in variables] == [[1.0] * 3, [1, 1], [1]]
    assert [np.asarray(v).tolist() for v in values] == [[1.0] * 3, [1, 1], [1]]
    assert hvd_tf.broadcast_object_fn(root_rank=1)({"rank": hvd.rank()}) == {"rank": 1}


def test_best_model_checkpoint_is_written_by_rank_0_under_a_keras_3_name(tmp_path):
    shared = hvd_tf.broadcast_object(str(tmp_path))           # rank 0's directory
    model = dense_model(4, 3)
    model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    checkpoint = hvd.callbacks.BestModelCheckpoint(
        filepath=f"{shared}/best-of-rank-{hvd.rank()}.h5")
    model.fit(rank_data(8, 4), rank_data(8, 3), batch_size=4, epochs=2, verbose=0,
              validation_data=(rank_data(4, 4), rank_data(4, 3)),
              callbacks=[hvd.callbacks.MetricAverageCallback(), checkpoint])
    hvd.allreduce(0.0)                                        # both ranks have finished
    written = sorted(path.name for path in Path(shared).glob("best-*"))
    assert written == ["best-of-rank-0.keras"]
    assert keras.models.load_model(Path(shared) / written[0]).count_params() == 15


MODES = ["eager", "tf.function", "tf1-graph"]


def run_in(mode: str, build):
    """``build()``'s tensors computed eagerly, in a tf.function, or in a TensorFlow 1 graph run
    by a session (built there, as Horovod's own tests build them), as NumPy values."""
    if mode == "eager":
        built = build()
    elif mode == "tf.function":
        built = tf.function(build, autograph=False)()      # (AutoGraph: seconds, no use)
    else:
        with tf.Graph().as_default():
            built = build()
            with tf.compat.v1.Session() as session:
                built = session.run(built)
    return tf.nest.map_structure(np.asarray, built)


def on_rank(shape, dtype=tf.float32) -> tf.Tensor:
    """A tensor of ``shape`` filled with this rank's number."""
    return tf.fill(shape, tf.cast(hvd.rank(), dtype))


def mine(on_0, on_1):
    return on_0 if hvd.rank() == 0 else on_1


# Each collective with a zero-sized dimension (and a few with data beside it): the results of
# Horovod 0.28.1 on 2 ranks, measured (the same eagerly, in a tf.function and in a graph).
EMPTY = {
    "allreduce [2,0]": (lambda: hvd_tf.allreduce(on_rank([2, 0]), op=hvd.Sum), [(2, 0)]),
    "allreduce [0]": (lambda: hvd_tf.allreduce(on_rank([0]), op=hvd.Sum), [(0,)]),
    "allreduce int32 [0,3]": (lambda: hvd_tf.allreduce(on_rank([0, 3], tf.int32), op=hvd.Sum),
                              [(0, 3)]),
    "allreduce min [0]": (lambda: hvd_tf.allreduce(on_rank([0]), op=hvd_tf.Min), [(0,)]),
    "grouped_allreduce": (lambda: hvd_tf.grouped_allreduce([on_rank([0]), on_rank([2])],
                                                           op=hvd.Sum), [(0,), [1.0, 1.0]]),
    "allgather [0,3]": (lambda: hvd_tf.allgather(on_rank([0, 3])), [(0, 3)]),
    "allgather [2,0]": (lambda: hvd_tf.allgather(on_rank([2, 0])), [(4, 0)]),
    "allgather [0]": (lambda: hvd_tf.allgather(on_rank([0])), [(0,)]),
    "allgather [0,3] and [2,3]": (lambda: hvd_tf.allgather(on_rank(mine([0, 3], [2, 3]))),
                                  [[[1.0] * 3] * 2]),
    "allgather [2,0] and [3,0]": (lambda: hvd_tf.allgather(on_rank(mine([2, 0], [3, 0]))),
                                  [(5, 0)]),
    "grouped_allgather": (lambda: hvd_tf.grouped_allgather([on_rank([0, 2]), on_rank([1])]),
                          [(0, 2), [0.0, 1.0]]),
    "broadcast [2,0]": (lambda: hvd_tf.broadcast(on_rank([2, 0]), 0), [(2, 0)]),
    "broadcast [0]": (lambda: hvd_tf.broadcast(on_rank([0]), 1), [(0,)]),
    "alltoall [2,0]": (lambda: hvd_tf.alltoall(on_rank([2, 0])), [(2, 0)]),
    "alltoall [0]": (lambda: hvd_tf.alltoall(on_rank([0])), [(0,)]),
    "alltoall [0,3]": (lambda: hvd_tf.alltoall(on_rank([0, 3])), [(0, 3)]),
    "alltoall [2,0] splits": (lambda: hvd_tf.alltoall(on_rank([2, 0]), splits=[1, 1]),
                              [(2, 0), [1, 1]]),
    "alltoall [0,3] zero splits": (lambda: hvd_tf.alltoall(on_rank([0, 3]), splits=[0, 0]),
                                   [(0, 3), [0, 0]]),
    "reducescatter [0]": (lambda: hvd_tf.reducescatter(on_rank([0]), op=hvd.Sum), [(0,)]),
    "reducescatter [2,0]": (lambda: hvd_tf.reducescatter(on_rank([2, 0]), op=hvd.Sum),
                            [(1, 0)]),
    "reducescatter [0,3]": (lambda: hvd_tf.reducescatter(on_rank([0, 3]), op=hvd.Sum),
                            [(0, 3)]),
    "reducescatter [1]": (lambda: hvd_tf.reducescatter(on_rank([1]), op=hvd.Sum),
                          [mine([1.0], (0,))]),
    "grouped_reducescatter": (lambda: hvd_tf.grouped_reducescatter(
        [on_rank([0]), on_rank([2, 0])], op=hvd.Sum), [(0,), (1, 0)]),
}


@pytest.mark.parametrize("mode", MODES)
def test_every_collective_takes_a_zero_sized_dimension_as_horovod_does(mode):
    """Horovod's results for empty tensors (TensorFlow's all-gather crashes the process on
    one: the TensorFlow backend never hands it one). A tuple expects that shape of an empty
    result, a list those values. All built at once: one function, one graph (whose session
    runs them all together). On Horovod only eagerly: there these are Horovod's own ops, and
    Horovod 0.28.1 alone stalls when one graph or function holds them together (measured; each
    in a graph or function of its own gives the results below)."""
    if ON_HOROVOD and mode != "eager":
        pytest.skip("Horovod's own ops; together in one graph they stall Horovod itself")
    every = run_in(mode, lambda: [build() for build, _ in EMPTY.values()])
    for name, (_, expected), results in zip(EMPTY, EMPTY.values(), every):
        results = list(results) if isinstance(results, (list, tuple)) else [results]
        for result, want in zip(results, expected, strict=True):
            if isinstance(want, tuple):
                assert result.shape == want, name
            else:
                np.testing.assert_array_equal(result, want, err_msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_scalars_are_reduced_broadcast_or_refused_as_horovod_does(mode):
    assert run_in(mode, lambda: hvd_tf.allreduce(on_rank([]), op=hvd.Sum)) == 1.0
    assert run_in(mode, lambda: hvd_tf.broadcast(on_rank([]), 1)) == 1.0
    eager = mode == "eager"
    for build, eager_error in (
            (lambda: hvd_tf.allgather(on_rank([])), tf.errors.FailedPreconditionError),
            (lambda: hvd_tf.reducescatter(on_rank([])), tf.errors.InvalidArgumentError),
            (lambda: hvd_tf.alltoall(on_rank([])), ValueError)):     # (Horovod's eager: a crash)
        with pytest.raises(eager_error if eager else ValueError, match="scalar|rank|dimension"):
            run_in(mode, build)


@pytest.mark.parametrize("mode", MODES)
def test_ranks_that_disagree_on_a_shape_get_horovods_error_and_carry_on(mode):
    """FailedPreconditionError on every rank, as Horovod gives it (TensorFlow's collectives in
    a tf.function: InvalidArgumentError), never a crash or a hang; the next collective works."""
    disagreeing = [
        lambda: hvd_tf.allreduce(on_rank(mine([2, 0], [3, 0])), op=hvd.Sum),
        lambda: hvd_tf.allreduce(on_rank(mine([], [1])), op=hvd.Sum),
        lambda: hvd_tf.allgather(on_rank(mine([2, 0], [2, 1]))),
        lambda: hvd_tf.broadcast(on_rank(mine([2, 0], [0, 2])), 0),
        lambda: hvd_tf.alltoall(on_rank(mine([2, 0], [2, 1]))),
        lambda: hvd_tf.reducescatter(on_rank(mine([2, 0], [3, 0])), op=hvd.Sum),
    ]
    error = (tf.errors.InvalidArgumentError if mode == "tf.function" and not ON_HOROVOD else
             tf.errors.FailedPreconditionError)
    for build in disagreeing:
        with pytest.raises(error):
            run_in(mode, build)
    assert run_in(mode, lambda: hvd_tf.allreduce(on_rank([2]), op=hvd.Sum)).tolist() == [1, 1]


@pytest.mark.parametrize("mode", MODES)
def test_tensors_over_a_message_travel_in_pieces_and_arrive_whole(mode, monkeypatch):
    """TensorFlow's collectives only: a tensor over ``tf_messages.MESSAGE_BYTES`` (64 bytes
    here) travels in pieces, several small ones in batches of about that size; every result
    as one message gives it, position by position (values differ by position and rank)."""
    if ON_HOROVOD:
        pytest.skip("messages are cut on TensorFlow's collectives only")
    from hvdtrain.collectives import tensorflow_backend, tf_messages

    monkeypatch.setattr(tf_messages, "MESSAGE_BYTES", 64)
    pieces = []
    monkeypatch.setattr(tensorflow_backend, "piece_lengths", lambda elements, itemsize: (
        pieces.append(tf_messages.piece_lengths(elements, itemsize)) or pieces[-1]))
    rank = float(hvd.rank())

    def numbered(shape, dtype=tf.float32):
        return tf.reshape(tf.range(np.prod(shape), dtype=dtype), shape)

    reduced, gathered, broadcast = run_in(mode, lambda: (
        hvd_tf.allreduce(numbered([17, 5]) * (rank + 1), op=hvd.Sum),        # 340 bytes
        hvd_tf.allgather(numbered([3, 7], tf.int64) + 100 * hvd.rank()),
        hvd_tf.broadcast(numbered([9, 4], tf.float64) + rank, 1)))
    np.testing.assert_array_equal(reduced, numbered([17, 5]) * 3)
    np.testing.assert_array_equal(gathered, tf.concat([numbered([3, 7], tf.int64),
                                                       numbered([3, 7], tf.int64) + 100], 0))
    np.testing.assert_array_equal(broadcast, numbered([9, 4], tf.float64) + 1)
    assert {6, 5} <= {len(lengths) for lengths in pieces}     # the allreduce, the broadcast
    if mode == "eager":      # the batches: variables of a model, gradient buckets
        keras.utils.set_random_seed(hvd.rank())
        model = keras.Sequential([keras.Input((7,)), keras.layers.Dense(5),
                                  keras.layers.Dense(2)])
        hvd_tf.broadcast_variables(model.variables, root_rank=1)
        assert same_on_every_rank(np.concatenate([w.ravel() for w in model.get_weights()]))
        summed = hvd_tf.collectives().allreduce_sum([numbered([5]) + rank, numbered([30]),
                                                     numbered([2, 3], tf.int32)])
        for total, expected in zip(summed, [numbered([5]) * 2 + 1, numbered([30]) * 2,
                                            numbered([2, 3], tf.int32) * 2]):
            np.testing.assert_array_equal(total, expected)


def test_a_tensorflow_1_graph_runs_collectives_and_leaves_nothing_bound_to_it():
    """Horovod's tests call ``init()`` inside a graph and run its ops in a session: more
    independent collectives than the session has threads, a node whose input size changes
    between runs, ``broadcast_global_variables`` and ``broadcast_``. Afterwards the eager
    collectives work (nothing of the process's collectives lives in the dead graph)."""
    from tensorflow.python.ops import resource_variable_ops

    with tf.Graph().as_default():
        hvd.init()
        rows = tf.compat.v1.placeholder(tf.float32, [None, 2])
        gathered = hvd_tf.allgather(rows)
        sums = [hvd_tf.allreduce(tf.fill([3], float(i + hvd.rank())), op=hvd.Sum)
                for i in range(8)]
        reference = tf.compat.v1.Variable([float(hvd.rank())] * 2)
        resource = resource_variable_ops.ResourceVariable([hvd.rank()] * 3)
        everything = hvd_tf.broadcast_global_variables(1)
        (in_place,) = hvd_tf.broadcast_([resource], 0)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for count in (1, 3, 0):
                mine_rows = np.full((count + hvd.rank(), 2), hvd.rank(), np.float32)
                assert session.run(gathered, {rows: mine_rows}).shape == (2 * count + 1, 2)
            assert [total.tolist() for total in session.run(sums)] == [
                [2.0 * i + 1] * 3 for i in range(8)]
            assert session.run(in_place).tolist() == [0, 0, 0]
            session.run(everything)
            assert [v.tolist() for v in session.run([reference, resource])] == [
                [1.0, 1.0], [0, 0, 0]]
            assert hvd_tf.broadcast_object(f"graph-{hvd.rank()}", 1) == "graph-1"
    assert hvd_tf.allreduce(tf.constant(1.0), op=hvd.Sum).numpy() == 2.0
    assert hvd_tf.allgather_object(hvd.rank()) == [0, 1]
    with pytest.raises(RuntimeError, match="TensorFlow 1 graph"):
        hvd_tf.broadcast_global_variables(0)


@pytest.mark.skipif(ON_HOROVOD, reason="Horovod does these itself")
def test_what_only_horovod_does_is_refused_in_one_line():
    assert_refused(hvd_tf.join)
    assert_refused(hvd.start_timeline, "timeline.json")
    assert_refused(hvd.stop_timeline)
    assert_refused(hvd.init, process_sets=[[0]])
    assert_refused(hvd_tf.allreduce, tf.ones([2]), process_set=object())
    assert_refused(hvd_tf.size_op, process_set_id=1)
    assert_refused(hvd_tf.elastic.run, lambda state: None)
    assert_refused(hvd_tf.elastic.TensorFlowState, [tf.Variable(1.0)])
    assert_refused(hvd_tf.elastic.TensorFlowKerasState, dense_model(2, 2))
    assert_refused(hvd_tf.elastic.ObjectState, hvd_tf.broadcast_object, hvd.rank)
    assert hvd.is_initialized()                      # a refusal changes nothing


def test_process_facts_and_build_facts():
    """The facts Horovod scripts read, the same on both backends for this launch."""
    assert (hvd.size(), hvd.local_size(), hvd.cross_size()) == (2, 2, 1)
    assert hvd.local_rank() == hvd.rank() and hvd.cross_rank() == 0
    assert hvd_tf.is_homogeneous()
    assert [int(op()) for op in (hvd_tf.size_op, hvd_tf.rank_op, hvd_tf.local_size_op,
                                 hvd_tf.local_rank_op)] == [2, hvd.rank(), 2, hvd.rank()]
    built = [fact() for fact in (hvd.mpi_built, hvd.gloo_built, hvd.nccl_built, hvd.ddl_built,
                                 hvd.ccl_built, hvd.cuda_built, hvd.rocm_built)]
    assert all(isinstance(fact, (bool, int)) for fact in built)
    assert hvd.mpi_built() == ON_HOROVOD        # this Horovod was built with MPI; TF has none


def test_shutdown_and_init_again():
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init()
    assert hvd.is_initialized() and hvd.size() == 2
    assert hvd.allreduce(float(hvd.rank()), op=hvd.Sum).numpy() == 1.0
