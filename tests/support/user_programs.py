"""Small Keras 3 programs of the kinds users write (modelled on the keras-io guides: a custom
``train_step``, a GAN, a VAE here; preprocessing layers with ``adapt()``, a text classifier with
a Transformer block, an LSTM on a windowed time series, a convnet with Keras callbacks and
``class_weight``, a user's own ``tf.data`` pipeline in ``user_data_programs``), written here on
offline data. ``PROGRAMS`` is the user-program set.

Each program is a function ``program(ctx) -> Outcome`` of the program harness
(``programs.harness``): it builds its model and data and calls ``ctx.fit`` exactly as the user
calls ``model.fit``, with ``ctx.batch``. The harness runs each through ``hvdtrain.fit`` on 2
ranks and through plain ``model.fit`` in one process with twice the batch
(``test_user_programs.py`` compares them). Everything is seeded and built the same way in
both. The last three functions are ``--model`` and ``--dataset`` builders for the command line.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from programs.harness import Context, Outcome, Spec, digits
from user_data_programs import (convnet_callbacks, keras_arguments, lstm_timeseries,
                                preprocessing, py_dataset, regularised_regression,
                                text_transformer, user_dataset)


def _steps() -> tf.Variable:
    """A counter of a model's own ``train_step`` calls."""
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


def custom_train_step(ctx: Context) -> Outcome:
    x, y = digits()
    keras.utils.set_random_seed(1)
    steps = _steps()
    model = CustomStepModel(steps)
    model(x[:1])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    ctx.fit(model, x[:1280], y[:1280], batch_size=ctx.batch, epochs=3, shuffle=False,
            validation_data=(x[1280:], y[1280:]))
    return Outcome({"model": model}, own_steps=steps)


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


def _gan(image_shape: tuple[int, ...], steps: tf.Variable) -> GAN:
    """The GAN for images of ``image_shape``, compiled."""
    latent = 8
    discriminator = keras.Sequential([keras.Input(image_shape), keras.layers.Flatten(),
                                      keras.layers.Dense(32), keras.layers.LeakyReLU(0.2),
                                      keras.layers.Dense(1, activation="sigmoid")],
                                     name="discriminator")
    generator = keras.Sequential([keras.Input((latent,)), keras.layers.Dense(32),
                                  keras.layers.LeakyReLU(0.2),
                                  keras.layers.Dense(int(np.prod(image_shape)),
                                                     activation="sigmoid"),
                                  keras.layers.Reshape(image_shape)], name="generator")
    model = GAN(discriminator, generator, latent, steps)
    model.compile(d_optimizer=keras.optimizers.Adam(0.001),
                  g_optimizer=keras.optimizers.Adam(0.001),
                  loss_fn=keras.losses.BinaryCrossentropy())
    return model


def gan(ctx: Context) -> Outcome:
    x, _ = digits()
    keras.utils.set_random_seed(2)
    steps = _steps()
    model = _gan((8, 8, 1), steps)
    dataset = tf.data.Dataset.from_tensor_slices(x[:1280]).batch(ctx.batch)
    ctx.fit(model, dataset, batch_size=ctx.batch, epochs=3)
    return Outcome({"model": model}, own_steps=steps)


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


def vae(ctx: Context) -> Outcome:
    x, _ = digits()
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
    steps = _steps()
    model = VAE(encoder, decoder, steps)
    model.compile(optimizer=keras.optimizers.Adam(0.005))
    ctx.fit(model, x[:1280], batch_size=ctx.batch, epochs=3, shuffle=False)
    return Outcome({"model": model}, own_steps=steps)


def _user(build, exact: bool = True, loss_tolerance: float = 0.0) -> Spec:
    """A user program's ``Spec``: hvdtrain and one process (it shards nothing itself), 32
    examples per rank, gradients in buckets of 1,049 bytes (``bucket_mib``): every program's,
    its own ``train_step``'s included, travel in several allreduces (the default, 4 MiB, one
    bucket for models this small, is the path of every other exactness test). Deterministic
    programs within 1e-5 of one process; the others' losses within ``loss_tolerance``."""
    return Spec(build, ("hvdtrain", "keras"), "drop-in: a user program shards nothing itself",
                batch=32, options={"bucket_mib": 0.001}, tolerance=1e-5 if exact else None,
                dropin_tolerance=None, loss_tolerance=loss_tolerance)


PROGRAMS: dict[str, Spec] = {
    "custom_train_step": _user(custom_train_step),
    # Noise drawn per rank (the user seeded one generator): close, not equal.
    "gan": _user(gan, exact=False, loss_tolerance=0.1),
    "vae": _user(vae, exact=False, loss_tolerance=0.1),
    "preprocessing": _user(preprocessing),
    "text_transformer": _user(text_transformer),
    "lstm_timeseries": _user(lstm_timeseries),
    "convnet_callbacks": _user(convnet_callbacks),
    # A dataset that reshuffles each pass: hvdtrain's passes take other orders.
    "user_dataset": _user(user_dataset, exact=False, loss_tolerance=0.05),
    "regularised_regression": _user(regularised_regression),
    "keras_arguments": _user(keras_arguments),
    "py_dataset": _user(py_dataset),
}


# --- The command line's builders: --model user_programs:gan_model, --dataset ...:digit_images -

def gan_model(input_shape, num_classes) -> keras.Model:
    """``--model`` builder: the GAN of program 2, compiled, for images of ``input_shape``."""
    return _gan(tuple(input_shape), _steps())


def digit_images() -> np.ndarray:
    """``--dataset`` function: images alone (a GAN has no targets)."""
    return digits()[0][:1024]


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
