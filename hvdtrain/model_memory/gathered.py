"""ZeRO stage 3: the model's trainable weights, not only its optimizer's state, held in pieces.

While the run lasts each trainable variable holds only this rank's piece of its elements (the
same cut as stages 1 and 2, ``sharding``); the variable is its own shard, so the optimizer
builds piece-sized state and updates the piece in place. A layer that owns trainable variables
has its ``call`` wrapped for the run: the wrapper all-gathers the layer's pieces into whole
values, lets the layer compute with them, and drops them. The whole values cannot simply stay
alive until the backward pass (TensorFlow keeps every tensor a gradient op reads, which would
hold the whole model again), so the layer's forward pass is recomputed for its gradient
(``tf.recompute_grad``, which Keras' ``remat`` is on TensorFlow): the backward pass gathers
the pieces again, and the gradient of the gather is a reduce-scatter, so each rank receives
its piece of the gradient summed over ranks as soon as the layer's backward pass makes it.

Measured on 2 ranks (25M-parameter residual MLP, Adam): stage 0 peaked at 1,433 MiB per rank,
stage 3 at 1,052; without the recomputation 1,350. The weights after a step equal one
process's with the whole batch to the same rounding as stage 0's allreduce.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import keras
import tensorflow as tf

from hvdtrain.errors import UserError
from hvdtrain.keras_internals import (call_replaced, class_swapped, holding_values,
                                      loop_bodies, own_trainable_variables, reindexed,
                                      stored_value, sublayers)
from hvdtrain.model_memory.recomputed import recomputed
from hvdtrain.optimizers.sharding import Sharding, holders, variable_path
from hvdtrain.optimizers.zero import STOPPED_TOGETHER


def owning_layers(model: keras.Model) -> list[tuple[keras.layers.Layer, list[Any]]]:
    """Each layer that owns trainable variables, with them, in the model's layer order.
    Refuses, in one line, a variable owned by two layers (a tied embedding): its whole value
    would be needed outside the one call that gathers it."""
    found: list[tuple[keras.layers.Layer, list[Any]]] = []
    owner_of: dict[int, str] = {}
    inside_loops = loop_bodies(model)
    for layer in [model, *sublayers(model)]:
        if id(layer) in inside_loops:
            continue
        # A recurrent layer gathers its cells' weights once per call, outside its loop.
        held = (layer.trainable_variables if isinstance(layer, keras.layers.RNN)
                else own_trainable_variables(layer))
        own = [v for v in held if v.trainable]
        for variable in own:
            first = owner_of.setdefault(id(variable), layer.name)
            if first != layer.name:
                raise UserError(f"--zero-stage 3 cannot shard '{variable_path(variable)}': "
                                f"layers '{first}' and '{layer.name}' both use it; untie the "
                                "weight or use --zero-stage 2")
        if own:
            found.append((layer, own))
    return found


class GatheredLayers:
    """The model's trainable weights in this rank's pieces while ``for_the_run`` lasts, each
    owning layer gathering its own whole inside its call. ``sharding`` is the run's (stage 3):
    its pieces and its reduce-scatter, whose scale is the step's reduction's."""

    def __init__(self, model: keras.Model, sharding: Sharding) -> None:
        self.model = model
        self.sharding = sharding
        self.layers = owning_layers(model)
        # The tensors the last wrapped call of this trace started from: the next layer's
        # gather waits for them, so it runs while that layer computes (prefetch of one layer)
        # and never all at once at the step's start (which would hold the whole model).
        self._previous_inputs: list[tf.Tensor] = []
        self._regularizers: dict[int, Callable[[Any], Any]] = {}   # id(variable) -> its own
        self._in_step = 0   # depth of the step's trace
        # The optimizers of a run that left the weights in pieces (``end_in_pieces``).
        self._left_in_pieces: list[Any] | None = None

    def read_refused(self, variable: Any) -> bool:
        """Whether reading ``variable`` now would read this rank's piece as if it were the
        weight: in the step, where it is not held whole (its own layer's gathering call holds
        it whole) and the optimizer is not updating the pieces."""
        return (bool(self._in_step) and not self.sharding.optimizer_at_work
                and isinstance(stored_value(variable), tf.Variable))

    @contextlib.contextmanager
    def reads_guarded(self) -> Iterator[None]:
        """While the step is traced, a weight read outside its layer's call (a penalty on a
        kernel in a model's own ``train_step``, a weight tied into another layer's
        computation) is refused in one line instead of computing with the piece."""
        self._in_step += 1
        try:
            yield
        finally:
            self._in_step -= 1

    @contextlib.contextmanager
    def for_the_run(self, optimizers: Sequence[keras.optimizers.Optimizer],
                    end_in_pieces: bool = False) -> Iterator[None]:
        """Cut every owned variable into its piece and wrap its layer's call; after, unwrap
        and gather each variable whole again, one at a time (a collective), unless the run
        failed on this rank alone (its peers may be gone) or, ``end_in_pieces`` (the process
        ends with the run), it ended normally: the pieces are left for the final save
        (``saved_whole``) until ``whole_again``. Keras indexes a built optimizer's state by
        its variables' TensorFlow variables, which cutting and joining replace:
        ``optimizers`` are indexed again after each."""
        variables = self._variables
        self.sharding.cut_in_place(variables)
        _reindexed(optimizers)
        whole_again = False
        try:
            with contextlib.ExitStack() as calls:
                calls.enter_context(self._regularizers_in_the_calls(variables))
                for variable in variables:
                    calls.enter_context(class_swapped(variable, _guarded(type(variable), self)))
                for layer, own in self.layers:
                    calls.enter_context(call_replaced(layer, self._wrapped(layer, own)))
                yield
            whole_again = not end_in_pieces
            if end_in_pieces:
                self._left_in_pieces = list(optimizers)
        except STOPPED_TOGETHER:
            whole_again = True
            raise
        finally:
            if whole_again:
                self._joined(optimizers)

    @property
    def left_in_pieces(self) -> bool:
        """Whether the run ended with the weights in pieces (``end_in_pieces``)."""
        return self._left_in_pieces is not None

    def whole_again(self) -> None:
        """The weights a run left in pieces (``end_in_pieces``) whole again, one at a time (a
        collective): for a validation after the run, which computes with the whole model."""
        if self._left_in_pieces is not None:
            self._joined(self._left_in_pieces)
            self._left_in_pieces = None

    @property
    def _variables(self) -> list[Any]:
        """Every owned variable, in the layers' order."""
        return [v for _, own in self.layers for v in own]

    def _joined(self, optimizers: Sequence[keras.optimizers.Optimizer]) -> None:
        self.sharding.join_in_place(self._variables)
        _reindexed(optimizers)

    @contextlib.contextmanager
    def _regularizers_in_the_calls(self, variables: Sequence[Any]) -> Iterator[None]:
        """Keras applies a weight's regularizer to the variable when the model's losses are
        read, after the forward pass: it would see the piece. For the run each regularizer
        moves into its layer's call, applied to the gathered whole (``_wrapped``)."""
        self._regularizers = {id(v): v.regularizer for v in variables if v.regularizer}
        try:
            for variable in variables:
                variable.regularizer = None
            yield
        finally:
            for variable in variables:
                variable.regularizer = self._regularizers.get(id(variable))
            self._regularizers = {}

    def _wrapped(self, layer: keras.layers.Layer, own: list[Any]) -> Callable[..., Any]:
        original = layer.call

        def call(*args: Any, **kwargs: Any) -> Any:
            prefetch_after = self._previous_inputs
            self._previous_inputs = [leaf for leaf in tf.nest.flatten((args, kwargs))
                                     if tf.is_tensor(leaf)]

            @contextlib.contextmanager
            def gathered(first: bool, tensors: list[tf.Tensor]) -> Iterator[list[Any]]:
                # In the forward pass the gather may start once the previous layer's inputs
                # exist; recomputed for the gradient, once this layer's inputs (which
                # tf.recompute_grad makes wait for the incoming gradient) do. The weights'
                # regularizers apply to the wholes and leave as outputs of the call.
                whole = self._gathered(own, prefetch_after if first else tensors)
                regularization: list[Any] = []
                with holding_values(own, whole, [self.sharding.whole_shape(v) for v in own]):
                    yield regularization
                    regularization.extend(self._regularizers[id(v)](value)
                                          for v, value in zip(own, whole)
                                          if id(v) in self._regularizers)

            return recomputed(layer, original, args, kwargs, around=gathered)

        return call

    def _gathered(self, variables: Sequence[Any], after: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Every rank's pieces of ``variables`` as whole values (one grouped all-gather, issued
        after ``after``); its gradient is this rank's piece of the gradients summed over ranks
        (one grouped reduce-scatter)."""
        sharding = self.sharding

        @tf.custom_gradient
        def gathered(*pieces: tf.Tensor) -> Any:
            with tf.control_dependencies(list(after)):
                every = sharding.collectives.allgather([tf.identity(p) for p in pieces])
            whole = [sharding.pieces[id(v)].whole(values, sharding.whole_shape(v))
                     for v, values in zip(variables, every)]

            def gradient(*upstream: Any) -> list[Any]:
                return sharding.scatter(list(upstream), variables)

            return whole, gradient

        return gathered(*[tf.convert_to_tensor(stored_value(v)) for v in variables])


def _guarded(variable_class: type, layers: GatheredLayers) -> type:
    """``variable_class`` for the run: its ``value`` (every op on the variable, its
    ``numpy``) refused where ``layers.read_refused``; its ``handle`` (how a gradient tape
    names it, not a read) left as it was."""

    class Guarded(variable_class):   # type: ignore[misc, valid-type]
        @property
        def value(self) -> Any:
            if layers.read_refused(self):
                raise UserError(f"--zero-stage 3 holds '{self.path}' in pieces outside its "
                                "layer's call, and the step reads it there (a penalty on it, "
                                "or a weight tied into another layer); read it inside that "
                                "layer's call (add_loss, a regularizer), or use --zero-stage 2")
            return super().value

        @property
        def handle(self) -> Any:
            return stored_value(self).handle

    Guarded.__name__ = Guarded.__qualname__ = variable_class.__name__
    return Guarded


def _reindexed(optimizers: Sequence[keras.optimizers.Optimizer]) -> None:
    for optimizer in optimizers:
        for inner in holders(optimizer):
            if inner.built:
                reindexed(inner)
