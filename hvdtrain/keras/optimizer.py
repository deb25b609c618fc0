"""``DistributedOptimizer`` for Keras 3: the user's optimizer, with gradients combined across
ranks before every update.

As in Horovod, the result is an instance of a class made on the fly: a subclass of the user's
optimizer class with the same name (so ``isinstance`` checks, ``get_config``/``from_config``
and a saved model's optimizer entry stay the optimizer's own). Only ``apply`` is overridden;
Keras 3 routes ``apply_gradients`` and ``model.fit`` through it. The gradients are reduced
by the trainer's ``reduce_gradients`` (``hvdtrain.world``).

``backward_passes_per_step=k`` adds k calls' gradients up locally (in variables outside
``optimizer.variables``, so saved models and broadcasts do not carry them) and reduces and
applies them at every k-th call; the other calls change nothing else. ``iterations`` therefore
counts applied updates, as Keras 3's own gradient accumulation does (Horovod's counted calls).
With a ``LossScaleOptimizer`` the scaled gradients are reduced before its finiteness check, so
every rank makes the same skip-or-apply decision and keeps the same loss scale.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import keras
import tensorflow as tf

from hvdtrain.tensorflow import Average, Compression, gradient_reduction, reduce_gradients
from hvdtrain.world import GradientReduction


class _ReducingOptimizer:
    """Mixed in before the user's optimizer class; settings are class attributes, so
    ``from_config`` on the class makes another optimizer that reduces the same way."""

    _hvdtrain_reduction: GradientReduction
    _hvdtrain_passes: int
    _hvdtrain_average_passes: bool
    _hvdtrain_accumulated: list[tf.Variable] | None = None

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
            apply_locally(reduce_gradients(grads, self._hvdtrain_reduction), variables)
            return
        accumulated = self._hvdtrain_accumulators(variables)
        for total, gradient in zip(accumulated, grads):
            if gradient is not None:
                total.assign_add(tf.cast(tf.convert_to_tensor(gradient), total.dtype))
        self._hvdtrain_calls.assign_add(1)

        def reduce_and_apply() -> tf.Tensor:
            totals = [tf.identity(total) for total in accumulated]
            if self._hvdtrain_average_passes:
                totals = [total / self._hvdtrain_passes for total in totals]
            apply_locally(reduce_gradients(totals, self._hvdtrain_reduction), variables)
            with tf.control_dependencies(totals):
                for total in accumulated:   # a fresh start, even after non-finite gradients
                    total.assign(tf.zeros_like(total))
            return tf.constant(True)

        tf.cond(self._hvdtrain_calls % self._hvdtrain_passes == 0, reduce_and_apply,
                lambda: tf.constant(False))

    def _hvdtrain_accumulators(self, variables: list[Any]) -> list[tf.Variable]:
        if self._hvdtrain_accumulated is None:
            with tf.init_scope():
                self._hvdtrain_accumulated = [
                    tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                name="hvdtrain_accumulated") for v in variables]
                self._hvdtrain_calls = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                   name="hvdtrain_backward_passes")
        return self._hvdtrain_accumulated


@functools.cache
def reducing_class(optimizer_class: type, reduction: GradientReduction, passes: int,
                   average_passes: bool) -> type:
    """The subclass of ``optimizer_class`` that reduces gradients so (one per setting)."""
    return type(optimizer_class.__name__, (_ReducingOptimizer, optimizer_class), {
        "__module__": optimizer_class.__module__,
        "__qualname__": optimizer_class.__qualname__,
        "_hvdtrain_reduction": reduction,
        "_hvdtrain_passes": passes,
        "_hvdtrain_average_passes": average_passes,
    })


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = Average,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False
                         ) -> keras.optimizers.Optimizer:
    """Horovod's ``DistributedOptimizer`` on any Keras 3 optimizer (including
    ``LossScaleOptimizer`` and optimizers with a learning-rate schedule): a new optimizer of
    the same class and configuration; the one passed in is left as it was.

    op: ``Average`` (default), ``Sum`` or ``Adasum``; compression: ``Compression.none`` or
    ``Compression.fp16``; sparse_as_dense: densify ``IndexedSlices`` gradients before the
    allreduce (else they are allgathered); gradient_predivide_factor f: divide by f before the
    sum and by size/f after it; backward_passes_per_step k: reduce and apply every k-th call
    the sum of the k calls' gradients, divided by k if ``average_aggregated_gradients``.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer wraps a Keras 3 optimizer, got {optimizer!r}")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be > 0")
    reduction = gradient_reduction(op, compression, sparse_as_dense, gradient_predivide_factor)
    cls = reducing_class(type(optimizer), reduction, int(backward_passes_per_step),
                         bool(average_aggregated_gradients))
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return cls.from_config(config)
