"""Horovod's elastic Keras API on Keras 3: ``KerasState``, the three state callbacks, ``run``.

``KerasState`` is the trainer's own elastic state (``hvdtrain.world``) over a model's and an
optimizer's variables: it keeps them in memory at every ``commit``, restores them after a
failed step and broadcasts them from rank 0 whenever the world is re-formed. Keras 3 creates an
optimizer's variables lazily, so the state builds the optimizer first: every rank then tracks
the same variables from the first commit on. ``run`` is Horovod's retry loop, retrying every
Horovod collective error (Horovod's own returns, as if training had ended, on an error of the
grouped allreduce that gradients travel in). On the TensorFlow backend, which cannot resize a
job, ``KerasState`` and ``run`` refuse in one line (the callbacks only act on a state).
"""

from __future__ import annotations

from typing import Any, Callable

import keras

from hvdtrain import dropin
from hvdtrain.world import elastic_retry, keras_elastic_state_class, tf_variables


def _refused_run(function: Callable[..., Any]) -> Callable[..., Any]:
    raise dropin.refused("Elastic training (hvd.elastic.run)")


# Horovod's elastic.run, also retrying the grouped allreduce that gradients travel in.
run = elastic_retry if dropin.BACKEND == "horovod" else _refused_run


class KerasState(keras_elastic_state_class() if dropin.BACKEND == "horovod" else object):
    """The model, its optimizer (``model.optimizer`` unless given) and picklable attributes
    (``batch=0, epoch=0``...), committed, restored and synchronised together."""

    def __init__(self, model: keras.Model, optimizer: Any = None, **kwargs: Any) -> None:
        if dropin.BACKEND != "horovod":
            raise dropin.refused("Elastic training (hvd.elastic.KerasState)")
        if not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        if not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        super().__init__(tf_variables(model.variables + self.optimizer.variables), **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at every epoch end."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batches_remaining = self.batches_per_commit    # the same count on every rank

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the last finished batch (0 after an epoch); after a reset, the
    first epoch is shortened by the batches already done when Keras knows the epoch length."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params["steps"]
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of finished epochs, counted across resets."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
