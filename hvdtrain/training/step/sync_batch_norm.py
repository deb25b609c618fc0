"""Batch normalisation over the global batch: Keras' ``BatchNormalization(synchronized=True)``
(and, with ``--sync-batch-norm``, every one of the model's batch-norm layers) normalises each
step by the statistics of all ranks' rows together, so N ranks x b rows compute what one
process with N x b rows computes.

Keras synchronises only across the replicas of a ``tf.distribute`` strategy; under hvdtrain
there is none, and each rank would use its own b rows. For the run, Keras' function behind
``ops.moments(..., synchronized=True)`` is replaced (``keras_internals.sync_moments_replaced``)
by one that sums each rank's per-channel sum, sum of squares and count across ranks in one
``differentiable_sum``: the mean and variance are then E(x) and E(x^2) - E(x)^2 over the
global batch, as Keras' own synchronized path computes them, and the backward pass sums the
ranks' upstream gradients of those sums, so every rank's rows receive their terms of every
rank's loss. The counts are summed, never assumed: ranks may hold different numbers of real
rows in a step (the last global batch), and rows the step marks as filler (``batch_rows``)
count in nothing.

Only batch-norm layers are switched by ``--sync-batch-norm`` (``synchronized`` set on each,
put back after the run): Keras' ``ops.moments`` also serves layer and group normalisation,
whose statistics are per example and must never be summed across ranks.

The collectives run in the forward pass, in the same order on every rank (the layers' order,
then the reverse in the backward pass, before the gradient buckets): Horovod matches them by
name, TensorFlow's run in program order (they share the group's ordering token; only the
gradient buckets have tokens of their own), so neither waits on a bucket. XLA cannot compile
them: a step compiled with ``jit_compile=True`` is refused (``batch_norm_note``).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import keras
import tensorflow as tf

from hvdtrain.collectives import Collectives, differentiable_sum
from hvdtrain.errors import AgreedError
from hvdtrain.keras_internals import sublayers, sync_moments_replaced

# The real rows of the batch whose forward pass is being traced (``batch_rows``).
_REAL_ROWS: contextvars.ContextVar[Any] = contextvars.ContextVar("hvdtrain_real_rows",
                                                                 default=None)


def batch_norm_layers(model: keras.Model) -> list[keras.layers.BatchNormalization]:
    """Every batch-norm layer inside ``model``, nested models' included."""
    return [layer for layer in sublayers(model)
            if isinstance(layer, keras.layers.BatchNormalization)]


def batch_norm_note(model: keras.Model, world_size: int, global_batch: int,
                    every_layer: bool, xla: bool = False) -> str | None:
    """The run's one line about batch normalisation that sees only a rank's rows (None when
    there is none: one rank, no such layer, or every layer synchronized). ``xla``: the step's
    forward pass is compiled by XLA, which cannot run a collective, so a synchronized layer on
    two or more ranks is refused (every rank alike, before training)."""
    if world_size < 2:
        return None
    layers = batch_norm_layers(model)
    if xla and any(every_layer or layer.synchronized for layer in layers):
        raise AgreedError("synchronized BatchNormalization exchanges statistics across ranks "
                          "in the forward pass, which XLA cannot compile; compile the model "
                          "with jit_compile=False, or leave batch normalisation per rank")
    own = [layer for layer in layers if not (every_layer or layer.synchronized)]
    if not own:
        return None
    rows = global_batch // world_size
    return (f"note: {len(own)} BatchNormalization layer(s) normalise by each rank's own batch "
            f"({rows} rows), not by the global batch ({global_batch} rows) as one process "
            "would; --sync-batch-norm (sync_batch_norm=True), or synchronized=True in the "
            "layer, uses the global batch's statistics")


@contextlib.contextmanager
def batch_rows(real: tf.Tensor) -> Iterator[None]:
    """Around the forward pass of a step: ``real`` (a boolean vector, one per row of the batch)
    says which rows are real; filler rows (a rank with no real row of the step still runs it)
    then count in no synchronized statistics. Read while the pass is traced."""
    token = _REAL_ROWS.set(real)
    try:
        yield
    finally:
        _REAL_ROWS.reset(token)


@contextlib.contextmanager
def synchronized_batch_norm(model: keras.Model, collectives: Collectives,
                            every_layer: bool) -> Iterator[None]:
    """For the block (the run's training): synchronized batch normalisation computes the
    global batch's statistics across ``collectives``' ranks; ``every_layer``: every
    batch-norm layer of ``model`` is synchronized (each layer's ``synchronized`` put back
    afterwards). Nothing changes for a model without such a layer."""
    layers = batch_norm_layers(model)
    if not any(every_layer or layer.synchronized for layer in layers):
        yield
        return
    before = [layer.synchronized for layer in layers]
    for layer in layers:
        layer.synchronized = layer.synchronized or every_layer
    try:
        with sync_moments_replaced(lambda x, axes, keepdims: global_moments(
                collectives, x, axes, keepdims)):
            yield
    finally:
        for layer, synchronized in zip(layers, before):
            layer.synchronized = synchronized


def global_moments(collectives: Collectives, x: tf.Tensor, axes: Any,
                   keepdims: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """Mean and variance of ``x`` over ``axes`` and every rank's real rows: Keras' own
    synchronized statistics (E(x), E(x^2) - E(x)^2, a zero count giving zeros), their sums
    taken across ranks in one differentiable allreduce."""
    axes = [axis % x.shape.rank for axis in axes]
    real = _row_mask(x, axes)
    values = x if real is None else tf.where(real, x, tf.zeros_like(x))
    ones = tf.ones_like(x) if real is None else tf.cast(tf.broadcast_to(real, tf.shape(x)),
                                                        x.dtype)
    local = tf.stack([tf.reduce_sum(values, axis=axes, keepdims=True),
                      tf.reduce_sum(tf.square(values), axis=axes, keepdims=True),
                      tf.reduce_sum(ones, axis=axes, keepdims=True)])
    total, squares, count = tf.unstack(differentiable_sum(collectives, [local])[0])
    mean = tf.math.divide_no_nan(total, count)
    variance = tf.maximum(tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


def _row_mask(x: tf.Tensor, axes: list[int]) -> tf.Tensor | None:
    """The real rows (``batch_rows``) as a boolean tensor that broadcasts against ``x``, or
    None when every row counts (no rows given, or the statistics are not over rows). A layer
    that sees k entries per row (a ``TimeDistributed`` one, whose rows are the batch's rows
    times its steps, in row order) repeats each row's flag k times."""
    real = _REAL_ROWS.get()
    if real is None or 0 not in axes:
        return None
    entries, rows = tf.shape(x)[0], tf.shape(real)[0]
    flags = tf.repeat(tf.cast(real, tf.bool), entries // tf.maximum(rows, 1))
    tf.debugging.assert_equal(tf.size(flags), entries, message=(
        "synchronized batch normalisation: the layer's first dimension is not a multiple of "
        "the batch's rows, so its filler rows cannot be told apart"))
    return tf.reshape(flags, [-1] + [1] * (x.shape.rank - 1))
