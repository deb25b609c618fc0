"""The end of an epoch, in code and in this order, for every loop (Keras ``fit``, the custom
loop, the elastic loop): the liveness phase begins, the exact global metrics replace the
rank's own, batch-norm statistics become the ranks' mean, validation adds ``val_*``, the user's
callbacks see those logs (a decision such as early stopping is then alike on every rank), rank
0 checkpoints and the ranks agree whether to stop, and only then rank 0 writes its files and
reports (``hvdtrain.fit``: Keras' own progress bar, which so shows the exact values). The loops
reach it through ``RunCallbacks.on_epoch_end``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import keras

from hvdtrain.collectives import Collectives, assign_across_ranks
from hvdtrain.keras_internals import pythonified_logs, sublayers
from hvdtrain.training.loops.run_callbacks import (CallbackContext, DataRanOut, EpochMetrics,
                                                   KerasConsole, LivenessCallback, MetricsFiles,
                                                   Progress, StopOnDivergence, TensorBoardEvents,
                                                   rank_aware, validates_after)
from hvdtrain.training.loops.checkpointing import Checkpointing
from hvdtrain.training.loops.run_columns import NoteRunColumns, Throughput
from hvdtrain.training.step.core import TrainingStep
from hvdtrain.artifacts import RunFileWriter


def batch_norm_statistics(model: keras.Model) -> list[Any]:
    """The moving means and variances of every batch-norm layer (inference uses them)."""
    return [v for layer in sublayers(model) if isinstance(layer, keras.layers.BatchNormalization)
            for v in layer.non_trainable_variables]


@dataclass
class EpochEnd:
    """What every rank does at an epoch's end besides the callbacks (see the module doc).
    Batch statistics inside a step stay rank-local (each rank normalises its own batch, as
    Horovod's default does); the moving statistics are averaged once per epoch, so every rank
    validates, checkpoints and saves the same model."""

    step: TrainingStep
    collectives: Collectives
    checkpointing: Checkpointing
    liveness: LivenessCallback | None = None
    evaluate: Callable[[], dict[str, float]] | None = None
    validation_freq: int | list[int] = 1
    statistics: list[Any] = field(default_factory=list)

    def results(self, epoch: int, logs: dict) -> None:
        """Exact global metrics, averaged batch-norm statistics, validation: into ``logs``, in
        the order Keras gives them (``keras_ordered``)."""
        logs.update(self.step.epoch_results(logs))
        if self.statistics and self.collectives.world.size > 1:
            assign_across_ranks(self.collectives, self.statistics, mean=True)
        if self.evaluate is not None and validates_after(epoch, self.validation_freq):
            logs.update(self.evaluate())
        keras_ordered(logs)


def keras_ordered(logs: dict) -> None:
    """Put an epoch's logs, in place, in the order Keras' ``fit`` hands them to callbacks: its
    ``CallbackList`` makes them anew from the training and validation results together,
    sorted by name (``accuracy, loss, val_accuracy, val_loss``), so ``History`` and
    ``CSVLogger`` list their columns in that order; keys a callback adds later
    (``ReduceLROnPlateau``'s ``learning_rate``) follow."""
    ordered = pythonified_logs(logs)
    logs.clear()
    logs.update(ordered)


@dataclass
class CallbackGroups:
    """The run's callbacks in the places the epoch end fires them: ``before`` the metrics are
    reduced (liveness, data, divergence, clocks, rates), once the logs are exact hvdtrain's
    ``own`` (the run's columns, the plateau schedule) and then the ``user``'s, ``after`` the
    checkpoint (rank 0's files and progress). Every other hook fires in that order too.
    ``verbose``: Keras' ``verbose`` in every callback's ``params``, as ``model.fit`` sets it
    (``hvdtrain.fit``'s; 0 on the command line); ``chief``: this is rank 0, the one rank whose
    Keras messages show (the loops silence the others', ``keras_messages_silenced``)."""

    before: list[keras.callbacks.Callback]
    own: list[keras.callbacks.Callback]
    user: list[keras.callbacks.Callback]
    after: list[keras.callbacks.Callback]
    epoch_end: EpochEnd | None    # None: callbacks alone (a loop's own test)
    verbose: int = 0
    chief: bool = True

    def all(self) -> list[keras.callbacks.Callback]:
        return [*self.before, *self.own, *self.user, *self.after]


class RunCallbacks(keras.callbacks.CallbackList):
    """The run's callbacks for one loop: Keras' list for every hook but the epoch's end, which
    ``end_epoch`` runs in code; ``last``: the loop's own (its ``History``)."""

    def __init__(self, groups: CallbackGroups, model: keras.Model, epochs: int,
                 steps: int | None, last: Sequence[keras.callbacks.Callback] = ()) -> None:
        self.groups, self.last = groups, list(last)
        super().__init__([*groups.all(), *self.last], add_history=False, add_progbar=False,
                         model=model, epochs=epochs, steps=steps, verbose=groups.verbose)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        end_epoch(self.groups, epoch, pythonified_logs(logs), self.last)

    def begin_training(self, again: bool = False) -> None:
        """Train begin for every callback, or (``again``: an elastic job's next world, whose
        callbacks of hvdtrain's own are new) for those alone: the user's see one training."""
        everyone = self.callbacks
        if again:
            self.callbacks = [c for c in everyone if c not in self.groups.user]
        try:
            self.on_train_begin()
        finally:
            self.callbacks = everyone


def end_epoch(groups: CallbackGroups, epoch: int, logs: dict,
              last: Sequence[keras.callbacks.Callback] = ()) -> None:
    """The epoch's end, in order (see the module doc); ``logs`` become the epoch's logs."""
    end = groups.epoch_end
    if end is not None and end.liveness is not None:
        end.liveness.epoch_end_begins(epoch)
    for callback in groups.before:
        callback.on_epoch_end(epoch, logs)
    if end is not None:
        end.results(epoch, logs)
    for callback in [*groups.own, *groups.user]:
        callback.on_epoch_end(epoch, logs)
    if end is not None:
        end.checkpointing.end_epoch(epoch, logs)
    for callback in [*groups.after, *last]:
        callback.on_epoch_end(epoch, logs)


def standard_callbacks(context: CallbackContext) -> CallbackGroups:
    """The callbacks of a run and its epoch end. The user's callbacks run on every rank (their
    logs hold the exact global metrics and validation, equal on every rank, and no key one plain
    ``model.fit`` would not have; writers on rank 0 only); rank 0's own writers and report add
    the run's columns to what they record. Rank 0 reports with ``hvdtrain.fit``'s
    ``KerasConsole`` where it came with the user's callbacks (unless they hold a
    ``ProgbarLogger`` of their own, which Keras then shows instead, as ``model.fit`` does),
    otherwise with hvdtrain's ``Progress``."""
    model, world, report = context.step.model, context.collectives.world, context.reporting
    console = next((c for c in context.user_callbacks if isinstance(c, KerasConsole)), None)
    user = [c for c in context.user_callbacks if c is not console]
    own_bar = any(isinstance(c, keras.callbacks.ProgbarLogger) for c in user)
    throughput = Throughput(report.global_batch)
    liveness = (LivenessCallback(context.liveness, context.collectives)
                if context.liveness is not None else None)
    before: list[keras.callbacks.Callback] = [
        *([liveness] if liveness is not None else []),
        *([DataRanOut(context.passes)] if context.passes is not None and world.is_chief else []),
        StopOnDivergence(context.step, context.checkpoints.store),
        *([report.first_step] if report.first_step is not None else []),
        throughput,
        context.rates,
        EpochMetrics(context.step),
    ]
    own: list[keras.callbacks.Callback] = [
        NoteRunColumns(throughput, context.step.optimizers, context.run_columns,
                       world.size if context.world_size_column else None),
        *([context.plateau] if context.plateau is not None else []),
    ]
    plateau, rates = context.plateau, context.rates

    def live_state() -> dict[str, Any]:
        return {"rates": rates.state(), "rate_scale": rates.schedule.scale,
                **({"plateau": plateau.state()} if plateau is not None else {})}

    checkpointing = Checkpointing(context.step, context.collectives, context.checkpoints,
                                  live_state, context.run_columns, context.liveness,
                                  context.passes)
    after: list[keras.callbacks.Callback] = [checkpointing]
    if world.is_chief:
        run_dir, columns = report.run_dir, context.run_columns
        after.append(RunFileWriter(lambda: MetricsFiles(run_dir, columns), run_dir,
                                   "the metrics files"))
        if report.tensorboard:
            after.append(RunFileWriter(
                lambda: TensorBoardEvents(run_dir / "tensorboard", columns), run_dir,
                "TensorBoard events"))
        if report.tracking is not None:
            after.append(report.tracking)
        if console is None:
            after.append(Progress(throughput, columns, report.show_progress,
                                  report.interactive))
        elif console.fit_verbose and not own_bar:
            after.append(console)
    end = EpochEnd(context.step, context.collectives, checkpointing, liveness, context.evaluate,
                   context.validation_freq, batch_norm_statistics(model))
    return CallbackGroups(before, own, rank_aware(user, world), after, end,
                          verbose=0 if console is None else console.fit_verbose,
                          chief=world.is_chief)
