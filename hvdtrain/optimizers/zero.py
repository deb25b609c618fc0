"""ZeRO stages 1 and 2: each rank keeps its optimizer's state for 1/N of every trainable
variable's elements instead of all of them.

Every variable is cut into one piece per rank (``sharding``). A bucket's gradients are
reduce-scattered (the same bytes as the reduce half of a ring-allreduce), the user's optimizer
updates this rank's pieces (``shard`` variables loaded from the weights), and the pieces are
all-gathered back into every rank's weights. The optimizer stays the user's object: while the
run lasts it has a class for the run (``run_class``) with ``_ShardedOptimizer`` mixed in, which
makes its state variables ("slots") piece-sized and maps each piece to its variable, so rates,
schedules, weight-decay exclusions and loss scaling work as written. Stage 2 differs from stage
1 under gradient accumulation: it keeps only the summed pieces between micro-steps. Exact for
elementwise optimizers (``check_shardable`` refuses the others in one line).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.checkpoints.store import drain
from hvdtrain.collectives import static_bytes, variable_bytes
from hvdtrain.errors import (AgreedError, CheckpointWriteFailed, StoppedBySignal, TrainingDiverged,
                             UserError)
from hvdtrain.keras_internals import OptimizerHooks, config_at_a_constant_rate, slot_name
from hvdtrain.log import logger
from hvdtrain.optimizers.run_class import (RunOptimizer, attached, class_for_the_run, give_back,
                                           run_class)
from hvdtrain.optimizers.sharding import Sharding, holders, piece_bytes, variable_path


# The errors every rank raises together (a stop, a divergence, a failed checkpoint write, an
# agreed error): after one, every rank can still take part in gathering the pieces whole.
STOPPED_TOGETHER = (StoppedBySignal, TrainingDiverged, CheckpointWriteFailed, AgreedError)


class _ShardedOptimizer(OptimizerHooks, RunOptimizer):
    """Mixed in before the user's optimizer class while a sharded run lasts; the run's
    ``Sharding`` is attached to the optimizer (``attached``)."""

    def hvdtrain_key(self, key: Any) -> Any:
        """A shard's state is its model variable's (found by the model variable's key)."""
        keys = attached(self).keys
        return keys.get(key, key)

    def add_variable_from_reference(self, reference_variable: Any, name: str | None = None,
                                    initializer: Any = "zeros") -> Any:
        sharding = attached(self)
        owner = sharding.owners.get(id(reference_variable), reference_variable)
        piece = sharding.pieces.get(id(owner))
        if piece is None:
            return super().add_variable_from_reference(reference_variable, name, initializer)
        slot = self.add_variable(shape=(piece.length,), initializer=initializer,
                                 dtype=owner.dtype,
                                 name=slot_name(variable_path(owner), name or "var"))
        sharding.owners[id(slot)] = owner
        return slot

    def build(self, variables: Sequence[Any]) -> None:
        sharding = attached(self)
        sharding.register(variables)
        with sharding.optimizer_working():
            super().build(variables)

    def save_own_variables(self, store: Any) -> None:
        """Keras saving the state: only the final save may, each variable gathered whole as
        it is stored (``saved_from_pieces``); anything else would save this rank's pieces."""
        stream = getattr(self, "_hvdtrain_stream", None)
        if stream is None:
            raise UserError(f"optimizer '{self.name}' holds only this rank's pieces of its "
                            "state under --zero-stage, so Keras cannot save it during the run; "
                            "hvdtrain's checkpoints and final model save it whole (or use "
                            "--zero-stage 0)")
        object.__setattr__(self, "_hvdtrain_stream", None)   # read once: a second save refused
        for index, value in enumerate(stream):
            store[str(index)] = value

    def hvdtrain_clipped(self, grads: Any, keras_clipping: Callable[[Any], Any]) -> Any:
        """Norm clipping with the norms of the whole gradients, not of this rank's pieces."""
        if (self.clipnorm and self.clipnorm > 0) or (self.global_clipnorm and
                                                     self.global_clipnorm > 0):
            return attached(self).clipped(self, grads)
        return keras_clipping(grads)

    def applied_by_keras(self, grads: list[Any], variables: list[Any]) -> bool:
        """Given the pieces (the run's step, or a loss-scale optimizer calling the optimizer
        inside): Keras' own update of them. At stage 3 the model's variables are their pieces:
        Keras' own update only inside the sharding's (which sets the constraints aside)."""
        sharding = attached(self)
        if sharding.stage == 3:
            return not variables or sharding.updating
        return not variables or id(variables[0]) in sharding.owners

    def apply_for_the_run(self, grads: list[Any], variables: list[Any]) -> None:
        """Given the model's variables (a model's own ``train_step``): reduce-scatter, update
        the pieces, all-gather."""
        sharding = attached(self)
        pieces = grads if sharding.stage == 3 else sharding.scatter(grads, variables)
        sharding.update(self, pieces, variables)


def sharded_class(optimizer_class: type) -> type:
    """The subclass of ``optimizer_class`` whose state is this rank's pieces."""
    return run_class(_ShardedOptimizer, optimizer_class)


@contextlib.contextmanager
def sharded_for_the_run(optimizers: Sequence[keras.optimizers.Optimizer], sharding: Sharding,
                        variables: Sequence[Any] = (), end_in_pieces: bool = False
                        ) -> Iterator[None]:
    """Each optimizer (and the one inside a loss-scale optimizer) sharded while the block
    runs, built in pieces for ``variables`` if not built yet (an optimizer built whole before,
    as a restored one is, is cut). When the block ends normally or every rank stopped together
    (a stop, a divergence, a failed checkpoint write), its state is gathered back whole; after
    an error of one rank, whose peers may be gone, it stays in pieces. Its class is restored.
    ``end_in_pieces`` (a run whose process ends with it: no program sees the optimizer after):
    a lone optimizer that ends normally stays sharded, in pieces, for ``saved_from_pieces``."""
    found = [inner for optimizer in optimizers for inner in holders(optimizer)]
    with class_for_the_run(found, sharded_class, sharding) as run:
        whole_again = in_pieces = False
        try:
            for optimizer in optimizers:
                sharding.shard_slots(optimizer)
                if variables and not optimizer.built:
                    optimizer.build(list(variables))
            yield
            in_pieces = end_in_pieces and len(found) == 1
            whole_again = not in_pieces
        except STOPPED_TOGETHER:
            whole_again = True    # every rank stopped together: all can gather
            raise
        finally:
            if in_pieces:
                run.keep()
            elif whole_again:
                for optimizer in optimizers:
                    sharding.unshard_slots(optimizer)


@contextlib.contextmanager
def saved_from_pieces(optimizers: Sequence[keras.optimizers.Optimizer]
                      ) -> Iterator[list[tuple[Any, Iterator[np.ndarray]]]]:
    """Around rank 0's final save, on every rank: an optimizer a run left in pieces
    (``end_in_pieces``) gives Keras' save each state variable whole, gathered as Keras stores
    it, so no rank ever holds the whole state; every rank takes part in each gather (the
    other ranks here; rank 0 as it saves, then here for any its save did not read). Its class
    is restored after; its state stays in pieces (the process is ending). Gives each such
    optimizer with its stream (stage 3's weights join them in the save's order)."""
    left = [optimizer for optimizer in optimizers if isinstance(optimizer, _ShardedOptimizer)]
    streams = [attached(optimizer).full_state(optimizer) for optimizer in left]
    for optimizer, stream in zip(left, streams):
        object.__setattr__(optimizer, "_hvdtrain_stream", stream)
        if attached(optimizer).world.is_chief:
            logger.info(f"ZeRO: optimizer '{optimizer.name}' saved from its pieces, one state "
                        "variable gathered at a time (no rank holds its whole state)")
    try:
        yield list(zip(left, streams))
    finally:
        in_flight = sys.exc_info()[1]
        for optimizer, stream in zip(left, streams):
            try:
                drain(stream, quietly=in_flight is not None)
            finally:   # the class comes back; its state stays in pieces (the process ends)
                if "_hvdtrain_stream" in vars(optimizer):
                    object.__delattr__(optimizer, "_hvdtrain_stream")
                give_back(optimizer)


def _sharding_of(optimizer: keras.optimizers.Optimizer) -> Sharding | None:
    """The sharding of a sharded optimizer (None: not sharded)."""
    return attached(optimizer) if isinstance(optimizer, _ShardedOptimizer) else None


def saved_state_bytes(optimizer: keras.optimizers.Optimizer) -> int:
    """The bytes of ``optimizer``'s state as Keras saves it: whole, also while sharded."""
    sharding = _sharding_of(optimizer)
    owners = sharding.owners if sharding is not None else {}
    return sum(static_bytes(owners.get(id(v), v)) for v in optimizer.variables)


@dataclass(frozen=True)
class WholeState:
    """Sharded optimizers' state for a checkpoint: by attribute, each optimizer's values
    gathered whole one at a time as rank 0 writes them; at stage 3 the model's weights
    likewise (None: the weights are whole); and how it was held
    (``CheckpointState.sharded``)."""

    arrays: dict[str, Iterator[np.ndarray]]
    record: dict[str, int]
    weights: Iterator[np.ndarray] | None = None


def consolidated_state(optimizers: dict[str, keras.optimizers.Optimizer],
                       model: keras.Model) -> WholeState | None:
    """Every sharded optimizer's whole state (and at stage 3 ``model``'s weights), or None
    when no optimizer is sharded. A collective: rank 0 reads it while writing the
    checkpoint; the other ranks take part in each gather here, keeping nothing, and get None
    back."""
    sharded = {name: optimizer for name, optimizer in optimizers.items()
               if isinstance(optimizer, _ShardedOptimizer) and optimizer.built}
    if not sharded:
        return None
    sharding = attached(next(iter(sharded.values())))
    whole = WholeState({name: attached(optimizer).full_state(optimizer)
                        for name, optimizer in sharded.items()},
                       {"zero_stage": sharding.stage, "ranks": sharding.world.size},
                       sharding.full_weights(model.weights) if sharding.stage == 3 else None)
    if sharding.world.is_chief:
        return whole
    for values in [whole.weights or iter(()), *whole.arrays.values()]:
        drain(values)
    return None


def check_shardable(optimizer: keras.optimizers.Optimizer) -> None:
    """Refuse, in one line, an optimizer whose update of an element depends on other elements
    (norms, factored moments, trust ratios): sharded it would compute something else. Found by
    updating a (4, 3) variable whole and as two flat pieces from a copy of the optimizer."""
    inner = holders(optimizer)[-1]
    name = type(inner).__name__
    if getattr(inner, "use_ema", False):
        raise UserError(f"--zero-stage cannot shard optimizer {name} with use_ema (its "
                        "averages replace the weights at the end); use --zero-stage 0")
    if not _updates_elementwise(inner):
        raise UserError(f"--zero-stage cannot shard optimizer {name}: its update of an "
                        "element depends on other elements of the variable (measured on a "
                        "probe variable), so sharded it would train differently; use "
                        "--zero-stage 0")


def _fresh_copy(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """An unbuilt copy without norm clipping (sharded runs clip with the whole norms), at a
    constant rate (a schedule scales every element alike)."""
    try:
        config = config_at_a_constant_rate(optimizer)
        copied = type(optimizer).from_config({**config, "clipnorm": None,
                                              "global_clipnorm": None})
    except (TypeError, ValueError, NotImplementedError, KeyError):
        copied = copy.deepcopy(optimizer)
        copied.clipnorm = copied.global_clipnorm = None
    return copied


def _updates_elementwise(optimizer: keras.optimizers.Optimizer) -> bool:
    generator = np.random.default_rng(0)
    start = generator.normal(size=(4, 3)).astype(np.float32)
    grads = [generator.normal(size=(4, 3)).astype(np.float32) for _ in range(3)]
    whole_optimizer = _fresh_copy(optimizer)
    whole = keras.Variable(start, name="probe")
    cuts = [slice(0, 5), slice(5, 12)]
    # One copy per piece, as each rank applies its own pieces alone.
    parts = [(_fresh_copy(optimizer), keras.Variable(start.ravel()[cut], name="probe"))
             for cut in cuts]
    for grad in grads:
        whole_optimizer.apply([tf.constant(grad)], [whole])
        for cut, (part_optimizer, part) in zip(cuts, parts):
            part_optimizer.apply([tf.constant(grad.ravel()[cut])], [part])
    joined = np.concatenate([part.numpy() for _, part in parts])
    return bool(np.allclose(whole.numpy().ravel(), joined, rtol=1e-6, atol=1e-7))


def describe(stage: int, world_size: int, optimizer: keras.optimizers.Optimizer,
             variables: Sequence[Any]) -> str:
    """The run log's line on sharding: what the optimizer's state costs each rank."""
    full, mine = variable_bytes(variables), piece_bytes(variables, world_size)
    kinds = _slot_kinds(optimizer)
    if stage == 3:
        return (f"ZeRO stage 3: each rank keeps 1/{world_size} of every weight, of its gradient "
                f"and of the optimizer state: {(kinds + 2) * mine / 2**20:.2f} MiB instead of "
                f"{(kinds + 2) * full / 2**20:.2f} MiB; each layer gathers its whole weights "
                "inside its call and again, recomputing the call, for its gradient")
    return (f"ZeRO stage {stage}: each rank keeps the optimizer state for 1/{world_size} of "
            f"every variable: {kinds} x {mine / 2**20:.2f} MiB instead of {kinds} x "
            f"{full / 2**20:.2f} MiB ({type(holders(optimizer)[-1]).__name__} keeps {kinds} "
            "value(s) per weight)")


def _slot_kinds(optimizer: keras.optimizers.Optimizer) -> int:
    """How many values per weight an optimizer of this class keeps (built on a probe)."""
    probe = _fresh_copy(holders(optimizer)[-1])
    variable = keras.Variable(np.zeros((2,), np.float32), name="probe")
    probe.build([variable])
    return sum(1 for slot in probe.variables if tuple(slot.shape) == (2,))
