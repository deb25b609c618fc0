"""A Keras 3 optimizer whose updates use gradients combined across ranks: the one mechanism
behind the Horovod drop-in's ``DistributedOptimizer`` and behind a model's own ``train_step``
in the trainer.

The optimizer is given a class for it by ``run_class`` (same object, same variables: only its
class changes), whose ``apply`` reduces the gradients before Keras' own. ``passes`` k > 1
accumulates k calls' gradients locally and applies every k-th, so ``iterations`` counts updates
as in Keras 3. A ``LossScaleOptimizer``'s gradients are reduced before its finiteness check, so
ranks agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import keras
import tensorflow as tf

from hvdtrain.collectives import GradientReduction
from hvdtrain.optimizers.run_class import Kept, RunOptimizer, class_for_the_run, run_class
from hvdtrain.optimizers.accumulation import Accumulation

# How a distributed optimizer combines a list of gradients across ranks (None stays None),
# given the variables they are the gradients of (PowerSGD keeps state per variable).
Reducer = Callable[[Sequence[Any], GradientReduction, Sequence[Any]], list[Any]]


@dataclass(frozen=True)
class Reducing:
    """A reducing class's setting: how gradients combine, over how many calls (summed, or
    averaged where ``average_passes``), by which function."""

    reduction: GradientReduction
    passes: int
    average_passes: bool
    reduce: Reducer


class _ReducingOptimizer(RunOptimizer):
    """Mixed in before the user's optimizer class (see the module doc)."""

    hvdtrain_settings: Reducing
    _hvdtrain_accumulation: Accumulation | None = None
    _hvdtrain_accumulated: list[tf.Variable]
    _hvdtrain_calls: tf.Variable

    def apply_for_the_run(self, grads: list[Any], variables: list[Any]) -> None:
        setting = self.hvdtrain_settings
        apply_locally = self.keras_apply
        if setting.passes == 1:
            apply_locally(setting.reduce(grads, setting.reduction, variables), variables)
            return
        if self._hvdtrain_accumulation is None:
            self._hvdtrain_accumulation = Accumulation([v.shape for v in variables],
                                                       [v.dtype for v in variables],
                                                       setting.passes)
            # Held by the optimizer too, so tf.train.Checkpoint saves the partial sums and the
            # pass counter with it, under the names the drop-in has always saved them.
            self._hvdtrain_accumulated = self._hvdtrain_accumulation.totals
            self._hvdtrain_calls = self._hvdtrain_accumulation.calls
        accumulation = self._hvdtrain_accumulation
        accumulation.add(grads)

        def reduce_and_apply(totals: list[tf.Tensor]) -> None:
            if setting.average_passes:
                totals = [total / setting.passes for total in totals]
            apply_locally(setting.reduce(totals, setting.reduction, variables), variables)

        accumulation.at_the_last_pass(reduce_and_apply)


def reducing_class(optimizer_class: type, reduction: GradientReduction, passes: int,
                   average_passes: bool, reduce: Reducer) -> type:
    """The subclass of ``optimizer_class`` that reduces gradients so (one per setting)."""
    return run_class(_ReducingOptimizer, optimizer_class,
                     Reducing(reduction, passes, average_passes, reduce))


def distributed_for_the_run(optimizers: Sequence[keras.optimizers.Optimizer],
                            reduction: GradientReduction, reduce: Reducer
                            ) -> ContextManager[Kept]:
    """Make each optimizer distributed while the block runs, and give it its own class back
    afterwards, so the user's model leaves the run with the optimizers it came with."""
    return class_for_the_run(optimizers,
                             lambda cls: reducing_class(cls, reduction, 1, False, reduce))
