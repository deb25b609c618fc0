"""How ZeRO cuts a run's trainable variables into pieces, one per rank, and the step's exchange
of them: ``Piece`` (one variable's cut) and ``Sharding`` (every variable's cut, its shard
variable, which optimizer state variable belongs to which variable, the reduce-scatter, the
update of this rank's pieces and the all-gather). ``zero`` gives the optimizer its class for
the run on top of these.

Every variable is flattened, padded to a multiple of the world size and cut into N equal
pieces; rank r owns piece r of each (balanced, as torch-xla's and DeepSpeed's are).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.collectives import Collectives, GradientReduction, variable_bytes
from hvdtrain.errors import UserError
from hvdtrain.keras_internals import (constraints_set_aside, optimizer_key,
                                      optimizer_variables_built_for, resize_variable, slot_name)


@dataclass(frozen=True)
class Piece:
    """How one variable is cut: ``size`` elements, ``length`` per rank for ``ranks`` ranks (the
    size padded to a multiple of the world size, divided by it)."""

    size: int
    length: int
    ranks: int

    @classmethod
    def of(cls, variable: Any, world_size: int) -> "Piece":
        return cls.of_shape(tuple(variable.shape), world_size)

    @classmethod
    def of_shape(cls, shape: Sequence[int], world_size: int) -> "Piece":
        size = int(np.prod(shape, dtype=np.int64))
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
        # Stage 3: id(model variable) -> its whole shape (the variable holds its piece).
        self.whole_shapes: dict[int, tuple[int, ...]] = {}
        self.updating = False
        # Depth of the optimizer's own work on the pieces (its update, its build), where
        # stage 3's weights are read as the pieces they are (``model_memory.gathered``).
        self.optimizer_at_work = 0

    def register(self, variables: Sequence[Any]) -> None:
        """Cut each variable not cut yet and make its shard variable (outside any graph)."""
        with tf.init_scope():
            for variable in variables:
                if id(variable) in self.pieces or id(variable) in self.owners:
                    continue
                _refuse_unshardable(variable)
                piece = Piece.of(variable, self.world.size)
                shard = keras.Variable(self._own_piece(piece, variable), trainable=False,
                                       dtype=variable.dtype, name=_name(variable))
                self.pieces[id(variable)] = piece
                self.shards[id(variable)] = shard
                self.owners[id(shard)] = variable
                self.keys[optimizer_key(shard)] = optimizer_key(variable)

    def cut_in_place(self, variables: Sequence[Any]) -> None:
        """Stage 3: each variable keeps only this rank's piece, and is its own shard."""
        with tf.init_scope():
            for variable in variables:
                _refuse_unshardable(variable)
                piece = Piece.of(variable, self.world.size)
                self.whole_shapes[id(variable)] = tuple(variable.shape)
                resize_variable(variable, self._own_piece(piece, variable))
                self.pieces[id(variable)] = piece
                self.shards[id(variable)] = variable
                self.owners[id(variable)] = variable
                self.keys[optimizer_key(variable)] = optimizer_key(variable)

    def join_in_place(self, variables: Sequence[Any]) -> None:
        """Stage 3's end: each variable whole again, gathered one at a time (a collective),
        so no more than the model and one variable exist at once. Its cut stays known: the
        optimizer's state may still be in pieces, gathered later by its owner's cut."""
        for variable in variables:
            resize_variable(variable, self._gathered(variable, variable))
            for mapping in (self.shards, self.owners, self.whole_shapes):
                mapping.pop(id(variable), None)

    def whole_shape(self, variable: Any) -> tuple[int, ...]:
        """A model variable's shape, also while stage 3 holds its piece."""
        return self.whole_shapes.get(id(variable), tuple(variable.shape))

    def _own_piece(self, piece: Piece, value: Any) -> tf.Tensor:
        return piece.own(tf.convert_to_tensor(value), self.world.rank)

    def piece_shapes(self, variables: Sequence[Any]) -> list[tuple[int]]:
        return [(Piece.of(v, self.world.size).length,) for v in variables]

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
                    f"'{variable_path(variables[index])}' (an embedding's) exactly: Keras' "
                    "optimizers apply its rows one by one; use --zero-stage 0 for this model")
        previous: list[Any] = []
        for bucket in self.reduction.buckets([gradients[i] for i in present]):
            members = [present[i] for i in bucket]
            wire = [self.pieces[id(variables[i])].padded(gradients[i]) for i in members]
            wire = [reduction.on_wire(t) for t in wire]
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
        if self.stage < 3:
            for variable, shard in zip(variables, shards):
                shard.assign(self._own_piece(self.pieces[id(variable)], variable))
        updated = None
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            pieces, updated = self._agreed_finiteness(pieces)
        if self.stage < 3:
            optimizer.apply(list(pieces), shards)
            self.gather(variables, [p is not None for p in pieces], updated)
            return
        self.updating = True       # the optimizer's own update of the pieces (``zero``)
        try:
            with self.optimizer_working():
                with constraints_set_aside(variables):   # Keras would project the pieces
                    optimizer.apply(list(pieces), shards)
                self.constrain_pieces([v for v, p in zip(variables, pieces) if p is not None],
                                      updated)
        finally:
            self.updating = False

    @contextlib.contextmanager
    def optimizer_working(self) -> Iterator[None]:
        """Around the optimizer's own work on the pieces (``optimizer_at_work``)."""
        self.optimizer_at_work += 1
        try:
            yield
        finally:
            self.optimizer_at_work -= 1

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

    def constrain_pieces(self, variables: Sequence[Any], updated: tf.Tensor | None) -> None:
        """Stage 3: each constrained variable's constraint on its whole value (gathered one
        variable at a time), this rank keeping its piece of the result; skipped where
        ``updated`` says the optimizer skipped the step."""
        for variable in variables:
            if variable.constraint is None:
                continue
            piece = self.pieces[id(variable)]
            projected = piece.own(variable.constraint(self._gathered(variable, variable)),
                                  self.world.rank)
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

    def full_weights(self, variables: Sequence[Any]) -> Iterator[np.ndarray]:
        """Each of ``variables`` whole (stage 3's pieces gathered one variable at a time as
        they are asked for: a collective, as ``full_state``)."""
        for variable in variables:
            yield (self.whole_value(variable).numpy() if self.in_pieces(variable)
                   else variable.numpy())

    def in_pieces(self, variable: Any) -> bool:
        """Whether ``variable`` (of the model) holds only this rank's piece (stage 3)."""
        return id(variable) in self.whole_shapes

    def whole_value(self, variable: Any) -> tf.Tensor:
        """A stage-3 variable's whole value, gathered from every rank's piece (a collective)."""
        return self._gathered(variable, variable)

    def _gathered(self, piece: Any, owner: Any) -> tf.Tensor:
        """Every rank's ``piece`` of ``owner`` (a slot or a shard) as one whole value."""
        every = self.collectives.allgather([tf.convert_to_tensor(piece)])[0]
        return self.pieces[id(owner)].whole(every, self.whole_shape(owner))

    def shard_slots(self, optimizer: keras.optimizers.Optimizer) -> None:
        """An optimizer built before the run (restored, or by the user): each slot of a
        trained variable's shape becomes this rank's piece of it (Keras names a slot after
        its variable's path)."""
        for inner in holders(optimizer):
            if not inner.built:
                continue
            trained = optimizer_variables_built_for(inner)
            self.register(trained)
            by_prefix = sorted(((slot_name(variable_path(v), ""), v) for v in trained),
                               key=lambda item: -len(item[0]))
            for slot in inner.variables:
                if id(slot) in self.owners:
                    continue
                owner = next((v for prefix, v in by_prefix if slot.name.startswith(prefix)
                              and tuple(slot.shape) == self.whole_shape(v)), None)
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


