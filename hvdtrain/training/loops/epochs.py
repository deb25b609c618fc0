"""The epoch driver of the loops in code (the custom loop, each world of the elastic loop): one
sequence of Keras' hooks around one step function, as Keras' ``fit`` fires them. Per epoch:
``on_epoch_begin``, then per batch ``on_train_batch_begin``, the step, ``on_train_batch_end``;
then the epoch end (``RunCallbacks.on_epoch_end``, the one ``epoch_end.end_epoch``) with the
last step's scalar logs. A callback stops training by setting ``model.stop_training``, as under
``fit``; hvdtrain's checkpointing turns it into a vote the next step carries, so every rank
ends the epoch after that same step and no other begins.

A loop gives the epochs as ``Epoch`` values, each with its batches; what it does between them
(the elastic loop's commits and offsets) it does where it makes them: a generator's code after
its ``yield`` runs once the driver is done with that epoch or batch, and not after a stop.
Train begin and end stay the loop's (a training may span several worlds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import keras

from hvdtrain.training.loops.epoch_end import RunCallbacks


@dataclass(frozen=True)
class Epoch:
    """One epoch as the driver trains it: its number and its batches, each with the number
    the hooks see (a resumed epoch's first is not 0)."""

    number: int
    batches: Iterable[tuple[int, Any]]


def train_epochs(hooks: RunCallbacks, train_step: Callable[[Any], dict], model: keras.Model,
                 epochs: Iterable[Epoch]) -> dict[str, float] | None:
    """Train ``epochs`` in order, firing ``hooks`` (see the module doc); the last epoch's logs
    (None: no epoch)."""
    epoch_logs: dict[str, float] | None = None
    for epoch in epochs:
        hooks.on_epoch_begin(epoch.number)
        logs: dict = {}
        for batch, element in epoch.batches:
            hooks.on_train_batch_begin(batch)
            logs = train_step(element)
            hooks.on_train_batch_end(batch, logs)
            if model.stop_training:     # a callback stopped it (every rank alike)
                break
        epoch_logs = scalar_logs(logs)
        hooks.on_epoch_end(epoch.number, epoch_logs)
        if model.stop_training:
            break
    return epoch_logs


def scalar_logs(logs: dict) -> dict[str, float]:
    """A step's logs as the floats an epoch's logs hold (non-scalar entries left out)."""
    return {name: float(value) for name, value in logs.items()
            if getattr(value, "shape", ()) == ()}
