"""What a step holds while it trains, set up alike for hvdtrain's step and a model's own: the
layers' memory (ZeRO stage 3's pieces, ``--remat``), the sharded optimizers, a resumed run's
state loaded into the pieces, and what may stay in pieces when the run ends (``RunEnd``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import keras

from hvdtrain.model_memory.for_run import LayerMemory
from hvdtrain.optimizers.sharding import Sharding
from hvdtrain.optimizers.state_into_pieces import SavedState, load_into_pieces
from hvdtrain.optimizers.zero import sharded_for_the_run


@dataclass(frozen=True)
class RunEnd:
    """What may stay in pieces after a run that ends normally, because the process ends with
    it and rank 0's final save gathers them as it writes: the sharded optimizers' state
    (``zero``) and, at stage 3, the model's weights (``model_memory``; only when the model is
    saved as it trained, in float32)."""

    optimizer_in_pieces: bool = False
    weights_in_pieces: bool = False


class Holding(Protocol):
    """What of a step (``core.TrainingStep``) its memory set-up reads."""

    model: keras.Model
    layer_memory: LayerMemory
    saved_state: SavedState | None

    @property
    def optimizers(self) -> dict[str, keras.optimizers.Optimizer]:
        """Every optimizer the step applies."""


def memory_for_the_run(stack: contextlib.ExitStack, step: Holding, sharding: Sharding | None,
                       variables: Sequence[Any], ends: RunEnd) -> None:
    """Enter on ``stack`` what either step holds while it trains: the layers' memory (stage
    3's pieces, ``--remat``) and, sharded, the optimizers in pieces (built for ``variables``
    if not yet), a resumed run's saved state loaded into them once."""
    optimizers = list(step.optimizers.values())
    stack.enter_context(step.layer_memory.for_the_run(optimizers, ends.weights_in_pieces))
    if sharding is None:
        return
    stack.enter_context(sharded_for_the_run(optimizers, sharding, variables,
                                            ends.optimizer_in_pieces))
    if step.saved_state is not None:
        load_into_pieces(step.saved_state, step.optimizers, step.model, sharding)
        step.saved_state = None
