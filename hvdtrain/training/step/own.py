"""The model's own step: a model that defines ``train_step``, ``test_step``, ``compute_loss`` or
``compute_metrics`` (a custom step, a GAN with two optimizers, a VAE) is trained with *its* code
on every rank, the distribution underneath that code, as in the Horovod drop-in.

Every optimizer the model owns combines gradients across ranks before applying them
(``hvdtrain.optimizers.reduction``), each rank's weighted by its share of the global batch (its real
rows), so a step whose loss is a batch mean updates as one process would, the last partial
global batch included: it is spread over the ranks, and each rank's step sees its real rows
only. (A rank with no row of a step, where fewer rows than ranks are left, runs the step on a
filler batch whose gradients weigh nothing; the run says so.) One small allreduce per step
averages the scalar logs and carries the stop votes; at an epoch's end every metric's state is
summed across ranks, so the metrics are exact over the global data. Evaluation runs the model's
``test_step`` on each rank's unpadded share, then reduces the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf

from hvdtrain.collectives import Collectives, GradientReduction
from hvdtrain.errors import found_by_every_rank
from hvdtrain.optimizers.reduction import distributed_for_the_run
from hvdtrain.training.step.objective import (global_metric_results, metric_variables, real_rows,
                                              scalar)
from hvdtrain.training.step.core import divided
from hvdtrain.training.step.held import RunEnd, memory_for_the_run
from hvdtrain.training.step.sync_batch_norm import batch_rows
from hvdtrain.training.step.votes import StopVotes
from hvdtrain.model_memory.for_run import LayerMemory
from hvdtrain.model_memory.remat import Remat
from hvdtrain.optimizers.powersgd import PowerSGD
from hvdtrain.optimizers.sharding import Sharding, gradient_bytes_kept
from hvdtrain.optimizers.state_into_pieces import SavedState

# The Trainer methods whose override makes a step the model's own.
OWN_STEP_METHODS = ("train_step", "test_step", "compute_loss", "compute_metrics")


def own_step_methods(model: keras.Model) -> list[str]:
    """The step methods ``model``'s class defines itself (empty: Keras' own)."""
    return [name for name in OWN_STEP_METHODS
            if getattr(type(model), name) is not getattr(keras.Model, name)]


def owned_optimizers(model: keras.Model) -> dict[str, keras.optimizers.Optimizer]:
    """Every optimizer the model holds, by attribute name, ``optimizer`` first."""
    found: dict[str, keras.optimizers.Optimizer] = {}
    for name, value in [("optimizer", getattr(model, "optimizer", None)), *vars(model).items()]:
        if isinstance(value, keras.optimizers.Optimizer) and all(
                value is not known for known in found.values()):
            found[name] = value
    return found


def scaled(gradient: Any, share: tf.Tensor) -> Any:
    """A gradient (dense or sparse) times this rank's share."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * tf.cast(share, gradient.values.dtype),
                                gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(share, gradient.dtype)


