"""What the model's layers hold during the run's steps, as the config asks: ZeRO stage 3's
gathered weights (``gathered``) and Keras' rematerialisation (``remat``), both entered around
the run by the step."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Sequence

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.collectives import variable_bytes
from hvdtrain.model_memory.gathered import GatheredLayers
from hvdtrain.model_memory.remat import Remat, Rematerialized
from hvdtrain.model_memory.saved_whole import saved_in_lockstep
from hvdtrain.optimizers.sharding import Sharding


class LayerMemory:
    """``sharding`` at stage 3: each layer that owns weights gathers them in its call;
    ``remat``: the other layers recompute what Keras' mode chooses (a gathering layer
    recomputes its call already)."""

    def __init__(self, model: keras.Model, sharding: Sharding | None,
                 remat: Remat | None) -> None:
        self.gathered = (GatheredLayers(model, sharding)
                         if sharding is not None and sharding.stage == 3 else None)
        gathering = [id(layer) for layer, _ in self.gathered.layers] if self.gathered else []
        self.remat = Rematerialized(model, remat, gathering) if remat is not None else None

    @property
    def gathers(self) -> bool:
        """Whether the weights are in pieces (the gradients leave the backward pass
        reduce-scattered)."""
        return self.gathered is not None

    def reads_guarded(self) -> ContextManager[None]:
        """Around the step's trace: stage 3 refuses a weight read outside its layer's call."""
        return self.gathered.reads_guarded() if self.gathered else contextlib.nullcontext()

    @contextlib.contextmanager
    def for_the_run(self, optimizers: Sequence[keras.optimizers.Optimizer],
                    end_in_pieces: bool = False) -> Iterator[None]:
        """``end_in_pieces``: stage 3's weights stay in pieces after a run that ends normally
        (the process ends with it; ``saved_whole`` saves them)."""
        with contextlib.ExitStack() as stack:
            if self.gathered is not None:
                stack.enter_context(self.gathered.for_the_run(optimizers, end_in_pieces))
            if self.remat is not None:
                stack.enter_context(self.remat.for_the_run())
            yield

    def whole_weights(self, variables: Sequence[Any]) -> Iterator[np.ndarray]:
        """Each of ``variables`` (the model's) as a whole array, one at a time: a collective
        where stage 3 holds them in pieces."""
        if self.gathered is not None:
            return self.gathered.sharding.full_weights(variables)
        return (np.asarray(variable) for variable in variables)

    def whole_bytes(self, variables: Sequence[Any]) -> int:
        """The bytes of ``variables`` whole (Keras' save writes them so), also in pieces."""
        if self.gathered is None:
            return variable_bytes(variables)
        whole_shape = self.gathered.sharding.whole_shape
        return sum(int(np.prod(whole_shape(v))) * tf.as_dtype(v.dtype).size for v in variables)

    def whole_again(self) -> None:
        """Weights a run left in pieces whole again (a collective): a validation after it."""
        if self.gathered is not None:
            self.gathered.whole_again()

    def saved_whole(self, model: keras.Model,
                    optimizer_streams: Sequence[tuple[Any, Iterator[np.ndarray]]]
                    ) -> ContextManager[None]:
        """Around rank 0's final save, on every rank: weights left in pieces saved whole one
        layer at a time, in lockstep with the sharded optimizers' streams (``saved_whole``)."""
        if self.gathered is None or not self.gathered.left_in_pieces:
            return contextlib.nullcontext()
        return saved_in_lockstep(model, self.gathered.sharding, optimizer_streams)
