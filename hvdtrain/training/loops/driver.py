"""The loops a run trains with, named by ``LOOPS`` (``loop_name`` picks one from the config):
Keras ``fit`` on the user's own model, the custom loop, and Horovod's elastic loop
(``elastic``). Each takes one ``Training`` and makes from it the parts it uses.

``fit`` is the model's own, with the run's step as its ``train_step`` for the run, so every
callback sees the user's model and optimizer as under a plain ``model.fit``. Keras' own
function is not compiled with XLA (collective ops have no XLA kernels): the step compiles its
forward and backward pass when the model's ``jit_compile`` asks (``StepOptions.xla``). The
custom loop is the epoch driver (``epochs``) around one ``tf.function`` step, as the elastic
loop is in each world. Fit and custom read the same stream of batches and fire the same
callbacks at the same points, so one config gives the same result on both.
Epochs of different lengths (a resumed partial epoch, ``steps_per_epoch`` not dividing a pass)
are several ``fit`` calls (``fit_segments``) on one iterator, so the data never restarts.
Keras' console is the run's callbacks' (rank 0's ``KerasConsole``, fired after the epoch end,
one progress bar across the calls), never ``fit``'s own; Keras' messages on the other ranks are
silenced while a loop trains (``keras_messages_silenced``), so a user's
``EarlyStopping(verbose=1)`` prints once."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Sequence

import keras
import tensorflow as tf

from hvdtrain.config import TrainConfig
from hvdtrain.data.equal_steps import Passes
from hvdtrain.keras_internals import (finalizing_deferred, keras_messages_silenced,
                                      train_step_installed)
from hvdtrain.training.loops.elastic import ElasticRun, elastic_loop
from hvdtrain.training.loops.epoch_end import CallbackGroups, RunCallbacks
from hvdtrain.training.loops.epochs import Epoch, train_epochs
from hvdtrain.training.loops.run_callbacks import LivenessCallback
from hvdtrain.training.step.bucket_choice import TracedPerWay, choosing
from hvdtrain.training.step.core import TrainingStep


class ContinuedHooks(RunCallbacks):
    """The run's callbacks across the ``fit`` calls of one training: a call that starts inside
    an epoch (a resumed one) numbers its steps from 0, so batch numbers are shifted by
    ``offset`` there; train begin fires once, at the first call, and train end once, by
    ``end_training`` after the last."""

    def __init__(self, callbacks: CallbackGroups, model: keras.Model, epochs: int, steps: int,
                 history: keras.callbacks.History,
                 loop_own: Sequence[keras.callbacks.Callback] = ()) -> None:
        super().__init__(callbacks, model, epochs, steps, last=[history, *loop_own])
        self.offset = 0
        self.begun = False
        self.last_logs: dict | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.begun:
            self.begun = True
            super().on_train_begin(logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        self.last_logs = logs

    def on_train_end(self, logs: dict | None = None) -> None:
        """Each ``fit`` call's end: not yet the training's (``end_training``)."""

    def end_training(self) -> None:
        """Train end, once, with the last epoch's logs (as Keras' ``fit`` passes them)."""
        super().on_train_end(self.last_logs)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        super().on_train_batch_begin(batch + self.offset, logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        super().on_train_batch_end(batch + self.offset, logs)


@contextlib.contextmanager
def step_installed(step: TrainingStep) -> Iterator[None]:
    """The run's step as the model's ``train_step``, Keras' XLA off (the step's own forward and
    backward pass may use it), fresh traced functions; all as they were afterwards."""
    with train_step_installed(step.model, step.keras_step):
        yield


@dataclass(frozen=True)
class Segment:
    """One ``fit`` call: epochs ``[first, end)`` of ``steps`` steps each, the first of them
    starting ``offset`` steps in (a resumed epoch: then ``end`` is ``first + 1``)."""

    first: int
    end: int
    steps: int
    offset: int = 0


def epoch_steps(passes: Passes, initial_epoch: int, epochs: int,
                done_steps: int = 0) -> Iterator[tuple[int, int, int]]:
    """(epoch, its first step, its steps) for epochs ``[initial_epoch, epochs)``: the first
    resumes at ``done_steps`` (a resumed partial epoch), every other starts at 0."""
    for epoch, steps in zip(range(initial_epoch, epochs),
                            passes.epoch_lengths(initial_epoch, epochs)):
        yield epoch, done_steps if epoch == initial_epoch else 0, steps


def fit_segments(passes: Passes, initial_epoch: int, epochs: int,
                 done_steps: int = 0) -> list[Segment]:
    """The ``fit`` calls that train epochs ``[initial_epoch, epochs)``: consecutive epochs of
    one length share a call; a resumed partial epoch is a call of its own."""
    segments: list[Segment] = []
    for epoch, offset, steps in epoch_steps(passes, initial_epoch, epochs, done_steps):
        last = segments[-1] if segments else None
        if last is not None and not offset and not last.offset and last.steps == steps:
            segments[-1] = Segment(last.first, epoch + 1, steps)
        else:
            segments.append(Segment(epoch, epoch + 1, steps, offset))
    return segments


def _continuing(batches: Iterator[Any], count: int, spec: Any) -> tf.data.Dataset:
    """The next ``count`` batches of an iterator the ``fit`` calls share, as a dataset."""
    def read() -> Iterator[Any]:
        for _ in range(count):
            yield next(batches)

    return tf.data.Dataset.from_generator(read, output_signature=spec).prefetch(1)


@contextlib.contextmanager
def finalized_once(model: keras.Model) -> Iterator[None]:
    """Keras' ``fit`` ends by finalizing the optimizer's variables (an optimizer with
    ``use_ema`` puts its averages into the weights): across the ``fit`` calls of one training
    that happens once, after the last, as one ``fit`` does it."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        yield
        return
    with finalizing_deferred(optimizer):
        yield
    optimizer.finalize_variable_values(model.trainable_weights)


