"""Users' own workloads, as a user would write them: model builders (``--model workloads:fn``)
and data functions (``--dataset workloads:fn``), imported by the ranks from tests/ on
PYTHONPATH. Everything is seeded so runs can be compared number for number."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import hvdtrain


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images / 16.0).astype(np.float32)[..., None], bunch.target.astype(np.int64)


# --- regression: the MirroredStrategy docs' model shape, compiled with loss="mse" -------------

def regression_data() -> hvdtrain.Arrays:
    """y = x . w + noise, float targets; 700 training examples (not a multiple of 32)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((900, 5)).astype(np.float32)
    y = (x @ rng.standard_normal((5, 1)) + 0.1 * rng.standard_normal((900, 1))).astype(np.float32)
    return hvdtrain.Arrays(x=x[:700], y=y[:700], x_val=x[700:], y_val=y[700:])


def regression_model(input_shape, num_classes) -> keras.Model:
    assert num_classes is None, "float targets are not class ids"
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def regression_model_xla(input_shape, num_classes) -> keras.Model:
    """``regression_model`` compiled with ``jit_compile=True`` (XLA, also on a CPU)."""
    model = regression_model(input_shape, num_classes)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"], jit_compile=True)
    return model


# --- the common Keras idiom: logits out, from_logits=True ----------------------------------------

def logits_model(input_shape, num_classes) -> keras.Model:
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                              keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(num_classes)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def uncompiled_logits_model(input_shape, num_classes) -> keras.Model:
    """A logits model left uncompiled: the default loss expects probabilities."""
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(num_classes)])


# --- binary classification scored by AUC and Precision -------------------------------------------

def even_digits() -> hvdtrain.Arrays:
    """Is the digit even? Float 0/1 targets, fixed split."""
    x, y = _digits()
    even = (y % 2 == 0).astype(np.float32)[:, None]
    return hvdtrain.Arrays(x=x[:1400], y=even[:1400], x_val=x[1400:], y_val=even[1400:])


def auc_model(input_shape, num_classes) -> keras.Model:
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc"),
                                                       keras.metrics.Precision(name="precision")])
    return model


# --- two inputs (dict features), two outputs (dict losses, loss_weights, sample weights) ---------

def two_tower_data() -> hvdtrain.Arrays:
    x, y = _digits()
    rng = np.random.default_rng(3)
    extra = rng.standard_normal((len(x), 3)).astype(np.float32)
    ink = x.reshape(len(x), -1).mean(axis=1, keepdims=True).astype(np.float32)
    weights = np.where(y < 5, 1.0, 2.0).astype(np.float32)
    features = {"image": x, "extra": extra}
    targets = {"digit": y, "ink": ink + 0.1 * extra[:, :1]}
    return hvdtrain.Arrays(x=features, y=targets, sample_weight=weights)


def two_tower_model(input_shape, num_classes) -> keras.Model:
    image = keras.Input(input_shape["image"], name="image")
    extra = keras.Input(input_shape["extra"], name="extra")
    hidden = keras.layers.Dense(64, activation="relu")(keras.layers.Flatten()(image))
    joined = keras.layers.Concatenate()([hidden, extra])
    digit = keras.layers.Dense(10, activation="softmax", name="digit")(joined)
    ink = keras.layers.Dense(1, name="ink")(joined)
    model = keras.Model({"image": image, "extra": extra}, {"digit": digit, "ink": ink})
    model.compile(loss={"digit": "sparse_categorical_crossentropy", "ink": "mse"},
                  loss_weights={"digit": 1.0, "ink": 0.5},
                  metrics={"digit": ["accuracy"], "ink": ["mae"]})
    return model


# --- a user tf.data pipeline whose ranks hold different numbers of records -----------------------

