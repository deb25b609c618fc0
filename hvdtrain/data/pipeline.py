"""The input pipeline: shard by rank, shuffle per epoch, gather, batch, prefetch.

Every rank draws the same permutation of the examples, seeded by ``(seed, epoch)``, and cuts it
into global batches of N*b ids, of which rank r takes ``[r*b, (r+1)*b)``: N ranks x b compute
what one process with batch N*b does, and a resume sees the same order. Under ``pad`` a short
last global batch is spread evenly over the ranks (each rank's batch is then shorter: its real
rows, marked by a loss weight > 0, come first and the rest of its slots are weight-0 padding
the step leaves out), under ``drop`` it is skipped. Each real example weighs 1/(examples in its
global batch, or in the k batches of one accumulated update). Evaluation under a model's own
``test_step`` (``equal_steps`` false) takes examples r, r+N, ... unpadded. The plan is made of
TensorFlow ops, so one ``tf.data`` pipeline covers every epoch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from hvdtrain.collectives import World

PADDING_ID = -1


@dataclass(frozen=True)
class ShardSpec:
    """How one rank takes its share of a dataset of ``num_examples``."""

    num_examples: int
    world: World
    batch_size: int
    remainder: str = "pad"
    shuffle: bool = True
    seed: int = 0
    accumulation_steps: int = 1
    # Examples of this epoch's permutation already trained on (elastic training resumes an
    # epoch mid-way, possibly with another world size): the plan covers the rest.
    offset: int = 0
    # Steps per epoch agreed by every rank, for sources whose ranks count their own batches
    # (a user's tf.data pipeline); None: computed from ``num_examples``.
    agreed_steps: int | None = None
    # False: this rank's share alone, unpadded, however many steps it takes (evaluation under
    # a model's own test_step).
    equal_steps: bool = True
    # Every rank's own count of batches per pass, for sources whose ranks count their own (the
    # agreed ``steps_per_epoch`` comes from them); None: not counted (planned sources).
    rank_counts: tuple[int, ...] | None = None

    @property
    def remaining(self) -> int:
        return self.num_examples - self.offset

    @property
    def global_batch(self) -> int:
        return self.world.size * self.batch_size

    @property
    def update_batch(self) -> int:
        """Examples behind one optimizer update: the global batch times the accumulation."""
        return self.global_batch * self.accumulation_steps

    @property
    def updates_per_epoch(self) -> int:
        if self.remainder == "pad":
            return math.ceil(self.remaining / self.update_batch)
        return self.remaining // self.update_batch

    @property
    def short_batches(self) -> bool:
        """Whether a pass of this plan holds batches with fewer real rows than slots (a short
        last global batch, spread over the ranks, or a filler step)."""
        return (self.equal_steps and self.remainder == "pad" and self.rank_counts is None
                and self.steps_per_epoch * self.global_batch > self.remaining)

    @property
    def steps_per_epoch(self) -> int:
        """Batches per rank per epoch: a whole number of accumulation groups."""
        if self.agreed_steps is not None:
            return self.agreed_steps
        return self.updates_per_epoch * self.accumulation_steps


def epoch_plan(spec: ShardSpec, epoch: tf.Tensor | int) -> tuple[tf.Tensor, tf.Tensor]:
    """This rank's example ids ``[steps, batch]`` (-1 = no example) and their loss weights.

    Each step's global batch (N*b ids of the permutation, fewer at its end) is spread evenly
    over the ranks in order: rank r takes positions ``[r*rows//N, (r+1)*rows//N)``, its real
    ids first. A whole global batch gives each rank b; a short last one gives each rank its
    part of the remainder, so every rank trains real rows unless fewer rows than ranks are left
    (then a rank's step has none: a filler)."""
    steps, global_batch, n = spec.steps_per_epoch, spec.global_batch, spec.remaining
    size, batch = spec.world.size, spec.batch_size
    order = tf.range(spec.num_examples, dtype=tf.int64)
    if spec.shuffle:
        seed = tf.stack([tf.constant(spec.seed, tf.int64), tf.cast(epoch, tf.int64)])
        order = tf.random.experimental.stateless_shuffle(order, seed=seed)
    order = order[spec.offset:]
    starts = tf.range(steps, dtype=tf.int64) * global_batch
    rows = tf.clip_by_value(n - starts, 0, global_batch)
    first = rows * spec.world.rank // size
    own = rows * (spec.world.rank + 1) // size - first
    offsets = tf.range(batch, dtype=tf.int64)
    positions = starts[:, tf.newaxis] + first[:, tf.newaxis] + offsets[tf.newaxis, :]
    real = offsets[tf.newaxis, :] < own[:, tf.newaxis]
    ids = tf.where(real, tf.gather(order, tf.minimum(positions, max(n - 1, 0))),
                   tf.constant(PADDING_ID, tf.int64))
    # Examples in each step's update group (k consecutive global batches): the loss divisor.
    group = spec.update_batch
    group_starts = tf.range(steps, dtype=tf.int64) // spec.accumulation_steps * group
    per_update = tf.cast(tf.minimum(tf.constant(group, tf.int64), n - group_starts), tf.float32)
    weights = tf.where(ids >= 0, 1.0 / per_update[:, tf.newaxis], 0.0)
    return ids, weights


def plan_dataset(spec: ShardSpec, first_epoch: int, end_epoch: int) -> tf.data.Dataset:
    """Batches of (ids, weights) for epochs ``[first_epoch, end_epoch)``, one element a step."""
    epochs = tf.data.Dataset.range(first_epoch, end_epoch)
    return epochs.flat_map(lambda epoch: tf.data.Dataset.from_tensor_slices(
        epoch_plan(spec, epoch)))


def array_dataset(x: Any, y: Any, spec: ShardSpec, first_epoch: int = 0, end_epoch: int = 1,
                  sample_weight: np.ndarray | None = None) -> tf.data.Dataset:
    """(features, targets, sample weights, loss weights) batches gathered from in-memory arrays
    in parallel. Features and targets may be nested (dicts or lists of arrays)."""
    features = tf.nest.map_structure(tf.constant, x)
    targets = tf.nest.map_structure(tf.constant, y)
    user_weights = tf.nest.map_structure(   # a vector, or one per output (targets' structure)
        lambda w: tf.constant(np.asarray(w, np.float32)),
        np.ones(spec.num_examples, np.float32) if sample_weight is None else sample_weight)

    def gather(ids: tf.Tensor, weights: tf.Tensor):
        rows = tf.maximum(ids, 0)

        def take(values: tf.Tensor) -> tf.Tensor:
            return tf.gather(values, rows)

        return (tf.nest.map_structure(take, features), tf.nest.map_structure(take, targets),
                tf.nest.map_structure(take, user_weights), weights)

    dataset = plan_dataset(spec, first_epoch, end_epoch) if spec.equal_steps else (
        uneven_plan(spec))
    dataset = dataset.map(gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return dataset.prefetch(tf.data.AUTOTUNE)


def real_rows_only(dataset: tf.data.Dataset,
                   spec: ShardSpec | None = None) -> tf.data.Dataset:
    """Batches ``(x, y, sample_weight, weight)`` cut to their real rows (weight > 0), as Keras'
    own last batch is shorter; a filler batch (no real row) is left whole, at weight zero.
    Only where ``spec``'s plan has short batches: as in Keras' ``fit``, whose batches have a
    static row count unless a short one exists, the step then sees the batch size as known (a
    user's loss may squeeze or reshape by it). Done in the pipeline, not in the step, whose
    slice would leave every batch's rows unknown. A user's dataset (counted, not planned)
    fills only whole batches and passes as it is. (No ``spec``: cut whatever it holds.)"""
    if spec is not None and not spec.short_batches:
        return dataset

    def cut(x: Any, y: Any, sample_weight: Any, weight: tf.Tensor) -> tuple:
        real = weight > 0
        keep = tf.logical_or(real, tf.logical_not(tf.reduce_any(real)))
        return tf.nest.map_structure(lambda value: tf.boolean_mask(value, keep),
                                     (x, y, sample_weight, weight))

    return dataset.map(cut, num_parallel_calls=tf.data.AUTOTUNE,
                       deterministic=True).prefetch(tf.data.AUTOTUNE)


def uneven_plan(spec: ShardSpec) -> tf.data.Dataset:
    """This rank's examples r, r+N, ... in batches of b, unpadded (see the module doc)."""
    ids = tf.range(spec.world.rank, spec.num_examples, spec.world.size, dtype=tf.int64)
    return tf.data.Dataset.from_tensor_slices(ids).batch(spec.batch_size).map(
        lambda batch: (batch, tf.ones(tf.shape(batch), tf.float32)))
