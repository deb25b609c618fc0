"""``--remat MODE``: Keras' rematerialisation (``keras.RematScope``'s modes) applied to a user's
model for the run.

Keras decides which calls recompute: a mode applies to the layers created inside a
``RematScope``, and each layer's ``rematerialized_call`` chooses (every call for ``full``, the
activation function for ``activations``, by output size for ``larger_than``, by name for
``list_of_layers``). hvdtrain gives each of the user's layers the mode for the run and asks
that method, but executes its choice through ``recomputed``: Keras' own path hands
``tf.recompute_grad`` the call's keyword arguments, which a ``tf.function`` refuses (with
Keras 3.15 on TensorFlow, ``RematScope(mode="full")`` makes ``fit`` fail at its first step),
and recomputes outside the layer's autocast. Layers ZeRO stage 3 already recomputes (those
that own weights: ``gathered``) are left to it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import keras

from hvdtrain.errors import UserError
from hvdtrain.keras_internals import (call_replaced, loop_bodies, remat_mode_held, remat_mode_of,
                                      sublayers)
from hvdtrain.model_memory.recomputed import recomputed


@dataclass(frozen=True)
class Remat:
    """A Keras rematerialisation mode with its settings (``keras.RematScope``'s arguments)."""

    mode: str
    output_size_threshold: int = 1024
    layer_names: tuple[str, ...] = ()

    def scope(self) -> keras.RematScope:
        return keras.RematScope(mode=self.mode, output_size_threshold=self.output_size_threshold,
                                layer_names=list(self.layer_names))


class Rematerialized:
    """While ``for_the_run`` lasts, each of ``model``'s layers (not the models inside it, whose
    layers are themselves layers of it) recomputes what Keras' mode ``remat`` chooses, except
    ``left`` (by id: layers that recompute anyway)."""

    def __init__(self, model: keras.Model, remat: Remat, left: Sequence[int] = ()) -> None:
        self.remat = remat
        self.mode = remat_mode_of(remat.scope())
        inside_loops = loop_bodies(model)   # a recurrent layer recomputes its cells
        every = [layer for layer in sublayers(model)
                 if not isinstance(layer, (keras.Model, keras.layers.InputLayer))]
        self.layers = [layer for layer in every
                       if id(layer) not in set(left) and id(layer) not in inside_loops]
        unknown = set(remat.layer_names) - {layer.name for layer in every}
        if remat.mode == "list_of_layers" and unknown:
            raise UserError(f"--remat-layers names no layer of {model.name}: "
                            f"{', '.join(sorted(unknown))}; give names from model.summary()")

    def describe(self) -> str:
        """The run log's line: which layers recompute (by name, as far as known before the
        first step: ``larger_than`` measures outputs as the step is traced)."""
        mode = self.remat.mode
        if mode == "full":
            chosen = self.layers
        elif mode == "list_of_layers":
            chosen = [layer for layer in self.layers if layer.name in self.remat.layer_names]
        elif mode == "activations":
            chosen = [layer for layer in self.layers if getattr(layer, "activation", None)]
        else:
            return (f"remat larger_than: each of the {len(self.layers)} layers whose output has "
                    f"over {self.remat.output_size_threshold} elements recomputes its call in "
                    "the backward pass (Keras measures each as the step is traced)")
        if not chosen:
            return (f"remat {mode}: no layer left to recompute (ZeRO stage 3 recomputes the "
                    "call of every layer that owns weights already)")
        what = "their activation" if mode == "activations" else "their call"
        names = ", ".join(layer.name for layer in chosen[:12])
        more = f" and {len(chosen) - 12} more" if len(chosen) > 12 else ""
        return (f"remat {mode}: {len(chosen)} layer(s) recompute {what} in the backward pass "
                f"instead of keeping what it made: {names}{more}")

    @contextlib.contextmanager
    def for_the_run(self) -> Iterator[None]:
        with contextlib.ExitStack() as calls:
            for layer in self.layers:
                calls.enter_context(call_replaced(layer, self._wrapped(layer)))
            yield

    def _wrapped(self, layer: keras.layers.Layer) -> Callable[..., Any]:
        original = layer.call
        choosing = [False]

        def call(*args: Any, **kwargs: Any) -> Any:
            if choosing[0]:      # Keras measuring the output (larger_than) calls the call
                return original(*args, **kwargs)

            def keras_choice(function: Callable[..., Any]) -> Callable[..., Any]:
                choosing[0] = True
                try:
                    with remat_mode_held(layer, self.mode):
                        return layer.rematerialized_call(function, *args, **kwargs)
                finally:
                    choosing[0] = False

            return recomputed(layer, original, args, kwargs, chosen=keras_choice)

        return call
