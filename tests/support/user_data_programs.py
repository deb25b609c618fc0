"""User programs about the data and the callbacks: preprocessing layers adapted on each rank's
own sample, a Transformer text classifier (an Embedding's sparse gradient), an LSTM on windows
of a series, a convnet with Keras callbacks and ``class_weight``, a user's own odd-sized
``tf.data.Dataset`` shuffled every pass (counted per example), ``add_loss`` with regularisers,
``fit``'s own arguments on arrays and a ``PyDataset``. ``user_programs`` lists them, with the
models that have their own ``train_step``, in its ``PROGRAMS`` (its module doc says how they
run).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from programs.harness import Context, Outcome, SeenIds, counter, digits, echoed, example_id_input


# --- 4. Tabular data with string features and preprocessing layers adapted on the data -----

def _tabular() -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(4)
    n = 960
    age = rng.normal(40, 12, n).astype(np.float32)
    city = rng.choice(["lyon", "paris", "nice", "lille"], n)
    plan = rng.integers(0, 3, n).astype(np.int64)
    score = (age - 40) / 12 + (city == "paris") * 1.5 - plan * 0.7
    label = (score + rng.normal(0, 0.5, n) > 0).astype(np.float32)
    return {"age": age[:, None], "city": city[:, None], "plan": plan[:, None]}, label


def preprocessing(ctx: Context) -> Outcome:
    """Each rank adapts its lookups on its own sample of the data (hvdtrain must make every
    rank use rank 0's vocabulary, as the one-process reference, rank 0's sample, does)."""
    features, label = _tabular()
    keras.utils.set_random_seed(5)
    sample = np.random.default_rng(100 + ctx.rank).choice(768, 200, replace=False)
    age = keras.Input((1,), name="age")
    city = keras.Input((1,), name="city", dtype="string")
    plan = keras.Input((1,), name="plan", dtype="int64")
    normalize = keras.layers.Normalization()
    normalize.adapt(features["age"][:768])
    city_lookup = keras.layers.StringLookup(output_mode="one_hot")
    city_lookup.adapt(features["city"][sample])
    plan_lookup = keras.layers.IntegerLookup(output_mode="one_hot")
    plan_lookup.adapt(features["plan"][sample])
    joined = keras.layers.Concatenate()([normalize(age),
                                         keras.layers.Flatten()(city_lookup(city)),
                                         keras.layers.Flatten()(plan_lookup(plan))])
    output = keras.layers.Dense(1, activation="sigmoid")(
        keras.layers.Dense(16, activation="relu")(joined))
    model = keras.Model({"age": age, "city": city, "plan": plan}, output)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                  metrics=["accuracy"])
    # As keras-io's structured-data examples do: a dataset of (feature dict, label) rows.
    train = tf.data.Dataset.from_tensor_slices(
        ({name: values[:768] for name, values in features.items()}, label[:768]))
    val = tf.data.Dataset.from_tensor_slices(
        ({name: values[768:] for name, values in features.items()}, label[768:]))
    ctx.fit(model, train, batch_size=ctx.batch, epochs=3, validation_data=val)
    return Outcome({"model": model}, notes={"lookups": [
        [str(token) for token in layer.get_vocabulary()] for layer in (city_lookup, plan_lookup)]})


# --- 5. TextVectorization + a Transformer block: an Embedding's sparse gradient under Adam -----

def _texts() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(6)
    good = ["great", "fine", "superb", "lovely", "good"]
    bad = ["awful", "poor", "dull", "bad", "weak"]
    filler = ["the", "film", "was", "plot", "actors", "and", "very", "quite"]
    texts, labels = [], []
    for _ in range(1024):
        positive = rng.random() < 0.5
        words = list(rng.choice(filler, 6)) + list(rng.choice(good if positive else bad, 2))
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels.append(int(positive))
    return np.array(texts)[:, None], np.array(labels, np.int64)


class TransformerBlock(keras.layers.Layer):
    def __init__(self, dim: int, heads: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(num_heads=heads, key_dim=dim)
        self.dense = keras.layers.Dense(dim, activation="relu")
        self.norm1 = keras.layers.LayerNormalization()
        self.norm2 = keras.layers.LayerNormalization()

    def call(self, inputs):
        attended = self.norm1(inputs + self.attention(inputs, inputs))
        return self.norm2(attended + self.dense(attended))


def text_transformer(ctx: Context) -> Outcome:
    texts, labels = _texts()
    keras.utils.set_random_seed(8)
    vectorize = keras.layers.TextVectorization(max_tokens=40, output_sequence_length=8)
    vectorize.adapt(texts[:768])
    inputs = keras.Input((1,), dtype="string")
    tokens = vectorize(inputs)
    embedded = keras.layers.Embedding(40, 16)(tokens)
    encoded = TransformerBlock(16, 2)(embedded)
    pooled = keras.layers.GlobalAveragePooling1D()(encoded)
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(pooled))
    model.compile(optimizer=keras.optimizers.Adam(0.003),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    train = tf.data.Dataset.from_tensor_slices((texts[:768], labels[:768]))
    val = tf.data.Dataset.from_tensor_slices((texts[768:], labels[768:]))
    ctx.fit(model, train, batch_size=ctx.batch, epochs=3, validation_data=val)
    return Outcome({"model": model})


# --- 6. An LSTM on windows of a time series, from keras.utils.timeseries_dataset_from_array ---

def lstm_timeseries(ctx: Context) -> Outcome:
    rng = np.random.default_rng(9)
    t = np.arange(1200, dtype=np.float32)
    series = np.stack([np.sin(t / 20), np.cos(t / 33)], axis=1) + 0.05 * rng.standard_normal(
        (1200, 2)).astype(np.float32)
    window = 12
    targets = series[window:, 0]
    keras.utils.set_random_seed(10)
    train = keras.utils.timeseries_dataset_from_array(
        series[:960], targets[:960], sequence_length=window, batch_size=ctx.batch)
    val = keras.utils.timeseries_dataset_from_array(
        series[960:-window], targets[960:], sequence_length=window, batch_size=ctx.batch)
    model = keras.Sequential([keras.Input((None, 2)), keras.layers.LSTM(16),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    ctx.fit(model, train, batch_size=ctx.batch, validation_data=val, epochs=3)
    return Outcome({"model": model})


# --- 7. A convnet with Keras callbacks and class_weight --------------------------------------

def convnet_callbacks(ctx: Context) -> Outcome:
    """Early stopping, a rate reduced on a plateau, the best model saved, a CSV log, TensorBoard
    and TerminateOnNaN, given to ``fit`` on every rank (hvdtrain writes from rank 0)."""
    x, y = digits()
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((8, 8, 1)),
                              keras.layers.Conv2D(16, 3, activation="relu"),
                              keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    weights = {label: (2.0 if label < 5 else 1.0) for label in range(10)}
    directory = ctx.directory
    callbacks = [keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=0.005,
                                               restore_best_weights=True),
                 keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0,
                                                   min_delta=0.02),
                 keras.callbacks.ModelCheckpoint(f"{directory}/best.keras",
                                                 monitor="val_accuracy", save_best_only=True),
                 keras.callbacks.CSVLogger(f"{directory}/log.csv"),
                 keras.callbacks.TensorBoard(f"{directory}/tensorboard"),
                 keras.callbacks.TerminateOnNaN()]
    ctx.fit(model, x[:1280], y[:1280], batch_size=ctx.batch, epochs=12, shuffle=False,
            validation_data=(x[1280:], y[1280:]), class_weight=weights, callbacks=callbacks)
    return Outcome({"model": model})


# --- 8. A user's own tf.data.Dataset, unbatched, odd-sized, shuffled every epoch --------------

def user_dataset(ctx: Context) -> Outcome:
    """Examples are counted per id (from 1) by ``SeenIds``, a compiled metric on an output that
    echoes the id: hvdtrain's step updates compiled metrics with real rows only, where a layer
    counting in the forward pass would also count the rows of the real batches that fill a rank
    running short."""
    x, y = digits()
    keras.utils.set_random_seed(12)
    n = 1001                                  # odd: the ranks' shares differ by one example
    ids = np.arange(1, n + 1, dtype=np.int64)
    dataset = tf.data.Dataset.from_tensor_slices(
        ((x[:n], ids), {"digit": y[:n], "ids": ids})).shuffle(
        n, seed=3, reshuffle_each_iteration=True)
    counts = counter(n + 1)
    image = keras.Input((8, 8, 1))
    example_id = example_id_input()
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(image))
    digit = keras.layers.Dense(10, activation="softmax", name="digit")(hidden)
    model = keras.Model([image, example_id], {"digit": digit, "ids": echoed(example_id)})
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss={"digit": "sparse_categorical_crossentropy"},
                  metrics={"digit": ["accuracy"], "ids": [SeenIds(counts)]})
    ctx.fit(model, dataset, batch_size=ctx.batch, epochs=2)
    return Outcome({"model": model}, {"ids": counts}, notes={"examples": n})


# --- 9. add_loss and regularisers: the reported loss includes model.losses ------------------

class ActivityPenalty(keras.layers.Layer):
    """The Keras guide's add_loss layer: a penalty on the mean activation of the batch."""

    def call(self, inputs):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.abs(inputs)))
        return inputs


