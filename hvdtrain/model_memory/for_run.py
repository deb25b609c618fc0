"""What the model's layers hold during the run's steps, as the config asks: ZeRO stage 3's
gathered weights (``gathered``) and Keras' rematerialisation (``remat``), both entered around
the run by the step."""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator, Sequence

import keras

from hvdtrain.model_memory.gathered import GatheredLayers
from hvdtrain.model_memory.remat import Remat, Rematerialized
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
    def for_the_run(self, optimizers: Sequence[keras.optimizers.Optimizer]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.gathered is not None:
                stack.enter_context(self.gathered.for_the_run(optimizers))
            if self.remat is not None:
                stack.enter_context(self.remat.for_the_run())
            yield
