"""Issue 27's program shapes about input pipelines, written in the style of the keras-io
examples on offline data (sklearn's digits, synthetic NumPy data): string lookups with
``num_oov_indices=0`` on batches that split unevenly over the ranks, a
``timeseries_dataset_from_array`` forecaster with uneven validation, ``steps_per_epoch``
computed from the batch size beyond the data (and below one pass), seeded and unseeded
shuffles built before ``fit``, a pipeline built by a function, dict inputs with sample weights,
a pre-batched pipeline, text classification with ``TextVectorization`` in the pipeline and
structured data through ``FeatureSpace``.

Programs of the harness (``programs.harness``: ``Context``, ``Outcome``, the modes, the example
counters); ``keras_programs`` lists them, with issue 27's other shapes, in its ``PROGRAMS``.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from programs.harness import (VAL_IDS, Context, Outcome, SeenIds, counter, digits, echoed,
                              example_id_input, ids)


# --- 1. Lookups with num_oov_indices=0, 107 batches: 54 and 53 per rank -----------------------

COLOURS = ["amber", "blue", "coral", "green", "ivory", "olive"]


def _fabrics(rng: np.random.Generator, n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    colour = rng.choice(COLOURS, n)
    weight = rng.normal(300, 60, n).astype(np.float32)
    label = ((np.isin(colour, ["blue", "green", "olive"]) * 1.2 + (weight - 300) / 60
              + rng.normal(0, 0.4, n)) > 0.6).astype(np.float32)
    return {"colour": colour[:, None], "weight": weight[:, None]}, label


def lookup_uneven_batches(ctx: Context) -> Outcome:
    """Tabular data with a closed vocabulary: ``StringLookup(num_oov_indices=0)`` raises on any
    string outside it. 1,699 rows in batches of 16 per rank are 107 batches, 54 on rank 0 and
    53 on rank 1 (the issue's split); one process batches 32 and runs 54 steps, the last of 3
    rows."""
    rng = np.random.default_rng(101)
    features, label = _fabrics(rng, 1699)
    keras.utils.set_random_seed(102)
    counts = counter(1699)
    colour = keras.Input((1,), dtype="string", name="colour")
    weight = keras.Input((1,), name="weight")
    example_id = example_id_input()
    lookup = keras.layers.StringLookup(vocabulary=COLOURS, num_oov_indices=0,
                                       output_mode="one_hot")
    scale = keras.layers.Normalization(mean=300.0, variance=3600.0)
    joined = keras.layers.Concatenate()([keras.layers.Flatten()(lookup(colour)), scale(weight)])
    hidden = keras.layers.Dense(16, activation="relu")(joined)
    output = keras.layers.Dense(1, activation="sigmoid", name="label")(hidden)
    model = keras.Model({"colour": colour, "weight": weight, "example_id": example_id},
                        {"label": output, "ids": echoed(example_id)})
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.01)),
                  loss={"label": "binary_crossentropy"},
                  metrics={"label": ["accuracy"], "ids": [SeenIds(counts)]})

    def rows(start: int, stop: int, first_id: int) -> tf.data.Dataset:
        x = {name: values[start:stop] for name, values in features.items()}
        x["example_id"] = ids(first_id, stop - start)
        return tf.data.Dataset.from_tensor_slices((x, {"label": label[start:stop],
                                                       "ids": x["example_id"]}))

    ctx.fit(model, rows(0, 1699, 0).batch(ctx.batch), epochs=2)
    return Outcome({"model": model}, {"ids": counts})


# --- 2. A forecaster on windows of a series; the validation windows split unevenly ---------

def timeseries_uneven_validation(ctx: Context) -> Outcome:
    """The keras-io weather-forecast shape: ``timeseries_dataset_from_array`` windows of 12 hours
    of two readings predict the next temperature. 160 training windows (10 batches of 16 per
    rank: 5 each), 37 validation windows (3 batches of 16: 2 and 1). Each window's id is its
    first row, carried in the series as a third column and split off in the pipeline."""
    hours = np.arange(400, dtype=np.float32)
    rng = np.random.default_rng(103)
    temperature = 10 + 6 * np.sin(hours * 2 * np.pi / 24) + rng.normal(0, 0.5, 400)
    pressure = 1000 + 4 * np.cos(hours * 2 * np.pi / 70) + rng.normal(0, 0.3, 400)
    readings = np.stack([(temperature - 10) / 6, (pressure - 1000) / 4], axis=1)
    window = 12
    keras.utils.set_random_seed(104)
    counts = counter(VAL_IDS + 400)

    def windows(start: int, count: int, first_id: int) -> tf.data.Dataset:
        rows = slice(start, start + count + window - 1)
        series = np.concatenate([readings[rows], ids(first_id, count + window - 1)[:, None]],
                                axis=1).astype(np.float32)
        targets = readings[start + window:start + window + count, 0].astype(np.float32)
        dataset = keras.utils.timeseries_dataset_from_array(
            series, targets, sequence_length=window, batch_size=ctx.batch)
        return dataset.map(lambda w, t: (
            {"window": w[:, :, :2], "example_id": tf.cast(w[:, 0, 2], tf.int64)},
            {"forecast": t, "ids": tf.cast(w[:, 0, 2], tf.int64)}))

    inputs = keras.Input((window, 2), name="window")
    example_id = example_id_input()
    hidden = keras.layers.Conv1D(8, 3, activation="relu")(inputs)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    forecast = keras.layers.Dense(1, name="forecast")(hidden)
    model = keras.Model({"window": inputs, "example_id": example_id},
                        {"forecast": forecast, "ids": echoed(example_id)})
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.01)),
                  loss={"forecast": "mse"},
                  metrics={"forecast": ["mae"], "ids": [SeenIds(counts)]})
    train = ctx.shard_dataset(windows(0, 160, 0))
    val = windows(200, 37, VAL_IDS)         # every rank validates on all of it
    ctx.fit(model, train, validation_data=val, epochs=2)
    return Outcome({"model": model}, {"ids": counts})


# --- 3. steps_per_epoch from the batch size, beyond the data; then below one pass ---------

def steps_beyond_the_data(ctx: Context) -> Outcome:
    """A regression whose pipeline drops the rows with a missing target (19 of 200): the
    program computes ``steps_per_epoch`` from the raw row count and its batch size, so each
    epoch asks for more batches than one pass has (6 of 32, the last of 21 rows), and Keras ends
    the epoch when the pass ends ('Your input ran out of data'). Then ``steps_per_epoch=4`` over
    4 epochs: a stream of passes, epochs of 4, 2, 4 and 2 steps."""
    rng = np.random.default_rng(105)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    y = (x @ np.array([0.5, -1.0, 0.25, 2.0], np.float32) + 0.1).astype(np.float32)
    y[[i for i in range(190) if i % 10 == 3]] = np.nan
    keras.utils.set_random_seed(106)
    counts = counter(200)
    features = keras.Input((4,), name="features")
    example_id = example_id_input()
    output = keras.layers.Dense(1, name="target")(
        keras.layers.Dense(8, activation="relu")(features))
    model = keras.Model({"features": features, "example_id": example_id},
                        {"target": output, "ids": echoed(example_id)})
    model.compile(optimizer=ctx.optimizer(keras.optimizers.SGD(0.05)),
                  loss={"target": "mse"}, metrics={"ids": [SeenIds(counts)]})
    rows = tf.data.Dataset.from_tensor_slices(
        ({"features": x, "example_id": ids(0, 200)}, {"target": y, "ids": ids(0, 200)}))
    dataset = ctx.shard_dataset(rows.filter(
        lambda x, y: tf.logical_not(tf.math.is_nan(y["target"]))))
    steps_per_epoch = math.ceil(len(x) / ctx.batch)
    ctx.fit(model, dataset, batch_size=ctx.batch, epochs=2, steps_per_epoch=steps_per_epoch)
    ctx.fit(model, dataset, batch_size=ctx.batch, epochs=4, steps_per_epoch=4)
    return Outcome({"model": model}, {"ids": counts}, notes={"steps_per_epoch": steps_per_epoch})


# --- 4-6. Shuffles built before fit; a pipeline built by a function -----------------------

def _digit_classifier(ctx: Context, counts: tf.Variable, rate: float = 0.05) -> keras.Model:
    image = keras.Input((8, 8, 1), name="image")
    example_id = example_id_input()
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(image))
    digit = keras.layers.Dense(10, activation="softmax", name="digit")(hidden)
    model = keras.Model({"image": image, "example_id": example_id},
                        {"digit": digit, "ids": echoed(example_id)})
    model.compile(optimizer=ctx.optimizer(keras.optimizers.SGD(rate)),
                  loss={"digit": "sparse_categorical_crossentropy"},
                  metrics={"digit": ["accuracy"], "ids": [SeenIds(counts)]})
    return model


def _digit_rows(count: int) -> tf.data.Dataset:
    x, y = digits()
    example = ids(0, count)
    return tf.data.Dataset.from_tensor_slices(
        ({"image": x[:count], "example_id": example}, {"digit": y[:count], "ids": example}))


def seeded_shuffle(ctx: Context) -> Outcome:
    """A user's pipeline shuffled with a seed before ``fit`` (reshuffled every pass): 301
    examples, 151 and 150 per rank, 10 batches each. The drop-in user shards after the seeded
    shuffle, which orders alike on every rank."""
    keras.utils.set_random_seed(107)
    counts = counter(301)
    model = _digit_classifier(ctx, counts)
    dataset = ctx.shard_dataset(_digit_rows(301).shuffle(301, seed=7))
    ctx.fit(model, dataset, batch_size=ctx.batch, epochs=2)
    return Outcome({"model": model}, {"ids": counts})


def unseeded_shuffle_refused(ctx: Context) -> Outcome:
    """Hvdtrain only: the script never seeds, and its pipeline shuffles without a seed before
    ``fit``, so every rank orders it differently and shards taken from it would overlap.
    ``hvdtrain.fit`` must refuse it on every rank in one line naming the fixes. (Today's
    behaviour, if it trains, is counted.)"""
    tf.random.set_seed(None)          # as in a script that never seeded anything
    counts = counter(301)
    model = _digit_classifier(ctx, counts)
    dataset = _digit_rows(301).shuffle(301)
    try:
        ctx.fit(model, dataset, batch_size=ctx.batch, epochs=2)
    except Exception as error:       # recorded for the test to judge
        from hvdtrain.errors import UserError

        return Outcome({}, notes={"refused": {"type": type(error).__name__,
                                              "message": str(error),
                                              "user_error": isinstance(error, UserError)}})
    return Outcome({"model": model}, {"ids": counts}, notes={"refused": None})


def dataset_function(ctx: Context) -> Outcome:
    """The fix: ``hvdtrain.fit(model, x=make_dataset)`` builds the pipeline (an unseeded
    shuffle) inside the run, with rank 0's random state on every rank. The drop-in user
    shards before the unseeded shuffle instead; one process calls ``make_dataset()``. Orders
    are random, so losses are compared within 10%."""
    tf.random.set_seed(None)
    counts = counter(301)
    model = _digit_classifier(ctx, counts)

    def make_dataset() -> tf.data.Dataset:
        return ctx.shard_dataset(_digit_rows(301)).shuffle(301)

    ctx.fit(model, make_dataset, batch_size=ctx.batch, epochs=2)
    return Outcome({"model": model}, {"ids": counts})


# --- 10. Dict inputs with sample weights --------------------------------------------------

def dict_inputs_sample_weights(ctx: Context) -> Outcome:
    """Structured data as a dict of named columns (numbers, and a sector code through an
    ``IntegerLookup`` with an OOV bucket), per-example sample weights for training and
    validation, arrays: 331 training rows (166 and 165 per rank, 11 batches each), 61 validation
    rows."""
    rng = np.random.default_rng(112)
    n = 331 + 61
    sector = rng.integers(1, 5, n).astype(np.int64)
    age = rng.normal(45, 10, n).astype(np.float32)
    hours = rng.normal(38, 6, n).astype(np.float32)
    label = (((age - 45) / 10 + (hours - 38) / 6 + (sector == 3) * 1.0
              + rng.normal(0, 0.5, n)) > 0.3).astype(np.float32)
    weights = np.where(sector == 1, 2.0, 1.0).astype(np.float32)
    keras.utils.set_random_seed(113)
    counts = counter(VAL_IDS + 61)
    inputs = {"age": keras.Input((1,), name="age"), "hours": keras.Input((1,), name="hours"),
              "sector": keras.Input((1,), dtype="int64", name="sector"),
              "example_id": example_id_input()}
    lookup = keras.layers.IntegerLookup(vocabulary=[1, 2, 3, 4], output_mode="one_hot")
    joined = keras.layers.Concatenate()([
        keras.layers.Normalization(mean=45.0, variance=100.0)(inputs["age"]),
        keras.layers.Normalization(mean=38.0, variance=36.0)(inputs["hours"]),
        keras.layers.Flatten()(lookup(inputs["sector"]))])
    output = keras.layers.Dense(1, activation="sigmoid", name="label")(
        keras.layers.Dense(16, activation="relu")(joined))
    model = keras.Model(inputs, {"label": output, "ids": echoed(inputs["example_id"])})
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.01)),
                  loss={"label": "binary_crossentropy"},
                  metrics={"label": ["accuracy"], "ids": [SeenIds(counts)]},
                  weighted_metrics={"label": ["accuracy"]})

    def columns(rows: slice, first_id: int) -> tuple[dict, dict, np.ndarray]:
        count = len(age[rows])
        x = {"age": age[rows, None], "hours": hours[rows, None], "sector": sector[rows, None],
             "example_id": ids(first_id, count)}
        return x, {"label": label[rows], "ids": ids(first_id, count)}, weights[rows]

    x_train, y_train, w_train = ctx.shard(*columns(slice(0, 331), 0))
    validation = columns(slice(331, n), VAL_IDS)
    ctx.fit(model, x_train, y_train, sample_weight=w_train, batch_size=ctx.batch, epochs=2,
            shuffle=False, validation_data=validation)
    return Outcome({"model": model}, {"ids": counts})


# --- 11. A pre-batched pipeline -------------------------------------------------------------

def prebatched_pipeline(ctx: Context) -> Outcome:
    """A user batches (and prefetches) the pipeline and passes no ``batch_size``: 149 digits in
    batches of 16 per rank are 10 batches, 5 per rank, the last of 5 rows (one process: 5
    batches of 32, the last of 21). Rank 0's log must state the real global batch, 32."""
    keras.utils.set_random_seed(114)
    counts = counter(149)
    model = _digit_classifier(ctx, counts, rate=0.1)
    dataset = ctx.shard_dataset(_digit_rows(149).map(
        lambda x, y: ({"image": x["image"] * 2.0 - 1.0, "example_id": x["example_id"]}, y)
    ).batch(ctx.batch)).prefetch(tf.data.AUTOTUNE)
    ctx.fit(model, dataset, epochs=2)
    return Outcome({"model": model}, {"ids": counts})


# --- 12. Text classification with TextVectorization in the pipeline ------------------------

def _reviews(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(115)
    praise = ["gripping", "moving", "witty", "tender", "sharp", "rich"]
    scorn = ["tedious", "clumsy", "hollow", "stale", "muddled", "flat"]
    common = ["the", "story", "cast", "score", "was", "felt", "oddly", "often", "ending"]
    texts, labels = [], []
    for _ in range(n):
        liked = rng.random() < 0.5
        words = list(rng.choice(common, 7)) + list(rng.choice(praise if liked else scorn, 2))
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels.append(float(liked))
    return np.array(texts), np.array(labels, np.float32)


def text_classification(ctx: Context) -> Outcome:
    """The keras-io text-classification shape: a ``TextVectorization`` layer adapted on the
    training texts, applied in the pipeline (``dataset.map``) after batching, and a small
    convolutional model on the token ids: 480 reviews, 160 for validation."""
    texts, labels = _reviews(640)
    keras.utils.set_random_seed(116)
    vectorize = keras.layers.TextVectorization(max_tokens=64, output_mode="int",
                                               output_sequence_length=10)
    vectorize.adapt(texts[:480])

    def pipeline(rows: slice) -> tf.data.Dataset:
        dataset = tf.data.Dataset.from_tensor_slices((texts[rows], labels[rows]))
        return dataset.batch(ctx.batch).map(lambda text, label: (vectorize(text), label))

    tokens = keras.Input((10,), dtype="int64")
    hidden = keras.layers.Embedding(64, 12)(tokens)
    hidden = keras.layers.Conv1D(12, 3, activation="relu")(hidden)
    hidden = keras.layers.GlobalMaxPooling1D()(hidden)
    model = keras.Model(tokens, keras.layers.Dense(1, activation="sigmoid")(hidden))
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.01)),
                  loss="binary_crossentropy", metrics=["accuracy"])
    ctx.fit(model, ctx.shard_dataset(pipeline(slice(0, 480))),
            validation_data=pipeline(slice(480, 640)), epochs=2)
    return Outcome({"model": model})