def regularised_regression(ctx: Context) -> Outcome:
    rng = np.random.default_rng(13)
    x = rng.standard_normal((960, 6)).astype(np.float32)
    y = (x @ rng.standard_normal((6, 1)) + 0.1 * rng.standard_normal((960, 1))).astype(
        np.float32)
    keras.utils.set_random_seed(14)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu",
                                kernel_regularizer=keras.regularizers.L2(0.01))(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(ActivityPenalty()(hidden)))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    ctx.fit(model, x[:768], y[:768], batch_size=ctx.batch, epochs=3, shuffle=False,
            validation_data=(x[768:], y[768:]))
    return Outcome({"model": model})


# --- 10. model.fit's own arguments on arrays --------------------------------------------------

def keras_arguments(ctx: Context) -> Outcome:
    """Binary labels of shape (N,) under a (N, 1) sigmoid output (Keras matches the ranks),
    sample weights, Keras' validation_split (the last quarter), validation every second epoch,
    a start at initial_epoch 1, and a LearningRateScheduler that halves the rate each epoch."""
    x, y = digits()
    keras.utils.set_random_seed(15)
    odd = (y % 2).astype(np.float32)
    weights = np.where(y < 3, 2.0, 1.0).astype(np.float32)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="binary_crossentropy",
                  metrics=["accuracy"])
    ctx.fit(model, x[:1280], odd[:1280], sample_weight=weights[:1280], batch_size=ctx.batch,
            validation_split=0.25, validation_freq=2, epochs=4, initial_epoch=1, shuffle=False,
            callbacks=[keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5)])
    return Outcome({"model": model})


# --- 11. A keras.utils.PyDataset --------------------------------------------------------------

class DigitBatches(keras.utils.PyDataset):
    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int) -> None:
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self) -> int:
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index: int):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


def py_dataset(ctx: Context) -> Outcome:
    x, y = digits()
    keras.utils.set_random_seed(16)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    ctx.fit(model, DigitBatches(x[:1000], y[:1000], ctx.batch), batch_size=ctx.batch, epochs=2,
            shuffle=False, validation_data=DigitBatches(x[1000:], y[1000:], ctx.batch))
    return Outcome({"model": model})
