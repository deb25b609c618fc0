"""The two training paths over the same ``StepMath``: Keras ``fit`` and a custom loop.

Both consume the same dataset (one element per step, every epoch back to back) and fire the same
callbacks at the same points, so the same config gives the same result on both.
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


def fit_loop(step: StepMath, dataset: tf.data.Dataset, epochs: int, initial_epoch: int,
             steps_per_epoch: int, callbacks: list[keras.callbacks.Callback]) -> None:
    """Train with ``keras.Model.fit`` (its progress bar off: hvdtrain's own shows on rank 0)."""
    model = DataParallelModel(step.model, step)
    model.compile(optimizer=step.optimizer, jit_compile=False)
    model.fit(dataset, epochs=epochs, initial_epoch=initial_epoch,
              steps_per_epoch=steps_per_epoch, callbacks=callbacks, shuffle=False,
              verbose=0)


def custom_loop(step: StepMath, dataset: tf.data.Dataset, epochs: int, initial_epoch: int,
                steps_per_epoch: int, callbacks: list[keras.callbacks.Callback]) -> None:
    """Train with a plain loop around one ``tf.function`` step, firing the same callbacks. A
    callback may stop training by setting ``model.stop_training``, as under ``fit``."""
    train_step = tf.function(step.train_step, jit_compile=False)
    model = step.model
    model.stop_training = False
    hooks = keras.callbacks.CallbackList(callbacks, add_history=False, add_progbar=False,
                                         model=model)
    batches = iter(dataset)
    hooks.on_train_begin()
    for epoch in range(initial_epoch, epochs):
        hooks.on_epoch_begin(epoch)
        logs: dict = {}
        for batch in range(steps_per_epoch):
            logs = train_step(*next(batches))
            hooks.on_train_batch_end(batch, logs)
        logs = {name: float(value) for name, value in logs.items()}
        hooks.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    hooks.on_train_end()


LOOPS = {"fit": fit_loop, "custom": custom_loop}