# --- 13. Structured data through FeatureSpace ---------------------------------------------

def feature_space(ctx: Context) -> Outcome:
    """The keras-io FeatureSpace shape: named columns (an integer code, a string category with
    ``num_oov_indices=0``, two numbers), a ``FeatureSpace`` adapted on the features and
    applied in the pipeline after batching: 320 patients."""
    rng = np.random.default_rng(117)
    n = 400
    columns = {"smoker": rng.integers(0, 2, n).astype(np.int64),
               "region": rng.choice(["north", "south", "east", "west"], n),
               "age": rng.normal(50, 9, n).astype(np.float32),
               "pressure": rng.normal(130, 15, n).astype(np.float32)}
    label = ((columns["smoker"] * 0.8 + (columns["age"] - 50) / 9
              + (columns["pressure"] - 130) / 15 + (columns["region"] == "east") * 0.6
              + rng.normal(0, 0.5, n)) > 0.7).astype(np.float32)
    space = keras.utils.FeatureSpace(
        features={"smoker": keras.utils.FeatureSpace.integer_categorical(num_oov_indices=0),
                  "region": keras.utils.FeatureSpace.string_categorical(num_oov_indices=0),
                  "age": keras.utils.FeatureSpace.float_normalized(),
                  "pressure": keras.utils.FeatureSpace.float_normalized()},
        output_mode="concat")
    train_rows = {name: values[:320] for name, values in columns.items()}
    space.adapt(tf.data.Dataset.from_tensor_slices(train_rows).batch(320))
    keras.utils.set_random_seed(118)

    def pipeline(rows: slice) -> tf.data.Dataset:
        dataset = tf.data.Dataset.from_tensor_slices(
            ({name: values[rows] for name, values in columns.items()}, label[rows]))
        return dataset.batch(ctx.batch).map(lambda x, y: (space(x), y))

    encoded = keras.Input((space.get_encoded_features().shape[-1],))
    hidden = keras.layers.Dense(16, activation="relu")(encoded)
    model = keras.Model(encoded, keras.layers.Dense(1, activation="sigmoid")(hidden))
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.01)),
                  loss="binary_crossentropy", metrics=["accuracy"])
    ctx.fit(model, ctx.shard_dataset(pipeline(slice(0, 320))), epochs=2)
    return Outcome({"model": model})
