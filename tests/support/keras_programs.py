"""Short Keras programs of the shapes issue 27 found in real use, written here in the style of
the keras-io examples on offline data (sklearn's digits, synthetic NumPy data): a second model
built after a first ``fit`` (and random draws after it), a warm-up cosine
``LearningRateSchedule`` without ``get_config``, distillation (a ``Distiller`` with its own
``compile`` and ``train_step``), image augmentation layers, ``class_weight`` on imbalanced data,
two outputs with ``validation_split``, random draws during ``fit``; the input-pipeline shapes
are in ``keras_pipelines``. ``PROGRAMS`` is all of issue 27's with their ``Spec``.

Programs of the harness (``programs.harness``: ``Context``, ``Outcome``, ``Spec``, the modes,
the example counters).
"""

from __future__ import annotations

import math
import random

import keras
import numpy as np
import tensorflow as tf

from keras_pipelines import (dataset_function, dict_inputs_sample_weights, feature_space,
                             lookup_uneven_batches, prebatched_pipeline, seeded_shuffle,
                             steps_beyond_the_data, text_classification,
                             timeseries_uneven_validation, unseeded_shuffle_refused)
from programs.harness import Context, Outcome, Spec, counter, digits, ids


# --- 7. A second model built after a first fit; random draws after fit -----------------------