class OwnStep:
    """The ``TrainingStep`` of a model trained with its own step (see the module doc)."""

    skips_non_finite_updates = False

    def __init__(self, model: keras.Model, collectives: Collectives, keras_element: Any,
                 reduction: GradientReduction = GradientReduction("average"),
                 zero_stage: int = 0, global_batch: int = 1, remat: Remat | None = None,
                 powersgd_rank: int = 0, seed: int = 0) -> None:
        """``keras_element(x, y, sample_weight)``: the batch as Keras ``fit`` would hand it to
        ``train_step`` for this data (``x``, ``(x, y)`` or ``(x, y, sample_weight)``);
        ``reduction``: how the optimizers combine gradients (average, or Adasum of the ranks'
        mean gradients; fp16 or bf16 on the wire); ``zero_stage`` > 0: the optimizers' state sharded
        (``optimizers.zero``); ``global_batch``: what the ranks' shares are counted against;
        ``remat``: Keras' rematerialisation for the run (``model_memory``);
        ``powersgd_rank`` > 0: PowerSGD compresses what it can of every optimizer's gradients
        (``optimizers.powersgd``; ``seed`` draws its first Q's)."""
        self.model = model
        self.collectives = collectives
        self.optimizers = owned_optimizers(model)
        self.optimizer = next(iter(self.optimizers.values()), None)
        self.keras_element = keras_element
        self.reduction = reduction
        self.bucket_candidates: tuple[GradientReduction, GradientReduction] | None = None
        self._sharding = (Sharding(collectives, zero_stage, reduction) if zero_stage else None)
        self.layer_memory = LayerMemory(model, self._sharding, remat)
        self.saved_state: SavedState | None = None
        self.powersgd = (PowerSGD(model.trainable_variables, powersgd_rank, seed)
                         if powersgd_rank else None)
        self._model_step = type(model).train_step.__get__(model)
        self._global_batch = float(global_batch)
        # This rank's share of the step being traced (set by ``keras_step``, read by the
        # optimizers' reduction inside the same step).
        self._share: tf.Tensor | None = None
        self.global_loss = tf.Variable(0.0, trainable=False, dtype=tf.float32)
        self.votes = StopVotes()

    def gradient_bytes(self) -> int:
        """The reduced gradients of the weights the optimizers train (pieces, sharded), and
        PowerSGD's state."""
        compression = self.powersgd.state_bytes() if self.powersgd is not None else 0
        return gradient_bytes_kept(self._sharding, self.model.trainable_variables) + compression

    @contextlib.contextmanager
    def training(self, ends: RunEnd = RunEnd()) -> Iterator[None]:
        """While the block runs, the model's optimizers average gradients across ranks (and
        hold pieces of their state, sharded)."""
        with contextlib.ExitStack() as stack:
            memory_for_the_run(stack, self, self._sharding, (), ends)
            if self._sharding is None:
                stack.enter_context(distributed_for_the_run(list(self.optimizers.values()),
                                                            self.reduction, self._reduce))
            yield

    def _reduce(self, gradients: Any, reduction: GradientReduction,
                variables: Any) -> list[Any]:
        """The optimizers' exchange: averaged gradients weighted by each rank's share of the
        global batch (summed, over the summed shares; PowerSGD's approximated); Adasum
        combines the ranks' own."""
        share = self._share
        # The buckets the step is traced with now (``bucket_choice`` may have changed them
        # since the optimizers took ``reduction``).
        reduction = dataclasses.replace(reduction, bucket_bytes=self.reduction.bucket_bytes)
        if reduction.op != "average" or share is None:
            return self.collectives.reduce_gradients(gradients, reduction)
        summing = dataclasses.replace(reduction, op="sum")
        weighted = [None if g is None else scaled(g, share) for g in gradients]
        if self.powersgd is not None:
            reduced, (total,) = self.powersgd.reduced(self.collectives, weighted, variables,
                                                      summing, [share])
        elif reduction.compression != "none":    # the share must not be rounded
            total = self.collectives.allreduce_sum([share])[0]
            reduced = self.collectives.reduce_gradients(weighted, summing)
        else:
            *reduced, total = self.collectives.reduce_gradients([*weighted, share], summing)
        return divided(reduced, total)

    def keras_step(self, data: Any) -> dict[str, Any]:
        x, y, sample_weight, weights = data
        self._share = tf.cast(real_rows(weights), tf.float32) / self._global_batch
        with found_by_every_rank(), batch_rows(weights > 0), self.layer_memory.reads_guarded():
            # (a filler counts in no synchronized BN statistics)
            logs = self._model_step(self.keras_element(x, y, sample_weight))
        if not isinstance(logs, dict):
            logs = {"loss": logs}
        return self._agreed(logs)

    def _agreed(self, logs: dict[str, Any]) -> dict[str, Any]:
        """The step's scalar logs averaged across ranks, with the votes in the same
        allreduce."""
        names = [name for name, value in logs.items() if scalar(value)]
        values = [tf.cast(logs[name], tf.float32) for name in names]
        summed = self.collectives.allreduce_sum([*values, *self.votes.to_reduce()])
        totals = summed[:len(values)]
        self.votes.take_reduced(summed[len(values):])
        size = float(self.collectives.world.size)
        agreed = dict(logs)
        agreed.update({name: total / size for name, total in zip(names, totals)})
        if "loss" in names:
            self.global_loss.assign(agreed["loss"])
        return agreed

    @property
    def epoch_state_variables(self) -> list[Any]:
        return metric_variables(self.model)

    def begin_epoch(self) -> None:
        self.model.reset_metrics()

    def _global_logs(self, logs: dict[str, Any]) -> dict[str, float]:
        """Each scalar log from the global metric of its name, else the mean over ranks."""
        results = global_metric_results(self.model, self.collectives)
        others = [name for name, value in logs.items() if name not in results and scalar(value)]
        means = self.collectives.allreduce_sum([tf.constant(float(logs[name]), tf.float32)
                                                for name in others])
        size = self.collectives.world.size
        agreed = {name: results[name] for name in logs if name in results}
        agreed.update({name: float(total) / size for name, total in zip(others, means)})
        return agreed

    def epoch_results(self, logs: dict[str, Any]) -> dict[str, float]:
        return self._global_logs(logs)

    def validation(self) -> Callable[[Any], dict[str, float]]:
        """The model's own ``test_step`` (``evaluate``), its logs named ``val_*``."""
        return lambda dataset: {"val_" + name: value
                                for name, value in self.evaluate(dataset).items()}

    def evaluate(self, dataset: tf.data.Dataset) -> dict[str, float]:
        """The model's ``test_step`` over this rank's share, then the exact global values."""
        batches = dataset.map(lambda x, y, sample_weight, _: self.keras_element(x, y,
                                                                                sample_weight))
        logs = self.model.evaluate(batches, verbose=0, return_dict=True)
        return self._global_logs(logs)
