"""Small Keras 3 programs of the kinds users write (modelled on the keras-io guides: a custom
``train_step``, a GAN, a VAE, preprocessing layers with ``adapt()``, a text classifier with a
Transformer block, an LSTM on a windowed time series, a convnet with Keras callbacks and
``class_weight``, a user's own ``tf.data`` pipeline), written here on offline data.

Each program is a function ``program(batch_size) -> Program``: the model, the data and the
``fit`` arguments, exactly as the user would hand them to ``model.fit``.
``user_program_ranks.py`` runs each through ``hvdtrain.fit`` on 2 ranks with ``batch_size``;
``test_user_programs.py`` runs each through plain ``model.fit`` in one process with twice that
batch and compares. Everything is seeded and built the same way in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf


@dataclass
class Program:
    model: keras.Model
    fit: dict[str, Any]                       # model.fit's arguments (x, y, epochs, ...)
    exact: bool = True                        # deterministic: compared to 1e-5 relative
    steps_counter: tf.Variable | None = None  # counts the model's own train_step calls
    notes: dict[str, Any] = field(default_factory=dict)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images / 16.0).astype(np.float32)[..., None], bunch.target.astype(np.int64)


def _counter() -> tf.Variable:
    return tf.Variable(0, dtype=tf.int64, trainable=False)


# --- 1. "Customizing what happens in fit": a model with its own train_step --------------------

class CustomStepModel(keras.Model):
    """The guide's pattern: forward, compute_loss, gradients, optimizer, compiled metrics; plus
    a counter of its own steps (the test checks the user's step ran)."""

    def __init__(self, counter: tf.Variable, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.counter = counter
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.out = keras.layers.Dense(10, activation="softmax")

    def call(self, x):
        return self.out(self.hidden(keras.ops.reshape(x, (-1, 64))))

    def train_step(self, data):
        x, y = data
        self.counter.assign_add(1)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def custom_train_step(batch_size: int) -> Program:
    x, y = _digits()
    keras.utils.set_random_seed(1)
    counter = _counter()
    model = CustomStepModel(counter)
    model(x[:1])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return Program(model, {"x": x[:1280], "y": y[:1280], "epochs": 3, "shuffle": False,
                           "validation_data": (x[1280:], y[1280:])}, steps_counter=counter)


# --- 2. A GAN: two models, two optimizers, its own train_step, images without labels ---------

class GAN(keras.Model):
    def __init__(self, discriminator: keras.Model, generator: keras.Model, latent_dim: int,
                 counter: tf.Variable) -> None:
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.counter = counter
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        self.counter.assign_add(1)
        batch = tf.shape(real_images)[0]
        noise = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
        fake = self.generator(noise)
        images = tf.concat([fake, real_images], axis=0)
        labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(images))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        noise = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch, 1)),
                                  self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def gan(batch_size: int) -> Program:
    x, _ = _digits()
    keras.utils.set_random_seed(2)
    latent = 8
    discriminator = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                      keras.layers.Dense(32), keras.layers.LeakyReLU(0.2),
                                      keras.layers.Dense(1, activation="sigmoid")],
                                     name="discriminator")
    generator = keras.Sequential([keras.Input((latent,)), keras.layers.Dense(32),
                                  keras.layers.LeakyReLU(0.2),
                                  keras.layers.Dense(64, activation="sigmoid"),
                                  keras.layers.Reshape((8, 8, 1))], name="generator")
    counter = _counter()
    model = GAN(discriminator, generator, latent, counter)
    model.compile(d_optimizer=keras.optimizers.Adam(0.001),
                  g_optimizer=keras.optimizers.Adam(0.001),
                  loss_fn=keras.losses.BinaryCrossentropy())
    dataset = tf.data.Dataset.from_tensor_slices(x[:1280]).batch(batch_size)
    return Program(model, {"x": dataset, "epochs": 3}, exact=False, steps_counter=counter)


# --- 3. A VAE: its own train_step, loss trackers, a sampling layer, x alone ------------------