def _mlp(ctx: Context, rate: float) -> keras.Model:
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(24, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=ctx.optimizer(keras.optimizers.SGD(rate)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def second_model_after_fit(ctx: Context) -> Outcome:
    """A notebook's shape: seed once, train a model, draw from every random generator, then
    build a second model (its initial weights come from Keras' global random state) and train
    it. Everything after the first ``fit`` must be as in one process."""
    x, y = digits()
    keras.utils.set_random_seed(109)
    first = _mlp(ctx, 0.1)
    x_train, y_train = ctx.shard(x[:320], y[:320])
    ctx.fit(first, x_train, y_train, batch_size=ctx.batch, epochs=2, shuffle=False)
    draws = {"random": random.random(), "numpy": float(np.random.random()),
             "tensorflow": float(tf.random.uniform(())),
             "keras": float(keras.random.uniform(()))}
    second = _mlp(ctx, 0.05)
    initial = [w.tolist() for w in second.get_weights()]
    ctx.fit(second, x_train, y_train, batch_size=ctx.batch, epochs=1, shuffle=False)
    return Outcome({"first": first, "second": second},
                   notes={"draws": draws, "second_initial": initial})


# --- 8. A warm-up cosine schedule class without get_config ---------------------------------

class WarmUpCosine(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up to ``peak`` over ``warmup`` steps, then a cosine decay to 0 at ``total``
    (no ``get_config``: the model is never saved, as in many examples)."""

    def __init__(self, peak: float, warmup: int, total: int) -> None:
        super().__init__()
        self.peak, self.warmup, self.total = peak, warmup, total

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        warm = self.peak * step / self.warmup
        progress = (step - self.warmup) / float(self.total - self.warmup)
        cosine = 0.5 * self.peak * (1.0 + tf.cos(np.pi * tf.minimum(progress, 1.0)))
        return tf.where(step < self.warmup, warm, cosine)


def warmup_cosine_schedule(ctx: Context) -> Outcome:
    """Image classification with AdamW following ``WarmUpCosine`` over the run's steps
    (computed from the example count and the global batch, as examples do)."""
    x, y = digits()
    keras.utils.set_random_seed(110)
    epochs, examples = 2, 640
    total = epochs * examples // (ctx.batch * ctx.size)
    schedule = WarmUpCosine(0.01, total // 4, total)
    optimizer = keras.optimizers.AdamW(learning_rate=schedule, weight_decay=1e-4)
    distributed = ctx.optimizer(optimizer)
    model = keras.Sequential([keras.Input((8, 8, 1)),
                              keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=distributed, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    x_train, y_train = ctx.shard(x[:examples], y[:examples])
    ctx.fit(model, x_train, y_train, batch_size=ctx.batch, epochs=epochs, shuffle=False)
    return Outcome({"model": model}, notes={
        "user_optimizer_kept": distributed is optimizer,
        "final_rate": float(schedule(model.optimizer.iterations)),
        "iterations": int(model.optimizer.iterations.numpy())})


# --- 9. Distillation: a Distiller with its own compile() and train_step ----------------------

class Distiller(keras.Model):
    """A student learns from a teacher's softened predictions and from the labels; the batch's
    ``example_id`` is counted by the step (it trains on every example it is given)."""

    def __init__(self, student: keras.Model, teacher: keras.Model, seen: tf.Variable,
                 steps: tf.Variable) -> None:
        super().__init__()
        self.student, self.teacher = student, teacher
        self._seen, self._steps = [seen], [steps]
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.student_loss_tracker = keras.metrics.Mean(name="student_loss")
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")

    def compile(self, optimizer, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3.0):
        super().compile(optimizer=optimizer)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha, self.temperature = alpha, temperature

    @property
    def metrics(self):
        return [self.loss_tracker, self.student_loss_tracker, self.accuracy]

    def call(self, x):
        return self.student(x["image"])

    def train_step(self, data):
        x, y = data
        self._steps[0].assign_add(1)
        example = tf.cast(x["example_id"], tf.int64)
        self._seen[0].scatter_nd_add(example[:, None], tf.ones_like(example))
        teacher_logits = self.teacher(x["image"], training=False)
        with tf.GradientTape() as tape:
            student_logits = self.student(x["image"], training=True)
            student_loss = self.student_loss_fn(y, student_logits)
            distillation_loss = self.distillation_loss_fn(
                tf.nn.softmax(teacher_logits / self.temperature, axis=1),
                tf.nn.softmax(student_logits / self.temperature, axis=1)
            ) * self.temperature ** 2
            loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        gradients = tape.gradient(loss, self.student.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.student.trainable_variables))
        self.loss_tracker.update_state(loss)
        self.student_loss_tracker.update_state(student_loss)
        self.accuracy.update_state(y, student_logits)
        return {m.name: m.result() for m in self.metrics}


def distillation(ctx: Context) -> Outcome:
    """A linear teacher fitted by least squares (no training run needed) teaches a small
    student: 512 examples, 2 epochs."""
    x, y = digits()
    flat = x.reshape(len(x), -1)
    design = np.concatenate([flat, np.ones((len(x), 1), np.float32)], axis=1)
    solution = np.linalg.lstsq(design[:1000], np.eye(10, dtype=np.float32)[y[:1000]] * 4,
                               rcond=None)[0].astype(np.float32)
    teacher = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                keras.layers.Dense(10)], name="teacher")
    teacher.set_weights([solution[:-1], solution[-1]])
    keras.utils.set_random_seed(111)
    student = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                keras.layers.Dense(16, activation="relu"),
                                keras.layers.Dense(10)], name="student")
    seen, steps = counter(512), tf.Variable(0, dtype=tf.int64, trainable=False)
    distiller = Distiller(student, teacher, seen, steps)
    distiller.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.005)),
                      student_loss_fn=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True),
                      distillation_loss_fn=keras.losses.KLDivergence(),
                      alpha=0.2, temperature=4.0)
    x_train = {"image": x[:512], "example_id": ids(0, 512)}
    x_train, y_train = ctx.shard(x_train, y[:512])
    ctx.fit(distiller, x_train, y_train, batch_size=ctx.batch, epochs=2, shuffle=False)
    return Outcome({"student": student}, {"ids": seen}, own_steps=steps)


# --- 14. Image classification with augmentation layers ------------------------------------

def augmented_images(ctx: Context) -> Outcome:
    """The keras-io image-classification shape: random flips and rotations as the model's first
    layers (active in training only), a small convnet, a checkpoint of the model after every
    epoch and a CSV log: 320 digits, 3 epochs. The augmentation draws at random on every rank,
    so losses are compared within a stated tolerance."""
    x, y = digits()
    keras.utils.set_random_seed(119)
    augmentation = keras.Sequential([keras.layers.RandomFlip("horizontal"),
                                     keras.layers.RandomRotation(0.05)])
    inputs = keras.Input((8, 8, 1))
    hidden = keras.layers.Conv2D(16, 3, activation="relu")(augmentation(inputs))
    hidden = keras.layers.Flatten()(hidden)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.005)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x_train, y_train = ctx.shard(x[:320], y[:320])
    callbacks = ctx.writers(
        keras.callbacks.ModelCheckpoint(str(ctx.directory / "save_at_{epoch}.keras")),
        keras.callbacks.CSVLogger(str(ctx.directory / "log.csv")))
    ctx.fit(model, x_train, y_train, batch_size=ctx.batch, epochs=3, callbacks=callbacks)
    return Outcome({"model": model})


# --- 15. class_weight on imbalanced data ------------------------------------------------

def imbalanced_class_weight(ctx: Context) -> Outcome:
    """The keras-io fraud-detection shape: about 6% positives, ``class_weight`` of one over each
    class's count, confusion counts, precision and recall: 640 transactions."""
    rng = np.random.default_rng(120)
    n = 640
    x = rng.normal(size=(n, 12)).astype(np.float32)
    score = x[:, 0] * 1.5 + x[:, 1] - x[:, 2] * 0.5
    y = (score + rng.normal(0, 0.5, n) > 3.0).astype(np.int64)
    negatives, positives = np.bincount(y[:640], minlength=2)
    keras.utils.set_random_seed(121)
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.01)),
                  loss="binary_crossentropy",
                  metrics=[keras.metrics.FalseNegatives(name="fn"),
                           keras.metrics.FalsePositives(name="fp"),
                           keras.metrics.Precision(name="precision"),
                           keras.metrics.Recall(name="recall")])
    x_train, y_train = ctx.shard(x[:640], y[:640])
    ctx.fit(model, x_train, y_train, batch_size=ctx.batch, epochs=2, shuffle=False,
            class_weight={0: 1.0 / negatives, 1: 1.0 / positives})
    return Outcome({"model": model}, notes={"positives": int(positives)})


