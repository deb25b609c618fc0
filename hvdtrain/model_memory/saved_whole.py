"""Rank 0's final save of a model whose weights a ZeRO stage-3 run left in pieces, with no
rank ever holding the whole model.

Keras' save walks the model's saveables (layers, optimizers, metrics) and asks each to store
its own variables. For the save, each layer that owns pieces stores its variables holding
their whole values, gathered from every rank just before (one layer at a time), and a sharded
optimizer stores its state from its stream of gathered variables (``zero.saved_from_pieces``).
Every rank must take part in each gather, in the order rank 0's save asks for them: each rank
walks the model as Keras' save does, with a store that keeps nothing, to learn that order
(``keras_internals.saving_walked``); rank 0 then saves, taking each gathered layer from the
lockstep as Keras reaches it, while the other ranks take part in the same gathers and keep
nothing. Whatever rank 0's save did not ask for (it failed, or it saved a model's weights
alone), every rank gathers after, so no rank is left waiting.

Measured (bench README): at 2.5x the parameters stage 0 trains within a rank's memory, the
whole-weight join that used to precede the save was what ended the run over its limit.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Sequence

import keras
import numpy as np

from hvdtrain.checkpoints.store import drain
from hvdtrain.keras_internals import (holding_values, method_replaced, own_trainable_variables,
                                      saving_walked, sublayers)
from hvdtrain.log import logger
from hvdtrain.optimizers.sharding import Sharding


class SaveOutOfOrder(RuntimeError):
    """Keras' save asked for a saveable's variables out of the order every rank gathers in
    (the walk changed between the ranks' walk and rank 0's save)."""


@contextlib.contextmanager
def saved_in_lockstep(model: keras.Model, sharding: Sharding,
                      optimizer_streams: Sequence[tuple[Any, Iterator[np.ndarray]]]
                      ) -> Iterator[None]:
    """Around rank 0's save of ``model`` (every rank enters it; rank 0 saves inside): each
    layer holding pieces stores whole values gathered as Keras' save reaches it, and each
    optimizer of ``optimizer_streams`` consumes its stream there. After the block every rank
    finishes the gathers rank 0's save left (all of them, on the other ranks)."""
    pieces_of = [(layer, [v for v in own_trainable_variables(layer) if sharding.in_pieces(v)])
                 for layer in [model, *sublayers(model)]]
    layers = [layer for layer, own in pieces_of if own]
    owned = {id(layer): own for layer, own in pieces_of if own}   # the pieces each stores
    streams = {id(optimizer): stream for optimizer, stream in optimizer_streams}
    order: list[Any] = []
    lockstep: Iterator[tuple[Any, list[Any] | None]] | None = None

    def replaced(saveable: Any) -> Callable[[Any], None]:
        original = saveable.save_own_variables
        own = owned.get(id(saveable), [])

        def save_own_variables(store: Any) -> None:
            if lockstep is None:   # the walk: learn the order
                order.append(saveable)
                return
            expected, wholes = next(lockstep, (None, None))
            if expected is not saveable:
                raise SaveOutOfOrder(f"hvdtrain: Keras' save reached '{saveable.name}' out "
                                     "of the order the ranks gather ZeRO stage 3's pieces in")
            with holding_values(own, wholes or [], [sharding.whole_shape(v) for v in own]):
                original(store)

        return save_own_variables

    def gathers() -> Iterator[tuple[Any, list[Any] | None]]:
        for saveable in order:
            if id(saveable) in owned:
                yield saveable, [sharding.whole_value(v) for v in owned[id(saveable)]]
            else:   # an optimizer: its own stream, then whatever the save left of it
                yield saveable, None
                drain(streams[id(saveable)])

    with contextlib.ExitStack() as methods:
        for saveable in [*layers, *(optimizer for optimizer, _ in optimizer_streams)]:
            methods.enter_context(method_replaced(saveable, "save_own_variables",
                                                  replaced(saveable)))
        saving_walked(model)
        lockstep = gathers()
        if sharding.world.is_chief and owned:
            logger.info(f"ZeRO stage 3: the model's weights saved from their pieces, one layer "
                        f"gathered at a time ({len(owned)} layers; no rank holds the whole "
                        "model)")
        try:
            yield
        finally:
            drain(lockstep, quietly=sys.exc_info()[1] is not None)
