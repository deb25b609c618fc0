"""ZeRO stages 1 and 2: each rank keeps its optimizer's state for 1/N of every trainable
variable's elements instead of all of them.

Every variable is flattened, padded to a multiple of the world size and cut into N equal
pieces; rank r owns piece r of each (balanced, as torch-xla's and DeepSpeed's are). A bucket's
gradients are reduce-scattered (the same bytes as the reduce half of a ring-allreduce), the
user's optimizer updates this rank's pieces (``shard`` variables loaded from the weights), and
the pieces are all-gathered back into every rank's weights. The optimizer stays the user's
object: while the run lasts its class gains ``_ShardedOptimizer``, which makes its state
variables ("slots") piece-sized and maps each piece to its variable, so rates, schedules,
weight-decay exclusions and loss scaling work as written. Stage 2 differs from stage 1 under
gradient accumulation: it keeps only the summed pieces between micro-steps. Exact for
elementwise optimizers (``check_shardable`` refuses the others in one line).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.checkpoints.store import drain
from hvdtrain.collectives import Collectives, GradientReduction, static_bytes
from hvdtrain.errors import (AgreedError, CheckpointWriteFailed, StoppedBySignal, TrainingDiverged,
                             UserError)
from hvdtrain.keras_internals import config_at_a_constant_rate, resize_variable, set_class
from hvdtrain.log import logger
from hvdtrain.training.memory import variable_bytes

ZERO_STAGES = (0, 1, 2)


@dataclass(frozen=True)
class Piece:
    """How one variable is cut: ``size`` elements, ``length`` per rank for ``ranks`` ranks (the
    size padded to a multiple of the world size, divided by it)."""

    size: int
    length: int
    ranks: int

    @classmethod
    def of(cls, variable: Any, world_size: int) -> "Piece":
        size = int(np.prod(variable.shape, dtype=np.int64))
        return cls(size, -(-size // world_size), world_size)

    def padded(self, value: Any) -> tf.Tensor:
        """The value flattened (no copy) and padded with zeros to a piece per rank (a copy,
        only where the size does not divide): what a reduce-scatter splits."""
        flat = tf.reshape(value, [-1])
        missing = self.length * self.ranks - self.size
        return tf.pad(flat, [[0, missing]]) if missing else flat

    def own(self, value: Any, rank: int) -> tf.Tensor:
        """Piece ``rank`` of the value: a slice of its flattened elements (padded if short)."""
        start = min(rank * self.length, self.size)
        end = min(start + self.length, self.size)
        part = tf.reshape(value, [-1])[start:end]
        missing = self.length - (end - start)
        return tf.pad(part, [[0, missing]]) if missing else part

    def whole(self, gathered: Any, shape: Sequence[int]) -> Any:
        """The variable's value from every rank's piece, concatenated in rank order."""
        flat = tf.reshape(gathered, [-1])
        if self.length * self.ranks != self.size:
            flat = flat[:self.size]
        return tf.reshape(flat, shape)


class Sharding:
    """The pieces of one run: each trained variable's ``Piece`` and shard variable, which slot
    belongs to which variable, and the step's exchange (reduce-scatter, update, all-gather)."""

    def __init__(self, collectives: Collectives, stage: int,
                 reduction: GradientReduction) -> None:
        self.collectives = collectives
        self.world = collectives.world
        self.stage = stage
        self.reduction = reduction
        self.pieces: dict[int, Piece] = {}          # id(model variable) -> its cut
        self.shards: dict[int, keras.Variable] = {}  # id(model variable) -> this rank's piece
        self.owners: dict[int, Any] = {}            # id(shard or slot) -> model variable
        # An optimizer's key of a shard (Keras' TensorFlow optimizers key a variable by its
        # TensorFlow variable's unique id) -> the key of its model variable.
        self.keys: dict[Any, Any] = {}

    def register(self, variables: Sequence[Any]) -> None:
        """Cut each variable not cut yet and make its shard variable (outside any graph)."""
        with tf.init_scope():
            for variable in variables:
                if id(variable) in self.pieces or id(variable) in self.owners:
                    continue
                if getattr(variable, "overwrite_with_gradient", False):
                    raise UserError(f"--zero-stage cannot shard '{_path(variable)}', which "
                                    "takes its gradient as its value (a float8 layer's "
                                    "scale); use --zero-stage 0")
                piece = Piece.of(variable, self.world.size)
                shard = keras.Variable(self._own_piece(piece, variable), trainable=False,
                                       dtype=variable.dtype, name=_name(variable))
                self.pieces[id(variable)] = piece
                self.shards[id(variable)] = shard
                self.owners[id(shard)] = variable
                self.keys[_key(shard)] = _key(variable)

    def _own_piece(self, piece: Piece, value: Any) -> tf.Tensor:
        return piece.own(tf.convert_to_tensor(value), self.world.rank)

    def piece_shapes(self, variables: Sequence[Any]) -> list[tuple[int]]:
        return [(self.pieces[id(v)].length,) for v in variables]

    # --- the step ----------------------------------------------------------------------------

    def scatter(self, gradients: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """Each gradient summed (or averaged, as the reduction says) over ranks, this rank's
        piece of the result kept: one reduce-scatter per bucket (issued as the backward pass
        produces it). None stays None."""
        size = self.world.size
        reduction = self.reduction
        scale = reduction.prescale * reduction.postscale / (
            size if reduction.op == "average" else 1)
        pieces: list[Any] = [None] * len(gradients)
        present = [i for i, g in enumerate(gradients) if g is not None]
        for index in present:
            if isinstance(gradients[index], tf.IndexedSlices):
                raise UserError(
                    f"--zero-stage cannot shard the sparse gradient of "
                    f"'{_path(variables[index])}' (an embedding's) exactly: Keras' optimizers "
                    "apply its rows one by one; use --zero-stage 0 for this model")
        previous: list[Any] = []
        for bucket in self.reduction.buckets([gradients[i] for i in present]):
            members = [present[i] for i in bucket]
            wire = [self.pieces[id(variables[i])].padded(gradients[i]) for i in members]
            if reduction.fp16:
                wire = [tf.cast(t, tf.float16) if t.dtype == tf.float32 else t for t in wire]
            previous = self.collectives.reduce_scatter_sum(reduction.submitted(previous, wire))
            for index, part in zip(members, previous):
                part = tf.cast(part, gradients[index].dtype)
                pieces[index] = part * scale if scale != 1.0 else part
        return pieces

    def update(self, optimizer: keras.optimizers.Optimizer, pieces: Sequence[Any],
               variables: Sequence[Any]) -> None:
        """The optimizer's update of this rank's pieces (loaded from the weights), then every
        rank's pieces gathered into the weights and the variables' constraints applied, as
        Keras applies them after an update."""
        shards = [self.shards[id(v)] for v in variables]
        for variable, shard in zip(variables, shards):
            shard.assign(self._own_piece(self.pieces[id(variable)], variable))
        updated = None
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            pieces, updated = self._agreed_finiteness(pieces)
        optimizer.apply(list(pieces), shards)
        self.gather(variables, [p is not None for p in pieces], updated)

    def _agreed_finiteness(self, pieces: Sequence[Any]) -> tuple[list[Any], tf.Tensor]:
        """A loss-scale optimizer skips a step whose gradients are not finite; each rank sees
        its pieces alone, so a non-finite piece anywhere makes every rank's pieces NaN.
        Returns (the pieces, whether the update will happen)."""
        bad = tf.add_n([tf.reduce_sum(tf.cast(~tf.math.is_finite(p), tf.float32))
                        for p in pieces if p is not None] or [tf.constant(0.0)])
        finite = self.collectives.allreduce_sum([bad])[0] == 0
        poison = tf.where(finite, 0.0, np.nan)
        return [p if p is None else p + tf.cast(poison, p.dtype) for p in pieces], finite

    def clipped(self, optimizer: keras.optimizers.Optimizer, pieces: Sequence[Any]) -> list[Any]:
        """Keras' ``clipnorm`` (each gradient by its own norm) or ``global_clipnorm`` (all by
        their joint norm) on this rank's pieces, with the whole gradients' norms: each piece's
        squares summed here, those sums over every rank (one allreduce; padding adds zeros),
        then Keras' own formulas."""
        present = [index for index, piece in enumerate(pieces) if piece is not None]
        if not present:
            return list(pieces)
        squares = self.collectives.allreduce_sum([tf.stack(
            [tf.reduce_sum(tf.square(tf.cast(pieces[i], tf.float32))) for i in present])])[0]
        clipped = list(pieces)
        if optimizer.clipnorm and optimizer.clipnorm > 0:
            for position, index in enumerate(present):
                piece = pieces[index]
                l2sum = tf.cast(squares[position], piece.dtype)
                positive = l2sum > 0
                l2norm = tf.where(positive, tf.sqrt(tf.where(positive, l2sum, 1.0)), l2sum)
                clipped[index] = (piece * optimizer.clipnorm
                                  / tf.maximum(l2norm, optimizer.clipnorm))
            return clipped
        norm = tf.sqrt(tf.reduce_sum(squares))
        limit = optimizer.global_clipnorm
        scale = limit * tf.minimum(1.0 / norm, 1.0 / limit) + (norm - norm)   # NaN if not finite
        for index in present:
            clipped[index] = pieces[index] * tf.cast(scale, pieces[index].dtype)
        return clipped

    def gather(self, variables: Sequence[Any], constrained: Sequence[bool],
               updated: tf.Tensor | None = None) -> None:
        """Every rank's pieces into each variable: one grouped all-gather per bucket. Then, as
        Keras does after an update, each ``constrained`` variable's constraint (those that had
        a gradient), unless ``updated`` says the optimizer skipped the step."""
        for bucket in self.reduction.buckets(list(variables)):
            members = [variables[i] for i in bucket]
            gathered = self.collectives.allgather([self.shards[id(v)].value for v in members])
            for index, every in zip(bucket, gathered):
                variable = variables[index]
                variable.assign(self.pieces[id(variable)].whole(every, variable.shape))
                if variable.constraint is None or not constrained[index]:
                    continue
                projected = variable.constraint(variable)
                variable.assign(projected if updated is None else
                                tf.where(updated, projected, tf.convert_to_tensor(variable)))

    # --- the optimizer's state ---------------------------------------------------------------

    def full_state(self, optimizer: keras.optimizers.Optimizer) -> Iterator[np.ndarray]:
        """Every optimizer variable's value as an unsharded optimizer holds it, in
        ``optimizer.variables`` order, each gathered as it is asked for (a collective: one
        all-gather per slot, so no more than one whole slot exists at once, and every rank
        must read as many)."""
        for slot in optimizer.variables:
            owner = self.owners.get(id(slot))
            yield slot.numpy() if owner is None else self._gathered(slot, owner).numpy()

    def _gathered(self, piece: Any, owner: Any) -> tf.Tensor:
        """Every rank's ``piece`` of ``owner`` (a slot or a shard) as one whole value."""
        every = self.collectives.allgather([tf.convert_to_tensor(piece)])[0]
        return self.pieces[id(owner)].whole(every, owner.shape)

    def shard_slots(self, optimizer: keras.optimizers.Optimizer) -> None:
        """An optimizer built before the run (restored, or by the user): each slot of a
        trained variable's shape becomes this rank's piece of it (Keras names a slot after
        its variable's path)."""
        for inner in holders(optimizer):
            if not inner.built:
                continue
            trained = list(inner._trainable_variables)
            self.register(trained)
            by_prefix = sorted(((_path(v).replace("/", "_") + "_", v) for v in trained),
                               key=lambda item: -len(item[0]))
            for slot in inner.variables:
                if id(slot) in self.owners:
                    continue
                owner = next((v for prefix, v in by_prefix if slot.name.startswith(prefix)
                              and tuple(slot.shape) == tuple(v.shape)), None)
                if owner is None:
                    if len(slot.shape) > 0:
                        raise UserError(f"optimizer '{inner.name}' holds state "
                                        f"'{slot.name}' that belongs to no trained "
                                        "variable by Keras' naming; use --zero-stage 0")
                    continue
                resize_variable(slot, self._own_piece(self.pieces[id(owner)], slot))
                self.owners[id(slot)] = owner

    def unshard_slots(self, optimizer: keras.optimizers.Optimizer) -> None:
        """Each slot back to its variable's whole shape, one at a time (a collective), so the
        optimizer leaves the run as Keras would leave it and saves as an ordinary model's."""
        for slot in optimizer.variables:
            owner = self.owners.pop(id(slot), None)
            if owner is not None:
                resize_variable(slot, self._gathered(slot, owner))


def _path(variable: Any) -> str:
    """A Keras variable's path, a TensorFlow variable's name (without ":0")."""
    return getattr(variable, "path", None) or variable.name.split(":")[0]


def _name(variable: Any) -> str:
    """The name a shard takes: its variable's own (weight-decay exclusions match names)."""
    return _path(variable).split("/")[-1] if not isinstance(variable, keras.Variable) \
        else variable.name


def _key(variable: Any) -> Any:
    """The key Keras' TensorFlow optimizers give a variable (Keras' or TensorFlow's)."""
    return (variable.value if isinstance(variable, keras.Variable) else variable)._unique_id


def holders(optimizer: keras.optimizers.Optimizer) -> list[keras.optimizers.Optimizer]:
    """The optimizer and, for a loss-scale optimizer, the optimizer inside that holds the
    state."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return [optimizer] if inner is None else [optimizer, inner]


class _ShardedOptimizer:
    """Mixed in before the user's optimizer class while a sharded run lasts."""

    _hvdtrain_sharding: Sharding

    def _var_key(self, variable: Any) -> Any:
        key = super()._var_key(variable)
        return self._hvdtrain_sharding.keys.get(key, key)

    def add_variable_from_reference(self, reference_variable: Any, name: str | None = None,
                                    initializer: Any = "zeros") -> Any:
        sharding = self._hvdtrain_sharding
        owner = sharding.owners.get(id(reference_variable), reference_variable)
        piece = sharding.pieces.get(id(owner))
        if piece is None:
            return super().add_variable_from_reference(reference_variable, name, initializer)
        slot = self.add_variable(shape=(piece.length,), initializer=initializer,
                                 dtype=owner.dtype,
                                 name=f"{_path(owner).replace('/', '_')}_{name or 'var'}")
        sharding.owners[id(slot)] = owner
        return slot

    def build(self, variables: Sequence[Any]) -> None:
        self._hvdtrain_sharding.register(variables)
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

    def _clip_gradients(self, grads: Sequence[Any]) -> list[Any]:
        """Norm clipping with the norms of the whole gradients, not of this rank's pieces."""
        if (self.clipnorm and self.clipnorm > 0) or (self.global_clipnorm and
                                                     self.global_clipnorm > 0):
            return self._hvdtrain_sharding.clipped(self, grads)
        return super()._clip_gradients(grads)

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> Any:
        """Given the model's variables (a model's own ``train_step``): reduce-scatter, update
        the pieces, all-gather. Given the pieces (the run's step, or a loss-scale optimizer
        calling the optimizer inside): Keras' own update of them."""
        sharding = self._hvdtrain_sharding
        if trainable_variables is None and not self.built:
            return super().apply(grads, trainable_variables)   # Keras says what is missing
        variables = list(self._trainable_variables if trainable_variables is None
                         else trainable_variables)
        if not variables or id(variables[0]) in sharding.owners:
            return super().apply(grads, variables)
        if not self.built:      # Keras builds lazily; variables may not be created in a tf.cond
            self.build(variables)
        sharding.update(self, sharding.scatter(list(grads), variables), variables)
        return None


@functools.cache
def sharded_class(optimizer_class: type) -> type:
    """The subclass of ``optimizer_class`` whose state is this rank's pieces."""
    return type(optimizer_class.__name__, (_ShardedOptimizer, optimizer_class), {
        "__module__": optimizer_class.__module__,
        "__qualname__": optimizer_class.__qualname__,
    })


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
    originals = [type(inner) for inner in found]
    for inner, cls in zip(found, originals):
        set_class(inner, sharded_class(cls))
        object.__setattr__(inner, "_hvdtrain_sharding", sharding)
    whole_again = in_pieces = False
    try:
        for optimizer in optimizers:
            sharding.shard_slots(optimizer)
            if variables and not optimizer.built:
                optimizer.build(list(variables))
        yield
        in_pieces = end_in_pieces and len(found) == 1
        whole_again = not in_pieces
    except (StoppedBySignal, TrainingDiverged, CheckpointWriteFailed, AgreedError):
        whole_again = True    # every rank stopped together: all can gather
        raise
    finally:
        if in_pieces:
            object.__setattr__(found[0], "_hvdtrain_class", originals[0])
        else:
            if whole_again:
                for optimizer in optimizers:
                    sharding.unshard_slots(optimizer)
            for inner, cls in zip(found, originals):
                _unsharded_class(inner, cls)


@contextlib.contextmanager
def saved_from_pieces(optimizers: Sequence[keras.optimizers.Optimizer]) -> Iterator[None]:
    """Around rank 0's final save, on every rank: an optimizer a run left in pieces
    (``end_in_pieces``) gives Keras' save each state variable whole, gathered as Keras stores
    it, so no rank ever holds the whole state; every rank takes part in each gather (the
    other ranks here; rank 0 as it saves, then here for any its save did not read). Its class
    is restored after; its state stays in pieces (the process is ending)."""
    left = [optimizer for optimizer in optimizers if hasattr(optimizer, "_hvdtrain_class")]
    streams = [optimizer._hvdtrain_sharding.full_state(optimizer) for optimizer in left]
    for optimizer, stream in zip(left, streams):
        object.__setattr__(optimizer, "_hvdtrain_stream", stream)
        if optimizer._hvdtrain_sharding.world.is_chief:
            logger.info(f"ZeRO: optimizer '{optimizer.name}' saved from its pieces, one state "
                        "variable gathered at a time (no rank holds its whole state)")
    try:
        yield
    finally:
        in_flight = sys.exc_info()[1]
        for optimizer, stream in zip(left, streams):
            try:
                drain(stream, quietly=in_flight is not None)
            finally:   # the class comes back; its state stays in pieces (the process ends)
                _unsharded_class(optimizer, optimizer._hvdtrain_class)


def _unsharded_class(optimizer: keras.optimizers.Optimizer, cls: type) -> None:
    """``optimizer`` back in its own class, without what sharding attached to it."""
    set_class(optimizer, cls)
    for name in ("_hvdtrain_sharding", "_hvdtrain_class", "_hvdtrain_stream"):
        if name in vars(optimizer):
            object.__delattr__(optimizer, name)


def saved_state_bytes(optimizer: keras.optimizers.Optimizer) -> int:
    """The bytes of ``optimizer``'s state as Keras saves it: whole, also while sharded."""
    sharding = getattr(optimizer, "_hvdtrain_sharding", None)
    owners = sharding.owners if sharding is not None else {}
    return sum(static_bytes(owners.get(id(v), v)) for v in optimizer.variables)


@dataclass(frozen=True)
class WholeState:
    """Sharded optimizers' state for a checkpoint: by attribute, each optimizer's values
    gathered whole one at a time as rank 0 writes them; and how it was held
    (``CheckpointState.sharded``)."""

    arrays: dict[str, Iterator[np.ndarray]]
    record: dict[str, int]


def consolidated_state(optimizers: dict[str, keras.optimizers.Optimizer]) -> WholeState | None:
    """Every sharded optimizer's whole state, or None when no optimizer is sharded. A
    collective: rank 0 reads it while writing the checkpoint; the other ranks take part in
    each gather here, keeping nothing, and get None back."""
    sharded = {name: optimizer for name, optimizer in optimizers.items()
               if isinstance(optimizer, _ShardedOptimizer) and optimizer.built}
    if not sharded:
        return None
    sharding = next(iter(sharded.values()))._hvdtrain_sharding
    whole = WholeState({name: optimizer._hvdtrain_sharding.full_state(optimizer)
                        for name, optimizer in sharded.items()},
                       {"zero_stage": sharding.stage, "ranks": sharding.world.size})
    if sharding.world.is_chief:
        return whole
    for values in whole.arrays.values():
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


def piece_bytes(variables: Sequence[Any], world_size: int) -> int:
    """Bytes of one rank's pieces of ``variables`` at ``world_size`` ranks."""
    return sum(Piece.of(v, world_size).length * tf.as_dtype(v.dtype).size for v in variables)


def gradient_bytes_kept(sharding: Sharding | None, variables: Sequence[Any]) -> int:
    """Bytes of the reduced gradients of ``variables`` a rank keeps: whole, or its pieces."""
    if sharding is None:
        return variable_bytes(variables)
    return piece_bytes(variables, sharding.world.size)


def describe(stage: int, world_size: int, optimizer: keras.optimizers.Optimizer,
             variables: Sequence[Any]) -> str:
    """The run log's line on sharding: what the optimizer's state costs each rank."""
    full, mine = variable_bytes(variables), piece_bytes(variables, world_size)
    kinds = _slot_kinds(optimizer)
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