def uneven_pipeline() -> hvdtrain.Pipeline:
    """Rank r reads its own part of the digits; rank 0's part is larger, so its pipeline yields
    more batches than rank 1's: hvdtrain must even the steps out."""
    x, y = _digits()

    def train(shard: hvdtrain.Shard) -> tf.data.Dataset:
        cut = 1000 if shard.size > 1 else len(x) - 300
        rows = np.arange(0, cut) if shard.rank == 0 else np.arange(cut, len(x) - 300)
        dataset = tf.data.Dataset.from_tensor_slices((x[rows], y[rows]))
        dataset = dataset.shuffle(len(rows), seed=shard.seed + shard.epoch)
        return dataset.batch(shard.batch_size)

    def val(shard: hvdtrain.Shard) -> tf.data.Dataset:
        held = np.arange(len(x) - 300, len(x))[shard.rank::shard.size]
        return tf.data.Dataset.from_tensor_slices((x[held], y[held])).batch(shard.batch_size)

    return hvdtrain.Pipeline(train=train, val=val, num_classes=10)


def early_stop_callbacks() -> list[keras.callbacks.Callback]:
    """A user's callbacks: stop once validation accuracy passes 0.5 (every rank decides alike:
    the logs hold the exact global metrics)."""
    class StopWhenGood(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if logs["val_accuracy"] > 0.5:
                self.model.stop_training = True

    return [StopWhenGood()]


def adamw(learning_rate) -> keras.optimizers.Optimizer:
    """A user's optimizer factory: receives hvdtrain's scaled, warmed-up schedule."""
    return keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=1e-4)


class WarmUpCosine(keras.optimizers.schedules.LearningRateSchedule):
    """A user's rate schedule as the Keras examples write it: a linear warm-up to ``base`` over
    ``warmup_steps``, then a cosine decay to 0 at ``total_steps``; no ``get_config``, so an
    optimizer that holds it cannot be rebuilt from its config."""

    def __init__(self, base: float, total_steps: int, warmup_steps: int) -> None:
        super().__init__()
        self.base, self.total_steps, self.warmup_steps = base, total_steps, warmup_steps

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        warm = self.base * (step + 1.0) / self.warmup_steps
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        cosine = 0.5 * self.base * (1.0 + tf.cos(np.pi * progress))
        return tf.where(step < self.warmup_steps, warm, cosine)


def _sleep_after_each_step(seconds: float) -> keras.callbacks.Callback:
    import time

    return keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: time.sleep(seconds))


def slow_steps() -> list[keras.callbacks.Callback]:
    """A user's callback that makes every step 50 ms longer (timing, not the math): a job a test
    interrupts on the TensorFlow backend, whose steps HOROVOD_CYCLE_TIME does not slow, is
    still running when the signal comes."""
    return [_sleep_after_each_step(0.05)]


def slow_first_slurm_allocation() -> list[keras.callbacks.Callback]:
    """A user's callback that makes every step 1 s longer (timing, not the math) in a Slurm
    job's first allocation only (``SLURM_RESTART_COUNT`` unset or 0): its training then outlasts
    the time-limit warning on any machine, and the allocation after the requeue trains at full
    speed."""
    import os

    if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
        return []
    return [_sleep_after_each_step(1.0)]


def leave_mid_epoch() -> list[keras.callbacks.Callback]:
    """A user's callback that, once, at the second step of the second epoch, rewrites the host
    discovery file ``HVDTRAIN_TEST_HOSTS`` to one slot and then slows that epoch's steps by
    0.1 s: the elastic driver sees one slot leave while most of the epoch is still ahead, so
    the world changes at a mid-epoch commit however fast the machine trains. It also fails the
    run if its epoch logs hold a column of hvdtrain's own (they must stay Keras')."""
    import os
    import time
    from pathlib import Path

    hosts = Path(os.environ["HVDTRAIN_TEST_HOSTS"])
    done = hosts.with_suffix(".left")

    def on_batch_end(batch, logs):
        if epoch_now[0] != 1:
            return
        if batch == 1 and not done.exists():
            done.touch()
            hosts.write_text("localhost:1\n")
        time.sleep(0.1)

    def on_epoch_end(epoch, logs):
        added = {"lr", "examples_per_second", "world_size"} & set(logs)
        if added:
            raise AssertionError(f"hvdtrain's own columns in the user's logs: {sorted(added)}")

    epoch_now = [0]
    return [keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: epoch_now.__setitem__(0, epoch),
        on_train_batch_end=on_batch_end, on_epoch_end=on_epoch_end)]
