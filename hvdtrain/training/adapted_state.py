"""State that preprocessing layers learn with ``adapt()``, made the same on every rank.

``Normalization``'s mean and variance are weights, so the initial broadcast from rank 0 covers
them. Lookup layers (``StringLookup``, ``IntegerLookup``, ``TextVectorization``) keep their
vocabulary in a table, and ``Discretization`` its bin boundaries in an attribute: no weight
carries them. A model built on every rank from the same data adapts to the same state; one
adapted on something rank-dependent (a sample drawn per rank, a rank's own shard) would map the
same input to different ids on each rank and silently train nonsense. So before training every
rank takes rank 0's: one broadcast of rank 0's vocabularies and boundaries, applied where they
differ (TF-IDF weights are not carried: adapt such a layer on the same data on every rank).
"""

from __future__ import annotations

from typing import Any

import keras

from hvdtrain.collectives import Collectives
from hvdtrain.keras_internals import sublayers

LOOKUPS = (keras.layers.StringLookup, keras.layers.IntegerLookup, keras.layers.TextVectorization)


def _adapted(model: keras.Model) -> list[keras.layers.Layer]:
    return [layer for layer in sublayers(model)
            if isinstance(layer, (*LOOKUPS, keras.layers.Discretization))]


def _state(layer: keras.layers.Layer) -> Any:
    if isinstance(layer, LOOKUPS):
        return [str(token) if isinstance(token, str) else token
                for token in layer.get_vocabulary()]
    return list(layer.bin_boundaries or [])


def _apply(layer: keras.layers.Layer, state: Any) -> None:
    if isinstance(layer, LOOKUPS):
        layer.set_vocabulary(state)
    else:
        layer.bin_boundaries = state


def agree_on_adapted_state(model: keras.Model, collectives: Collectives) -> list[str]:
    """Give every rank rank 0's adapted vocabularies and bin boundaries; return the names of
    the layers that differed here (a collective on every rank, when there are such layers)."""
    layers = _adapted(model)
    if not layers or collectives.world.size == 1:
        return []
    chief = collectives.broadcast_object([_state(layer) for layer in layers])
    changed = []
    for layer, state in zip(layers, chief):
        if _state(layer) != state:
            _apply(layer, state)
            changed.append(layer.name)
    return changed
