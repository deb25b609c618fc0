"""A Keras 3 optimizer whose updates use gradients combined across ranks: the one mechanism
behind the Horovod drop-in's ``DistributedOptimizer`` and behind a model's own ``train_step``
in the trainer.

As in Horovod, it is a subclass of the user's optimizer class made on the fly, under the same
name, so ``isinstance``, ``get_config`` and saved models stay the optimizer's own; only ``apply``
is overridden (Keras 3 routes ``apply_gradients`` and ``fit`` through it), and an existing
optimizer becomes distributed by changing its class. ``passes`` k > 1 accumulates k calls'
gradients locally and applies every k-th, so ``iterations`` counts updates as in Keras 3. A
``LossScaleOptimizer``'s gradients are reduced before its finiteness check, so ranks agree.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Sequence

import keras
import tensorflow as tf

from hvdtrain.collectives import GradientReduction
from hvdtrain.keras_internals import set_class
from hvdtrain.training.step.accumulation import Accumulation

# How a distributed optimizer combines a list of gradients across ranks (None stays None).
Reducer = Callable[[Sequence[Any], GradientReduction], list[Any]]


class _ReducingOptimizer:
    """Mixed in before the user's optimizer class (see the module doc)."""

    _hvdtrain_reduction: GradientReduction
    _hvdtrain_passes: int
    _hvdtrain_average_passes: bool
    _hvdtrain_reduce: Reducer
    _hvdtrain_accumulation: Accumulation | None = None
    _hvdtrain_accumulated: list[tf.Variable]
    _hvdtrain_calls: tf.Variable

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        grads = list(grads)
        if not grads or (trainable_variables is None and not self.built):
            return super().apply(grads, trainable_variables)   # Keras says what is missing
        variables = list(self._trainable_variables if trainable_variables is None
                         else trainable_variables)
        if not self.built:      # Keras builds lazily; variables may not be created in a tf.cond
            self.build(variables)
        apply_locally = super().apply
        if self._hvdtrain_passes == 1:
            apply_locally(self._hvdtrain_reduce(grads, self._hvdtrain_reduction), variables)
            return
        if self._hvdtrain_accumulation is None:
            self._hvdtrain_accumulation = Accumulation([v.shape for v in variables],
                                                       [v.dtype for v in variables],
                                                       self._hvdtrain_passes)
            # Held by the optimizer too, so tf.train.Checkpoint saves the partial sums and the
            # pass counter with it, under the names the drop-in has always saved them.
            self._hvdtrain_accumulated = self._hvdtrain_accumulation.totals
            self._hvdtrain_calls = self._hvdtrain_accumulation.calls
        accumulation = self._hvdtrain_accumulation
        accumulation.add(grads)

        def reduce_and_apply(totals: list[tf.Tensor]) -> None:
            if self._hvdtrain_average_passes:
                totals = [total / self._hvdtrain_passes for total in totals]
            apply_locally(self._hvdtrain_reduce(totals, self._hvdtrain_reduction), variables)

        accumulation.at_the_last_pass(reduce_and_apply)


def own_class(optimizer: keras.optimizers.Optimizer) -> type:
    """The optimizer's class as its user made it (a distributed optimizer's class is a reducing
    subclass of it), so that making it distributed again replaces the settings instead of
    reducing twice."""
    cls = type(optimizer)
    return cls.__bases__[1] if issubclass(cls, _ReducingOptimizer) else cls


@functools.cache
def reducing_class(optimizer_class: type, reduction: GradientReduction, passes: int,
                   average_passes: bool, reduce: Reducer) -> type:
    """The subclass of ``optimizer_class`` that reduces gradients so (one per setting)."""
    return type(optimizer_class.__name__, (_ReducingOptimizer, optimizer_class), {
        "__module__": optimizer_class.__module__,
        "__qualname__": optimizer_class.__qualname__,
        "_hvdtrain_reduction": reduction,
        "_hvdtrain_passes": passes,
        "_hvdtrain_average_passes": average_passes,
        "_hvdtrain_reduce": staticmethod(reduce),
    })


@contextlib.contextmanager
def distributed_for_the_run(optimizers: Sequence[keras.optimizers.Optimizer],
                            reduction: GradientReduction, reduce: Reducer) -> Iterator[None]:
    """Make each optimizer distributed while the block runs (same object, same variables: only
    its class changes), and give it its own class back afterwards, so the user's model leaves
    the run with the optimizers it came with."""
    originals = [type(optimizer) for optimizer in optimizers]
    for optimizer, cls in zip(optimizers, originals):
        set_class(optimizer, reducing_class(cls, reduction, 1, False, reduce))
    try:
        yield
    finally:
        for optimizer, cls in zip(optimizers, originals):
            set_class(optimizer, cls)