@dataclass(frozen=True, kw_only=True)
class Training:
    """What the run hands the loop ``LOOPS`` names for it: the run's step, the epochs
    ``[initial_epoch, epochs)`` and the steps of the first already trained (a resumed epoch),
    the epochs' lengths (``passes``). The parts a loop builds its training from are made when
    it asks, so each is made only for the loop that uses it: the batches from the starting
    point and the run's callbacks (fit, custom); what the run puts ``around`` a loop on a fixed
    world (its data errors named, the step's ``training`` context, the failing step noted,
    the memory held measured); the elastic loop's ``ElasticRun`` (each world's step, batches
    and callbacks are its own)."""

    step: TrainingStep
    epochs: int
    initial_epoch: int
    done_steps: int
    passes: Passes
    batches: Callable[[], tf.data.Dataset]
    callbacks: Callable[[], CallbackGroups]
    around: Callable[[], ContextManager[None]]
    elastic: Callable[[], ElasticRun]


Loop = Callable[[Training], keras.callbacks.History | None]
FixedWorldLoop = Callable[[TrainingStep, tf.data.Dataset, int, int, Passes, CallbackGroups, int],
                          keras.callbacks.History]


def on_one_world(loop: FixedWorldLoop) -> Loop:
    """``loop`` (fit, custom) as a ``LOOPS`` entry: nothing to train past the last epoch (None);
    otherwise the run's callbacks, then, inside what the run puts around it, the batches and
    the loop."""
    def train(training: Training) -> keras.callbacks.History | None:
        if training.initial_epoch >= training.epochs:
            return None
        callbacks = training.callbacks()
        with training.around():
            return loop(training.step, training.batches(), training.epochs,
                        training.initial_epoch, training.passes, callbacks, training.done_steps)

    return train


def traces_next(callbacks: CallbackGroups) -> Callable[[], None]:
    """What tells the run's liveness monitor that the next step traces (none without one)."""
    watch = next((c for c in callbacks.before if isinstance(c, LivenessCallback)), None)
    return (lambda: None) if watch is None else watch.step_traces_next


def retraced_train_function(model: keras.Model) -> Any:
    """Keras' train function traced anew (``make_train_function`` sets it, returns nothing)."""
    model.make_train_function(force=True)
    return model.train_function