# --- 16. Two outputs, each with its loss, and validation_split ------------------------------

def two_losses_validation_split(ctx: Context) -> Outcome:
    """The keras-io functional-API shape with a classification and a regression head, a loss
    and a loss weight each, per-output metrics and ``validation_split=0.2`` of 177 rows (Keras
    keeps 141 and holds out 36: short last batches in training and validation). Keras 3's
    per-output columns (``cls_loss``) are plain means of batch means, so they depend on how
    the rows fall into batches."""
    rng = np.random.default_rng(116)
    x = rng.random((177, 6), dtype=np.float32)
    y = {"cls": (x.sum(axis=1) > 3).astype(np.int32), "reg": x[:, :2].sum(axis=1, keepdims=True)}
    keras.utils.set_random_seed(117)
    features = keras.Input((6,), name="features")
    hidden = keras.layers.Dense(12, activation="relu")(features)
    model = keras.Model(features, {"cls": keras.layers.Dense(2, name="cls")(hidden),
                                   "reg": keras.layers.Dense(1, name="reg")(hidden)})
    model.compile(optimizer=ctx.optimizer(keras.optimizers.SGD(0.05)),
                  loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        "reg": "mse"},
                  loss_weights={"cls": 1.0, "reg": 0.5},
                  metrics={"cls": ["accuracy"], "reg": ["mae"]})
    ctx.fit(model, {"features": x}, y, batch_size=ctx.batch, epochs=2, shuffle=False,
            validation_split=0.2)
    return Outcome({"model": model})


# --- 17. Random draws during fit: a user's callback, and Keras' shuffle of a PyDataset -------

def _draw_every_generator() -> list[float]:
    return [random.random(), float(np.random.rand()), float(tf.random.uniform(())),
            float(keras.random.uniform(()))]


class EpochEndDraws(keras.callbacks.Callback):
    """A user's callback drawing from Python's, NumPy's, TensorFlow's and Keras' generators at
    every epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[list[float]] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.draws.append(_draw_every_generator())


class RowBatches(keras.utils.PyDataset):
    """Rows in batches of ``batch``, in order (Keras shuffles the batch indices each epoch
    with Python's ``random.shuffle``)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int) -> None:
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self) -> int:
        return math.ceil(len(self.x) / self.batch)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rows = slice(index * self.batch, (index + 1) * self.batch)
        return self.x[rows], self.y[rows]


