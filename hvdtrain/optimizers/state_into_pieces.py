"""A sharded run's resume: the checkpoint's optimizer state, which checkpoints hold whole, loaded
straight into each rank's pieces once the optimizers are built in pieces.

Loaded whole on rank 0 and broadcast, as an unsharded run's is, the state would exist whole on
every rank before the run cuts it: for Adam twice the model, which a model that only fits in
pieces (stage 3's) does not leave room for. Here rank 0 reads one state variable at a time
from the checkpoint, and every rank keeps its piece of it: a reduce-scatter to which rank 0
gives the value and every other rank zeros (adding zeros is exact). So no rank holds more than
one whole state variable at a time, and only rank 0 reads the file (the others need not see
the run directory).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
import keras
import tensorflow as tf

from hvdtrain.checkpoints.store import Checkpoint
from hvdtrain.collectives import chief_decides
from hvdtrain.log import logger
from hvdtrain.optimizers.sharding import Sharding


@dataclass(frozen=True)
class SavedState:
    """The optimizers' state a resumed sharded run is still to load: the checkpoint's
    directory (read by rank 0 alone) and, per optimizer attribute, the model variables (by
    path) it was built for (None: not recorded, the model's trainable ones)."""

    checkpoint: Path
    built_for: dict[str, list[str] | None]


def load_into_pieces(saved: SavedState, optimizers: dict[str, keras.optimizers.Optimizer],
                     model: keras.Model, sharding: Sharding) -> None:
    """Every rank, with ``optimizers`` sharded for the run: each optimizer the checkpoint
    holds state for is built (in pieces) if it is not yet, and given its state, this rank's
    pieces of each sliced variable (collectives, in ``optimizer.variables`` order)."""
    by_path = {v.path: v for v in model.variables}
    checkpoint = Checkpoint(saved.checkpoint)
    collectives = sharding.collectives
    chief = collectives.world.is_chief
    for name, built_for in saved.built_for.items():
        optimizer = optimizers.get(name)
        if optimizer is None:
            continue
        if not optimizer.built:
            optimizer.build([by_path[p] for p in built_for] if built_for is not None
                            else model.trainable_variables)
        variables = optimizer.variables
        owners = [sharding.owners.get(id(v)) for v in variables]
        shapes = [tuple(v.shape) if owner is None else sharding.whole_shape(owner)
                  for v, owner in zip(variables, owners)]
        chief_decides(collectives, lambda: checkpoint.check_optimizer_shapes(name, shapes))
        values = checkpoint.optimizer_values(name) if chief else itertools.repeat(None)
        for variable, owner, value in zip(variables, owners, values):
            if owner is None:   # a step counter, a loss scale: small, whole on every rank
                variable.assign(collectives.broadcast_object(value))
                continue
            piece = sharding.pieces[id(owner)]
            given = (piece.padded(tf.convert_to_tensor(value, variable.dtype)) if chief else
                     tf.zeros([piece.length * piece.ranks], variable.dtype))
            variable.assign(collectives.reduce_scatter_sum([given])[0])
        if chief:
            logger.info(f"ZeRO: optimizer '{optimizer.name}' state loaded from {checkpoint} "
                        "into each rank's pieces, one variable at a time")
