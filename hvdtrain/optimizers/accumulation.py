"""Gradient accumulation, written once: sums of each micro-step's values kept in variables and
handed on at every k-th micro-step, then zeroed. hvdtrain's own step accumulates its gradients
and loss here, a distributed optimizer (a model's own step, the drop-in's
``backward_passes_per_step``) the gradients it is given."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf


class Accumulation:
    """Running sums over micro-steps, one variable per value (``dtypes``: each sum's type, the
    value's own by default), created outside any ``tf.function`` that builds it."""

    def __init__(self, shapes: Sequence[Any], dtypes: Sequence[Any], passes: int) -> None:
        with tf.init_scope():
            self.totals = [tf.Variable(tf.zeros(shape, dtype), trainable=False,
                                       name="hvdtrain_accumulated")
                           for shape, dtype in zip(shapes, dtypes)]
            self.calls = tf.Variable(0, dtype=tf.int64, trainable=False,
                                     name="hvdtrain_backward_passes")
        self.passes = passes

    def add(self, values: Sequence[Any]) -> None:
        """One micro-step's values added (a None value adds nothing)."""
        for total, value in zip(self.totals, values):
            if value is not None:
                total.assign_add(tf.cast(tf.convert_to_tensor(value), total.dtype))
        self.calls.assign_add(1)

    def at_the_last_pass(self, use: Callable[[list[tf.Tensor]], None]) -> None:
        """At every ``passes``-th micro-step: ``use(the sums)``, then the sums start again from
        zero (also after non-finite values); graph-safe."""
        def use_and_reset() -> tf.Tensor:
            totals = [tf.identity(total) for total in self.totals]
            use(totals)
            with tf.control_dependencies(totals):
                for total in self.totals:
                    total.assign(tf.zeros_like(total))
            return tf.constant(True)

        tf.cond(self.calls % self.passes == 0, use_and_reset, lambda: tf.constant(False))