def random_draws_during_fit(ctx: Context) -> Outcome:
    """A script that seeds once, trains a model with dropout on a shuffled ``PyDataset`` for 3
    epochs with a callback drawing from every generator at each epoch's end, then draws again
    after ``fit``. The draws must be one process's, on every rank."""
    rng = np.random.default_rng(122)
    x = rng.random((128, 6), dtype=np.float32)
    y = x @ rng.random((6, 1), dtype=np.float32)
    keras.utils.set_random_seed(123)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(1)])
    model.compile(optimizer=ctx.optimizer(keras.optimizers.SGD(0.05)), loss="mse")
    callback = EpochEndDraws()
    ctx.fit(model, RowBatches(*ctx.shard(x, y), ctx.batch), epochs=3, shuffle=True,
            callbacks=[callback])
    return Outcome({"model": model},
                   notes={"draws": callback.draws, "after": _draw_every_generator()})


# The drop-in's loss with an odd example count: its last step averages two unequal batches'
# means (measured within 1.1% of one process); 2% stated.
UNEVEN_DROPIN = {"dropin_tolerance": None, "loss_tolerance": 0.02}

PROGRAMS: dict[str, Spec] = {
    "second_model_after_fit": Spec(second_model_after_fit),
    # hvdtrain orders the PyDataset's batches itself and dropout draws per rank: compared as
    # another shuffle of the same data (measured 14-21% off one process; the draws exactly).
    "random_draws_during_fit": Spec(
        random_draws_during_fit, ("hvdtrain", "keras"), tolerance=None, loss_tolerance=0.3,
        skipped="drop-in: each rank shuffles its own shard's batches (its loss measured 47% off "
                "one process in the third epoch); its draws are one process's too"),
    "warmup_cosine_schedule": Spec(warmup_cosine_schedule),
    "distillation": Spec(distillation, counted="once per epoch"),
    "dict_inputs_sample_weights": Spec(dict_inputs_sample_weights, counted="once per epoch",
                                       **UNEVEN_DROPIN),
    "prebatched_pipeline": Spec(prebatched_pipeline, counted="once per epoch",
                                **UNEVEN_DROPIN),
    "text_classification": Spec(text_classification),
    "feature_space": Spec(feature_space),
    # Random flips and rotations drawn per rank: the third epoch's loss measured 6-10% off
    # one process (and 8% apart across six one-process runs with other draws).
    "augmented_images": Spec(augmented_images, tolerance=None, dropin_tolerance=None,
                             loss_tolerance=0.25),
    "imbalanced_class_weight": Spec(imbalanced_class_weight, rank_averaged={
        "fn": "count", "fp": "count", "precision": "ratio", "recall": "ratio"}),
    "steps_beyond_the_data": Spec(steps_beyond_the_data, counted="as one process",
                                  **UNEVEN_DROPIN),
    # Refused on every rank alike, before any step: the programs after it run in the same
    # processes, so they also show that the job's collectives stay usable (both backends).
    "unseeded_shuffle_refused": Spec(
        unseeded_shuffle_refused, ("hvdtrain",), counted="once per epoch",
        skipped="drop-in and one process: an unseeded shuffle is the user's own business "
                "there (the drop-in user shards before shuffling: dataset_function)"),
    # Seeded, so the same order on every rank; but hvdtrain reads the dataset before training
    # (the order check, the probe), on every rank alike, and each read draws the shuffle's next
    # seeded order: its epochs see later orders than one process's (README, "What every rank
    # is given"). Counted exactly; compared as another shuffle of the same data.
    "seeded_shuffle": Spec(seeded_shuffle, tolerance=None, dropin_tolerance=None,
                           loss_tolerance=0.05, counted="once per epoch"),
    # Unseeded shuffles: orders differ from run to run (measured: within 10%).
    "dataset_function": Spec(dataset_function, tolerance=None, dropin_tolerance=None,
                             loss_tolerance=0.15, counted="once per epoch"),
    "timeseries_uneven_validation": Spec(timeseries_uneven_validation,
                                         counted="once per epoch"),
    "two_losses_validation_split": Spec(
        two_losses_validation_split, ("hvdtrain", "keras"),
        skipped="drop-in: validation_split of each rank's shard holds out other rows than one "
                "process's"),
    "lookup_uneven_batches": Spec(
        lookup_uneven_batches, ("hvdtrain", "keras"), counted="once per epoch",
        skipped="drop-in: the user's dataset.shard gives 54 and 53 batches; Horovod ranks that "
                "run different step counts wait for each other forever (hvdtrain's point)"),
}
