"""Horovod's Keras callbacks on Keras 3 (same names, arguments and semantics).

The learning-rate callbacks read and write Keras 3's ``optimizer.learning_rate`` (a variable the
compiled step reads at run time). Horovod's ``momentum_correction`` cannot be honoured: Keras 3
optimizers keep ``momentum`` as a Python number compiled into the step, so the callbacks say so
once instead of pretending.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from hvdtrain.tensorflow import broadcast_variables, collectives, rank, size


def _learning_rate(model: keras.Model) -> float:
    return float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` after the first
    batch (when Keras 3 has created the optimizer's variables), so every rank continues from
    the same state whether it started from random weights or a checkpoint. Variables in
    ``local_variables`` keep each rank's own values."""

    def __init__(self, root_rank: int, device: str = "",
                 local_variables: Sequence[Any] | Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple)):
            local_variables = [local_variables]
        self._local = {id(v) for v in local_variables}
        self.broadcast_done = False

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.broadcast_done:
            return
        with tf.device(self.device):
            broadcast_variables([v for v in self.model.variables if id(v) not in self._local],
                                root_rank=self.root_rank)
            broadcast_variables(self.model.optimizer.variables, root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average every epoch-end metric across ranks (one grouped allreduce, names in sorted
    order), so that callbacks after it (ReduceLROnPlateau, TensorBoard, History, checkpoints)
    see the same numbers on every rank. Place it before them."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        names = sorted(logs)
        with tf.device(self.device):
            totals = collectives().allreduce_sum(
                [tf.constant(float(logs[name]), tf.float64) for name in names])
        for name, total in zip(names, totals):
            logs[name] = float(total) / size()


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` for epochs in
    ``[start_epoch, end_epoch)``: at each epoch's first batch (``staircase``), or at every
    batch with a fractional epoch ``epoch + batch / steps_per_epoch``. A constant multiplier m
    means ``m ** (epoch - start_epoch)``. Logs the rate as ``lr`` at each epoch end."""

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__} could not read the number of steps per "
                                 "epoch from Keras; pass steps_per_epoch=")
        if self.momentum_correction and getattr(self.model.optimizer, "momentum", 0):
            warnings.warn("momentum_correction is not applied on Keras 3: the optimizer's "
                          "momentum is a Python number compiled into the training step",
                          stacklevel=2)
            self.momentum_correction = False

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.current_epoch < self.start_epoch or (
                self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(
                self.current_epoch)
        elif not self.staircase:
            epoch = self.current_epoch + float(batch) / self.steps_per_epoch
            self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = _learning_rate(self.model)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warmup ("Accurate, Large Minibatch SGD", Goyal et al.): the rate climbs batch by
    batch from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` epochs, where
    ``initial_lr`` is the rate scaled for the world (e.g. ``base_lr * hvd.size()``)."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # Shifted by one batch so that each epoch ends on a round value.
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:
            # Part of Keras' epoch display, asked for by verbose=1, as Keras' own callbacks
            # print theirs (and Horovod's this one): not an hvdtrain log line.
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_learning_rate(self.model):g}.")


def keras3_checkpoint_path(filepath: str, save_weights_only: bool) -> str:
    """A checkpoint name Keras 3 accepts: ``.keras`` for models, ``.weights.h5`` for weights
    (Horovod-era scripts use ``.h5`` for both)."""
    path = str(filepath)
    if save_weights_only:
        if path.endswith(".weights.h5"):
            return path
        return path.removesuffix(".h5").removesuffix(".hdf5") + ".weights.h5"
    if path.endswith(".keras"):
        return path
    return path.removesuffix(".h5").removesuffix(".hdf5") + ".keras"


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keep the best model by ``monitor``, written by rank 0 alone (every rank must see the
    same metric: add ``MetricAverageCallback`` before it). ``filepath`` defaults to
    ``best.keras``; a Keras 2 name (``.h5``) is turned into its Keras 3 form."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None) -> None:
        super().__init__(keras3_checkpoint_path(filepath or "best", save_weights_only),
                         monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if rank() == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if rank() == 0:
            super().on_epoch_end(epoch, logs)
