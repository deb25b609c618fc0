"""One callback contract for the training loops (single process, a world of one): Keras ``fit``
and the custom loop fire the same hooks in the same order with the same ``params``, for a
whole run, for one resumed mid-epoch, and for ``steps_per_epoch`` that does not divide a pass
(epochs of different lengths, Keras' reading: several ``fit`` calls over one stream); both show
Keras' console (``KerasConsole``) as one ``model.fit`` would, on rank 0 alone."""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.collectives import LocalCollectives
from hvdtrain.data.equal_steps import Passes
from hvdtrain.training.loops.run_callbacks import KerasConsole
from hvdtrain.training.loops.epoch_end import CallbackGroups
from hvdtrain.training.loops.driver import LOOPS, Training
from hvdtrain.training.loops.elastic import ElasticRun
from hvdtrain.training.step.objective import build_for_training
from hvdtrain.training.step.core import StepMath

STEPS, EPOCHS = 3, 3


class Recorder(keras.callbacks.Callback):
    """Every hook call, with its epoch or batch number and the params it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def _note(self, name: str, number: int | None = None) -> None:
        self.calls.append((name, number, self.params.get("epochs"), self.params.get("steps")))

    def on_train_begin(self, logs=None):
        self._note("train_begin")

    def on_train_end(self, logs=None):
        self._note("train_end")

    def on_epoch_begin(self, epoch, logs=None):
        self._note("epoch_begin", epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._note("epoch_end", epoch)

    def on_train_batch_begin(self, batch, logs=None):
        self._note("batch_begin", batch)

    def on_train_batch_end(self, batch, logs=None):
        self._note("batch_end", batch)


class FinalizingSGD(keras.optimizers.SGD):
    """SGD that notes when ``fit`` finalizes its variables (an EMA optimizer swaps its
    averages into the weights there: once, at the end of the training) in the recorder
    ``RECORDING[0]``."""

    def finalize_variable_values(self, var_list):
        RECORDING[0].calls.append(("finalize", None, None, None))
        super().finalize_variable_values(var_list)


RECORDING: list[Recorder] = []


def _run(loop: str, initial_epoch: int, done_steps: int, passes: Passes,
         chief: bool = True) -> list[tuple]:
    """The recorder's calls; the user's group holds a Keras callback that prints at every
    epoch's begin, rank 0's ``after`` group Keras' console at ``verbose=2``."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    optimizer = FinalizingSGD(0.1)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    step = StepMath(model, optimizer, LocalCollectives())
    rows = 8 * STEPS * (EPOCHS - initial_epoch)
    x = np.random.default_rng(0).standard_normal((rows, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    ones, weights = np.ones((rows,), np.float32), np.full((rows,), 1 / 8, np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y, ones, weights)).batch(8)
    build_for_training(model, next(iter(dataset)), "test model")
    recorder = Recorder()
    RECORDING[:] = [recorder]
    says_rate = keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate, verbose=1)
    console = [KerasConsole(2)] if chief else []
    callbacks = CallbackGroups([recorder], [], [says_rate], console, None, verbose=2,
                               chief=chief)
    LOOPS[loop](Training(step=step, epochs=EPOCHS, initial_epoch=initial_epoch,
                         done_steps=done_steps, passes=passes, batches=lambda: dataset,
                         callbacks=lambda: callbacks, around=contextlib.nullcontext,
                         elastic=_not_elastic))
    return recorder.calls


def _not_elastic() -> ElasticRun:
    raise AssertionError("fit and the custom loop make no elastic run")


def _shows_keras_console(shown: str, initial_epoch: int, steps: int) -> None:
    """Keras' console, one line per epoch (verbose=2) across the fit calls of the run, after
    the user's callback's line, as one ``model.fit`` shows them."""
    expected = [line for epoch in range(initial_epoch + 1, EPOCHS + 1) for line in (
        f"Epoch {epoch}: LearningRateScheduler setting learning rate to 0.1",
        f"Epoch {epoch}/{EPOCHS}", f"{steps}/{steps} - ")]
    lines = [line for line in shown.splitlines() if line]
    assert len(lines) == len(expected), shown
    assert all(line.startswith(start) for line, start in zip(lines, expected)), shown
    assert all(" - loss: " in line for line in lines[2::3]), shown


@pytest.mark.parametrize("initial_epoch,done_steps,steps_per_epoch",
                         [(0, 0, None), (1, 2, None), (0, 0, 2), (0, 1, 2)])
def test_fit_and_the_custom_loop_fire_the_same_hooks_with_the_same_params(
        initial_epoch, done_steps, steps_per_epoch, capsys):
    passes = Passes(STEPS, steps_per_epoch, initial_epoch)
    fit = _run("fit", initial_epoch, done_steps, passes)
    _shows_keras_console(capsys.readouterr().out, initial_epoch, steps_per_epoch or STEPS)
    custom = _run("custom", initial_epoch, done_steps, passes)
    _shows_keras_console(capsys.readouterr().out, initial_epoch, steps_per_epoch or STEPS)
    assert fit == custom
    assert fit[0][0] == "train_begin" and fit[-1][0] == "train_end"
    hooks = [call[0] for call in fit]
    assert hooks.count("train_begin") == 1 == hooks.count("train_end")
    assert hooks.count("finalize") == 1 and hooks[-2] == "finalize"     # once, before the end
    batches = [c[1] for c in fit if c[0] == "batch_begin"]
    fit = [call for call in fit if call[0] != "finalize"]
    lengths = passes.epoch_lengths(initial_epoch, EPOCHS)
    if steps_per_epoch:
        assert lengths == [2, 1, 2]          # a pass of 3 read 2 at a time, as Keras reads it
    expected = list(range(done_steps, lengths[0]))
    for length in lengths[1:]:
        expected += list(range(length))
    assert batches == expected
    assert {(c[2], c[3]) for c in fit} == {(EPOCHS, steps_per_epoch or STEPS)}


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_keras_prints_nothing_on_other_ranks_and_again_after_training(loop, capsys):
    """Not rank 0: a user's Keras callback with ``verbose=1`` trains as written and prints
    nothing while the loop runs; Keras prints again once it ends."""
    calls = _run(loop, 0, 0, Passes(STEPS, None, 0), chief=False)
    assert [call[0] for call in calls].count("epoch_end") == EPOCHS
    assert capsys.readouterr().out == ""
    stopping = keras.callbacks.EarlyStopping(verbose=1)
    stopping.stopped_epoch = 1
    stopping.on_train_end()
    assert capsys.readouterr().out == "Epoch 2: early stopping\n"
