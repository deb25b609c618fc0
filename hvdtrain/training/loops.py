"""The two training paths over the same ``StepMath``: Keras ``fit`` and a custom loop.

Both consume the same dataset (one element per step, every epoch back to back) and fire the same
callbacks at the same points, so the same config gives the same result on both. A run resumed
from a mid-epoch checkpoint starts ``done_steps`` into its first epoch: both skip those batches
of the dataset (the data plan is a function of seed and epoch, so the rest is what an
uninterrupted run would have seen) and number the remaining steps from ``done_steps``.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from hvdtrain.training.step import StepMath


class DataParallelModel(keras.Model):
    """Wraps the user's model so Keras ``fit`` runs hvdtrain's step instead of its own.

    XLA stays off: Horovod's collective ops have no XLA kernels in this build.
    """

    def __init__(self, inner: keras.Model, step: StepMath) -> None:
        super().__init__(name="data_parallel")
        self.inner = inner
        self.step_math = step

    def call(self, inputs, training=False):
        return self.inner(inputs, training=training)

    def train_step(self, data):
        return self.step_math.train_step(*data)


class ContinuedHooks(keras.callbacks.CallbackList):
    """The run's callbacks across the ``fit`` calls of one training: the first call trains the
    rest of a resumed epoch, whose steps ``fit`` numbers from 0, so batch numbers are shifted
    by ``offset`` there; train begin and end fire once for the whole training."""

    def __init__(self, callbacks: list[keras.callbacks.Callback], model: keras.Model) -> None:
        super().__init__(callbacks, add_history=True, add_progbar=False, model=model)
        self.offset = 0
        self.fit_calls_left = 1
        self.begun = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.begun:
            self.begun = True
            super().on_train_begin(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        self.fit_calls_left -= 1
        if not self.fit_calls_left:
            super().on_train_end(logs)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        super().on_train_batch_begin(batch + self.offset, logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        super().on_train_batch_end(batch + self.offset, logs)


def fit_loop(step: StepMath, dataset: tf.data.Dataset, epochs: int, initial_epoch: int,
             steps_per_epoch: int, callbacks: list[keras.callbacks.Callback],
             done_steps: int = 0) -> None:
    """Train with ``keras.Model.fit`` (its progress bar off: hvdtrain's own shows on rank 0).

    ``fit`` runs every epoch with the same number of steps, so a resumed partial epoch is one
    ``fit`` call of its remaining steps, and the epochs after it a second call.
    """
    model = DataParallelModel(step.model, step)
    model.compile(optimizer=step.optimizer, jit_compile=False)
    hooks = ContinuedHooks(callbacks, model)
    if done_steps:
        hooks.offset, hooks.fit_calls_left = done_steps, 1 + (initial_epoch + 1 < epochs)
        model.fit(dataset.skip(done_steps), epochs=initial_epoch + 1,
                  initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch - done_steps,
                  callbacks=hooks, shuffle=False, verbose=0)
        hooks.offset = 0
        initial_epoch += 1
        dataset = dataset.skip(steps_per_epoch)
    if initial_epoch < epochs:
        model.fit(dataset, epochs=epochs, initial_epoch=initial_epoch,
                  steps_per_epoch=steps_per_epoch, callbacks=hooks, shuffle=False, verbose=0)


def custom_loop(step: StepMath, dataset: tf.data.Dataset, epochs: int, initial_epoch: int,
                steps_per_epoch: int, callbacks: list[keras.callbacks.Callback],
                done_steps: int = 0) -> None:
    """Train with a plain loop around one ``tf.function`` step, firing the same callbacks. A
    callback may stop training by setting ``model.stop_training``, as under ``fit``."""
    train_step = tf.function(step.train_step, jit_compile=False)
    model = step.model
    model.stop_training = False
    hooks = keras.callbacks.CallbackList(callbacks, add_history=False, add_progbar=False,
                                         model=model)
    batches = iter(dataset.skip(done_steps))
    hooks.on_train_begin()
    for epoch in range(initial_epoch, epochs):
        hooks.on_epoch_begin(epoch)
        logs: dict = {}
        for batch in range(done_steps if epoch == initial_epoch else 0, steps_per_epoch):
            element = next(batches)
            hooks.on_train_batch_begin(batch)
            logs = train_step(*element)
            hooks.on_train_batch_end(batch, logs)
        logs = {name: float(value) for name, value in logs.items()}
        hooks.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    hooks.on_train_end()


LOOPS = {"fit": fit_loop, "custom": custom_loop}
