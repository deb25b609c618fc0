"""A layer's call computed again for its gradient (``tf.recompute_grad``), as the first call
computed it.

TensorFlow keeps every tensor a gradient op reads until the backward pass; a recomputed call
keeps only its inputs and runs again inside the backward pass. Keras' ``remat`` wraps a call
in ``tf.recompute_grad``, which in a ``tf.function`` takes no keyword arguments (so on
TensorFlow ``RematScope`` fails on any layer ``fit`` calls with ``training``, measured with
Keras 3.15) and runs the second call outside ``Layer.__call__`` (without the mixed-precision
autocast, and with the seed generators moved on). ``recomputed`` passes the call's tensors as
positional arguments and, in the second call, enters the first call's Keras state again,
starts its seed generators where the first call did, leaves the non-trainable variables
(moving statistics) as the first call left them, and returns the losses the call adds
(``add_loss``) as outputs, so their gradients reach the weights.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

import keras
import tensorflow as tf

from hvdtrain.keras_internals import call_state_kept, losses_taken, seed_states, stored_value

# What the call runs inside, given (whether this is the first call, the call's tensors): a
# context manager yielding a list the caller may add losses to (ZeRO stage 3's gathered
# weights and their regularizers).
Around = Callable[[bool, list[tf.Tensor]], ContextManager[list[Any]]]


@contextlib.contextmanager
def _nothing_around(first: bool, tensors: list[tf.Tensor]) -> Iterator[list[Any]]:
    yield []


def recomputed(layer: keras.layers.Layer, call: Callable[..., Any], args: tuple,
               kwargs: dict[str, Any], around: Around = _nothing_around,
               chosen: Callable[[Callable[..., Any]], Callable[..., Any]] = tf.recompute_grad
               ) -> Any:
    """``call(*args, **kwargs)`` (``layer``'s own call) through ``chosen`` (default
    ``tf.recompute_grad``; Keras' choice for a remat mode, which may return the function
    unchanged), inside ``around``. Returns the call's outputs; the losses it added are added
    to ``layer`` again."""
    flat = tf.nest.flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(flat) if tf.is_tensor(leaf)]
    keras_state = call_state_kept()
    drawn_from: list[tf.Tensor] = []     # where the seed generators stood at the first call
    first = [True]

    def compute(*tensors: tf.Tensor) -> tuple[Any, list[Any]]:
        leaves = list(flat)
        for position, tensor in zip(positions, tensors):
            leaves[position] = tensor
        called_args, called_kwargs = tf.nest.pack_sequence_as((args, kwargs), leaves)
        was_first, first[0] = first[0], False
        with _same_draws(layer, drawn_from, was_first), losses_taken(layer) as added, \
                keras_state(), around(was_first, list(tensors)) as more:
            outputs = call(*called_args, **called_kwargs)
        return outputs, [*added, *more]

    outputs, losses = chosen(compute)(*[flat[i] for i in positions])
    for loss in losses:
        layer.add_loss(loss)
    return outputs


@contextlib.contextmanager
def _same_draws(layer: keras.layers.Layer, drawn_from: list[tf.Tensor],
                first: bool) -> Iterator[None]:
    """The first call notes where ``layer``'s seed generators stand; the call recomputed for
    the gradient starts them there again (a dropout inside draws the same mask) and puts them
    back after, with every other non-trainable variable the layer and its sublayers hold: the
    first call's updates of a batch normalisation's moving statistics are the step's, the
    recomputation's would be a second (measured: 2 ranks, 16 steps, momentum 0.99, the moving
    means 1.85 times stage 0's, as 32 updates give)."""
    states = seed_states(layer)
    if first:
        drawn_from[:] = [tf.identity(state.value) for state in states]
        yield
        return
    seeds = {id(state) for state in states}
    kept = [*states, *(v for v in layer.non_trainable_variables if id(v) not in seeds)]
    now = [tf.identity(stored_value(variable)) for variable in kept]
    for state, value in zip(states, drawn_from):
        state.assign(value)
    yield
    for variable, value in zip(kept, now):
        variable.assign(value)