def _refuse_unshardable(variable: Any) -> None:
    if getattr(variable, "overwrite_with_gradient", False):
        raise UserError(f"--zero-stage cannot shard '{variable_path(variable)}', which takes its "
                        "gradient as its value (a float8 layer's scale); use --zero-stage 0")


def variable_path(variable: Any) -> str:
    """A Keras variable's path, a TensorFlow variable's name (without ":0")."""
    return getattr(variable, "path", None) or variable.name.split(":")[0]


def _name(variable: Any) -> str:
    """The name a shard takes: its variable's own (weight-decay exclusions match names)."""
    return variable_path(variable).split("/")[-1] if not isinstance(variable, keras.Variable) \
        else variable.name


def holders(optimizer: keras.optimizers.Optimizer) -> list[keras.optimizers.Optimizer]:
    """The optimizer and, for a loss-scale optimizer, the optimizer inside that holds the
    state."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return [optimizer] if inner is None else [optimizer, inner]


def piece_bytes(variables: Sequence[Any], world_size: int,
                shape_of: Callable[[Any], Sequence[int]] = lambda v: v.shape) -> int:
    """Bytes of one rank's pieces of ``variables`` (of the shapes ``shape_of`` gives) at
    ``world_size`` ranks."""
    return sum(Piece.of_shape(shape_of(v), world_size).length * tf.as_dtype(v.dtype).size
               for v in variables)


def gradient_bytes_kept(sharding: Sharding | None, variables: Sequence[Any]) -> int:
    """Bytes of the reduced gradients of ``variables`` a rank keeps: whole, or its pieces (of
    the whole variables, also while stage 3 holds them as pieces)."""
    if sharding is None:
        return variable_bytes(variables)
    return piece_bytes(variables, sharding.world.size, sharding.whole_shape)
