"""The two training paths over the same step: Keras ``fit`` on the user's own model, and a
custom loop.

``fit`` is the model's own ``fit``: for the run, the model's ``train_step`` is the run's step
(``TrainingStep.keras_step``: hvdtrain's exact step, or the model's own step with the
collectives underneath it), so every callback sees the user's model, its optimizer and its
``stop_training`` exactly as under a plain ``model.fit``. The model gets its own step back
when the run ends. XLA stays off while it trains: Horovod's collective ops have no XLA kernels.

Both paths consume the same dataset (one element per step, every epoch back to back) and fire
the same callbacks at the same points, with Keras' ``params`` (epochs, steps), so the same
config gives the same result on both. A run resumed from a mid-epoch checkpoint starts
``done_steps`` into its first epoch: both skip those batches of the dataset (the data plan is a
function of seed and epoch, so the rest is what an uninterrupted run would have seen) and
number the remaining steps from ``done_steps``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import keras
import tensorflow as tf

from hvdtrain.training.step import TrainingStep


class ContinuedHooks(keras.callbacks.CallbackList):
    """The run's callbacks across the ``fit`` calls of one training: the first call trains the
    rest of a resumed epoch, whose steps ``fit`` numbers from 0, so batch numbers are shifted
    by ``offset`` there; train begin and end fire once for the whole training."""

    def __init__(self, callbacks: list[keras.callbacks.Callback], model: keras.Model,
                 epochs: int, steps: int) -> None:
        super().__init__(callbacks, add_history=False, add_progbar=False, model=model,
                         epochs=epochs, steps=steps, verbose=0)
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


@contextlib.contextmanager
def step_installed(step: TrainingStep) -> Iterator[None]:
    """The run's step as the model's ``train_step``, XLA off, fresh traced functions; all as
    they were afterwards."""
    model = step.model
    jit = model.jit_compile
    model.jit_compile = False
    model.train_step = step.keras_step
    model.train_function = model.test_function = None
    try:
        yield
    finally:
        del model.train_step
        model.train_function = model.test_function = None
        model.jit_compile = jit


def fit_loop(step: TrainingStep, dataset: tf.data.Dataset, epochs: int, initial_epoch: int,
             steps_per_epoch: int, callbacks: list[keras.callbacks.Callback],
             done_steps: int = 0) -> keras.callbacks.History:
    """Train with the model's own ``fit`` (its progress bar off: hvdtrain's own shows on rank
    0). ``fit`` runs every epoch with the same number of steps, so a resumed partial epoch is
    one ``fit`` call of its remaining steps, and the epochs after it a second call."""
    model = step.model
    history = keras.callbacks.History()
    hooks = ContinuedHooks([*callbacks, history], model, epochs, steps_per_epoch)
    with step_installed(step):
        if done_steps:
            hooks.offset, hooks.fit_calls_left = done_steps, 1 + (initial_epoch + 1 < epochs)
            model.fit(dataset.skip(done_steps), epochs=initial_epoch + 1,
                      initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch - done_steps,
                      callbacks=hooks, shuffle=False, verbose=0)
            hooks.offset = 0
            initial_epoch += 1
            dataset = dataset.skip(steps_per_epoch)
        if initial_epoch < epochs and not model.stop_training:
            model.fit(dataset, epochs=epochs, initial_epoch=initial_epoch,
                      steps_per_epoch=steps_per_epoch, callbacks=hooks, shuffle=False,
                      verbose=0)
    return history


def custom_loop(step: TrainingStep, dataset: tf.data.Dataset, epochs: int, initial_epoch: int,
                steps_per_epoch: int, callbacks: list[keras.callbacks.Callback],
                done_steps: int = 0) -> keras.callbacks.History:
    """Train with a plain loop around one ``tf.function`` step, firing the same callbacks. A
    callback may stop training by setting ``model.stop_training``, as under ``fit``."""
    train_step = tf.function(step.keras_step, jit_compile=False)
    model = step.model
    model.stop_training = False
    history = keras.callbacks.History()
    hooks = keras.callbacks.CallbackList([*callbacks, history], add_history=False,
                                         add_progbar=False, model=model, epochs=epochs,
                                         steps=steps_per_epoch, verbose=0)
    batches = iter(dataset.skip(done_steps))
    hooks.on_train_begin()
    for epoch in range(initial_epoch, epochs):
        hooks.on_epoch_begin(epoch)
        logs: dict = {}
        for batch in range(done_steps if epoch == initial_epoch else 0, steps_per_epoch):
            element = next(batches)
            hooks.on_train_batch_begin(batch)
            logs = train_step(element)
            hooks.on_train_batch_end(batch, logs)
            if model.stop_training:
                break
        hooks.on_epoch_end(epoch, scalar_logs(logs))
        if model.stop_training:
            break
    hooks.on_train_end()
    return history


def scalar_logs(logs: dict) -> dict[str, float]:
    """A step's logs as the floats an epoch's logs hold (non-scalar entries left out)."""
    return {name: float(value) for name, value in logs.items()
            if getattr(value, "shape", ()) == ()}


LOOPS = {"fit": fit_loop, "custom": custom_loop}