def fit_loop(step: TrainingStep, dataset: tf.data.Dataset, epochs: int, initial_epoch: int,
             passes: Passes, callbacks: CallbackGroups,
             done_steps: int = 0) -> keras.callbacks.History:
    """Train with the model's own ``fit`` (its own progress bar off: the run's callbacks hold
    rank 0's), one call per ``fit_segments`` segment."""
    model = step.model
    history = keras.callbacks.History()
    ways = TracedPerWay(step, lambda: retraced_train_function(model),
                        lambda function: setattr(model, "train_function", function),
                        traces_next(callbacks))
    hooks = ContinuedHooks(callbacks, model, epochs, passes.keras_steps, history,
                           choosing(step, lambda way: ways.switch(way, model.train_function)))
    segments = fit_segments(passes, initial_epoch, epochs, done_steps)
    shared = iter(dataset) if len(segments) > 1 else None
    finalizing = finalized_once(model) if shared is not None else contextlib.nullcontext()
    with step_installed(step), keras_messages_silenced(not callbacks.chief):
        with finalizing:
            for segment in segments:
                hooks.offset = segment.offset
                data = dataset if shared is None else _continuing(
                    shared, (segment.end - segment.first) * (segment.steps - segment.offset),
                    dataset.element_spec)
                model.fit(data, epochs=segment.end, initial_epoch=segment.first,
                          steps_per_epoch=segment.steps - segment.offset, callbacks=hooks,
                          shuffle=False, verbose=0)
                if model.stop_training:
                    break
        hooks.end_training()
    return history


def custom_loop(step: TrainingStep, dataset: tf.data.Dataset, epochs: int, initial_epoch: int,
                passes: Passes, callbacks: CallbackGroups,
                done_steps: int = 0) -> keras.callbacks.History:
    """Train with a plain loop around one ``tf.function`` step over the epoch driver
    (``epochs``), firing the same callbacks as ``fit``."""
    with keras_messages_silenced(not callbacks.chief):
        return _custom_loop(step, dataset, epochs, initial_epoch, passes, callbacks, done_steps)


def _custom_loop(step: TrainingStep, dataset: tf.data.Dataset, epochs: int, initial_epoch: int,
                 passes: Passes, callbacks: CallbackGroups,
                 done_steps: int) -> keras.callbacks.History:
    """``custom_loop`` inside its silencing of Keras' messages (not rank 0)."""
    # Traced from the data's element spec, as Keras' fit traces from its iterator.
    train_step = TracedPerWay(step, lambda: tf.function(step.keras_step, jit_compile=False,
                                                        input_signature=[dataset.element_spec]),
                              traces_next=traces_next(callbacks))
    model = step.model
    model.stop_training = False
    history = keras.callbacks.History()
    hooks = RunCallbacks(callbacks, model, epochs, passes.keras_steps,
                         last=[history, *choosing(step, train_step.switch)])
    batches = iter(dataset)     # before train begins, as Keras' fit makes its iterator
    hooks.on_train_begin()
    epoch_logs = train_epochs(hooks, train_step, model,
                              _epochs(batches, passes, initial_epoch, epochs, done_steps))
    if isinstance(getattr(model, "optimizer", None), keras.optimizers.Optimizer):
        model.optimizer.finalize_variable_values(model.trainable_weights)   # as fit ends
    hooks.on_train_end(epoch_logs)
    return history


def _epochs(batches: Iterator[Any], passes: Passes, initial_epoch: int, epochs: int,
            done_steps: int) -> Iterator[Epoch]:
    """Epochs ``[initial_epoch, epochs)`` of one stream of batches, each batch read as the
    driver comes to it; the first epoch numbers its batches from ``done_steps``."""
    for epoch, first, steps in epoch_steps(passes, initial_epoch, epochs, done_steps):
        yield Epoch(epoch, ((batch, next(batches)) for batch in range(first, steps)))


def elastic(training: Training) -> None:
    """Horovod's elastic loop (``elastic.elastic_loop``) over the run's ``ElasticRun``."""
    elastic_loop(training.elastic())


LOOPS: dict[str, Loop] = {"fit": on_one_world(fit_loop), "custom": on_one_world(custom_loop),
                          "elastic": elastic}


def loop_name(train: TrainConfig) -> str:
    """The ``LOOPS`` entry a run's config picks: ``--elastic`` trains through Horovod's elastic
    loop, whatever ``--loop`` says; otherwise ``--loop``'s."""
    return "elastic" if train.elastic else train.loop