class Sampling(keras.layers.Layer):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, inputs):
        mean, log_var = inputs
        epsilon = keras.random.normal(tf.shape(mean), seed=self.seed_generator)
        return mean + tf.exp(0.5 * log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, encoder: keras.Model, decoder: keras.Model, counter: tf.Variable) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.counter = counter
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        self.counter.assign_add(1)
        with tf.GradientTape() as tape:
            mean, log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = tf.reduce_mean(tf.reduce_sum(
                keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl = -0.5 * (1 + log_var - tf.square(mean) - tf.exp(log_var))
            kl_loss = tf.reduce_mean(tf.reduce_sum(kl, axis=1))
            total = reconstruction_loss + kl_loss
        grads = tape.gradient(total, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {m.name: m.result() for m in self.metrics}


def vae(batch_size: int) -> Program:
    x, _ = _digits()
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 1))
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(inputs))
    mean = keras.layers.Dense(2)(hidden)
    log_var = keras.layers.Dense(2)(hidden)
    encoder = keras.Model(inputs, [mean, log_var, Sampling()([mean, log_var])], name="encoder")
    latent = keras.Input((2,))
    decoded = keras.layers.Dense(64, activation="sigmoid")(
        keras.layers.Dense(32, activation="relu")(latent))
    decoder = keras.Model(latent, keras.layers.Reshape((8, 8, 1))(decoded), name="decoder")
    counter = _counter()
    model = VAE(encoder, decoder, counter)
    model.compile(optimizer=keras.optimizers.Adam(0.005))
    return Program(model, {"x": x[:1280], "epochs": 3, "shuffle": False}, exact=False,
                   steps_counter=counter)


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


def preprocessing(batch_size: int, rank: int = 0) -> Program:
    """``rank``: each rank adapts its lookups on its own sample of the data (hvdtrain must make
    every rank use rank 0's vocabulary, as the one-process reference, rank 0's sample, does)."""
    features, label = _tabular()
    keras.utils.set_random_seed(5)
    sample = np.random.default_rng(100 + rank).choice(768, 200, replace=False)
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
    return Program(model, {"x": train, "epochs": 3, "validation_data": val},
                   notes={"lookups": [city_lookup, plan_lookup]})


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


def text_transformer(batch_size: int) -> Program:
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
    return Program(model, {"x": train, "epochs": 3, "validation_data": val})


# --- 6. An LSTM on windows of a time series, from keras.utils.timeseries_dataset_from_array ---

def lstm_timeseries(batch_size: int) -> Program:
    rng = np.random.default_rng(9)
    t = np.arange(1200, dtype=np.float32)
    series = np.stack([np.sin(t / 20), np.cos(t / 33)], axis=1) + 0.05 * rng.standard_normal(
        (1200, 2)).astype(np.float32)
    window = 12
    targets = series[window:, 0]
    keras.utils.set_random_seed(10)
    train = keras.utils.timeseries_dataset_from_array(
        series[:960], targets[:960], sequence_length=window, batch_size=batch_size)
    val = keras.utils.timeseries_dataset_from_array(
        series[960:-window], targets[960:], sequence_length=window, batch_size=batch_size)
    model = keras.Sequential([keras.Input((None, 2)), keras.layers.LSTM(16),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return Program(model, {"x": train, "validation_data": val, "epochs": 3})


# --- 7. A convnet with Keras callbacks and class_weight --------------------------------------

def convnet_callbacks(batch_size: int) -> Program:
    x, y = _digits()
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((8, 8, 1)),
                              keras.layers.Conv2D(16, 3, activation="relu"),
                              keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    weights = {label: (2.0 if label < 5 else 1.0) for label in range(10)}
    return Program(model, {"x": x[:1280], "y": y[:1280], "epochs": 12, "shuffle": False,
                           "validation_data": (x[1280:], y[1280:]), "class_weight": weights,
                           "callbacks": "convnet"})


def convnet_callback_list(directory: str) -> list[keras.callbacks.Callback]:
    """The convnet's callbacks, made where the program runs (they hold paths)."""
    return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=0.005,
                                          restore_best_weights=True),
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0,
                                              min_delta=0.02),
            keras.callbacks.ModelCheckpoint(f"{directory}/best.keras", monitor="val_accuracy",
                                            save_best_only=True),
            keras.callbacks.CSVLogger(f"{directory}/log.csv"),
            keras.callbacks.TensorBoard(f"{directory}/tensorboard"),
            keras.callbacks.TerminateOnNaN()]


# --- 8. A user's own tf.data.Dataset, unbatched, odd-sized, shuffled every epoch --------------

def user_dataset(batch_size: int) -> Program:
    """Examples are counted per id (from 1) by ``keras_programs.SeenIds``, a compiled metric
    on an output that echoes the id: hvdtrain's step updates compiled metrics with real rows
    only, where a layer counting in the forward pass would also count the rows of the real
    batches that fill a rank running short."""
    from keras_programs import SeenIds, echoed, example_id_input

    x, y = _digits()
    keras.utils.set_random_seed(12)
    n = 1001                                  # odd: the ranks' shares differ by one example
    ids = np.arange(1, n + 1, dtype=np.int64)
    dataset = tf.data.Dataset.from_tensor_slices(
        ((x[:n], ids), {"digit": y[:n], "ids": ids})).shuffle(
        n, seed=3, reshuffle_each_iteration=True)
    counts = tf.Variable(tf.zeros([n + 1], tf.int64), trainable=False)
    image = keras.Input((8, 8, 1))
    example_id = example_id_input()
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(image))
    digit = keras.layers.Dense(10, activation="softmax", name="digit")(hidden)
    model = keras.Model([image, example_id], {"digit": digit, "ids": echoed(example_id)})
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss={"digit": "sparse_categorical_crossentropy"},
                  metrics={"digit": ["accuracy"], "ids": [SeenIds(counts)]})
    return Program(model, {"x": dataset, "epochs": 2}, exact=False,
                   notes={"examples": n, "counts": counts})


# --- 9. add_loss and regularisers: the reported loss includes model.losses ------------------

class ActivityPenalty(keras.layers.Layer):
    """The Keras guide's add_loss layer: a penalty on the mean activation of the batch."""

    def call(self, inputs):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.abs(inputs)))
        return inputs


def regularised_regression(batch_size: int) -> Program:
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
    return Program(model, {"x": x[:768], "y": y[:768], "epochs": 3, "shuffle": False,
                           "validation_data": (x[768:], y[768:])})


# --- 10. model.fit's own arguments on arrays --------------------------------------------------

def keras_arguments(batch_size: int) -> Program:
    """Binary labels of shape (N,) under a (N, 1) sigmoid output (Keras matches the ranks),
    sample weights, Keras' validation_split (the last quarter), validation every second epoch,
    a start at initial_epoch 1, and a LearningRateScheduler that halves the rate each epoch."""
    x, y = _digits()
    keras.utils.set_random_seed(15)
    odd = (y % 2).astype(np.float32)
    weights = np.where(y < 3, 2.0, 1.0).astype(np.float32)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="binary_crossentropy",
                  metrics=["accuracy"])
    return Program(model, {"x": x[:1280], "y": odd[:1280], "sample_weight": weights[:1280],
                           "validation_split": 0.25, "validation_freq": 2, "epochs": 4,
                           "initial_epoch": 1, "shuffle": False, "callbacks": "halving"})


def halving_callback_list(directory: str) -> list[keras.callbacks.Callback]:
    return [keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5)]


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


def py_dataset(batch_size: int) -> Program:
    x, y = _digits()
    keras.utils.set_random_seed(16)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return Program(model, {"x": DigitBatches(x[:1000], y[:1000], batch_size), "epochs": 2,
                           "shuffle": False,
                           "validation_data": DigitBatches(x[1000:], y[1000:], batch_size)})


PROGRAMS: dict[str, Callable[[int], Program]] = {
    "custom_train_step": custom_train_step,
    "gan": gan,
    "vae": vae,
    "preprocessing": preprocessing,
    "text_transformer": text_transformer,
    "lstm_timeseries": lstm_timeseries,
    "convnet_callbacks": convnet_callbacks,
    "user_dataset": user_dataset,
    "regularised_regression": regularised_regression,
    "keras_arguments": keras_arguments,
    "py_dataset": py_dataset,
}

# The callbacks a program names, made where it runs (they may hold paths).
CALLBACKS: dict[str, Callable[[str], list[keras.callbacks.Callback]]] = {
    "convnet": convnet_callback_list,
    "halving": halving_callback_list,
}


# --- The GAN through the command line: --model user_programs:gan_model, --dataset ...:images -

def gan_model(input_shape, num_classes) -> keras.Model:
    """``--model`` builder: the GAN of program 2, compiled, for images of ``input_shape``."""
    latent = 8
    discriminator = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                                      keras.layers.Dense(32), keras.layers.LeakyReLU(0.2),
                                      keras.layers.Dense(1, activation="sigmoid")],
                                     name="discriminator")
    generator = keras.Sequential([keras.Input((latent,)), keras.layers.Dense(32),
                                  keras.layers.LeakyReLU(0.2),
                                  keras.layers.Dense(int(np.prod(input_shape)),
                                                     activation="sigmoid"),
                                  keras.layers.Reshape(input_shape)], name="generator")
    model = GAN(discriminator, generator, latent, _counter())
    model.compile(d_optimizer=keras.optimizers.Adam(0.001),
                  g_optimizer=keras.optimizers.Adam(0.001),
                  loss_fn=keras.losses.BinaryCrossentropy())
    return model


def digit_images() -> np.ndarray:
    """``--dataset`` function: images alone (a GAN has no targets)."""
    return _digits()[0][:1024]


def dropout_mlp(input_shape, num_classes) -> keras.Model:
    """``--model`` builder: a compiled MLP with dropout (random draws that a checkpoint must
    carry for a resumed run to equal an uninterrupted one)."""
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dropout(0.3),
                              keras.layers.Dense(num_classes, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(0.005),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model
