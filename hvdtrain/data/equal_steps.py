"""Equal steps on every rank, and nothing made up: how many steps each rank runs per pass over
the data, what a rank that runs short does, and how epochs map onto passes.

Every step holds collectives, so every rank must run the same number of them. Ranks that count
their own batches agree on a count (``agreed_steps``): the most under hvdtrain's exact step, where
a short rank repeats a real batch at loss weight zero, or the fewest under a model's own
``train_step``, which cannot ignore a filler row. A pass whose length changed stops its rank with
one line instead of leaving the others waiting. ``Passes`` reads ``steps_per_epoch`` as Keras'
``fit`` does. Everything here reads a dataset the same number of times on every rank, because a
seeded ``shuffle``'s order depends on how often it was iterated.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import tensorflow as tf

from hvdtrain.data.contract import DataError
from hvdtrain.data.pipeline import ShardSpec

# Keras' own words when an epoch's data runs out before ``steps_per_epoch`` (keras 3.15,
# ``EpochIterator._interrupted_warning``): the user sees what one process would show.
RAN_OUT = ("Your input ran out of data; interrupting training. Make sure that your dataset or "
           "generator can generate at least `steps_per_epoch * epochs` batches. You may need to "
           "use the `.repeat()` function when building your dataset.")
# Marks the error a rank's data raises when a pass is not the length the ranks agreed on.
COUNT_CHANGED = "the data changed length"


def agreed_steps(counts: list[int], fill: bool) -> int:
    """The steps every rank runs per pass, from every rank's own count: the most (the others
    fill) or, when a rank may not fill, the fewest (the others stop there)."""
    return max(counts) if fill else min(counts)


def left_out_line(counts: list[int], steps: int, rows: list[int] | None,
                  batch_size: int) -> str | None:
    """Rank 0's line on what stopping every rank at ``steps`` whole batches leaves out of each
    pass (None: nothing). ``counts``: every rank's batches; ``rows``: every rank's examples
    when known (unbatched data, cut to whole batches of ``batch_size``), else batches count."""
    if rows is not None:
        left, unit = sum(rows) - len(rows) * steps * batch_size, "example(s)"
        each = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(rows))
    else:
        left, unit = sum(counts) - len(counts) * steps, "batch(es)"
        each = ", ".join(f"rank {rank}: {count} batches" for rank, count in enumerate(counts))
    if left <= 0:
        return None
    return (f"training data: each pass leaves out {left} {unit} ({each}): a model's own "
            f"train_step never sees filler, so every rank stops at {steps} whole batches")


_CARDINALITY = re.compile(r"expected to contain (\d+) elements? but contained (only|at least) "
                          r"(\d+) elements?")


def count_changed_line(message: str, rank: int) -> str | None:
    """The one line for a pass whose length is not the one counted (TensorFlow's
    ``assert_cardinality`` error, raised where ``Evening.evened`` checks it), or None for any
    other error."""
    found = _CARDINALITY.search(message)
    if found is None:
        return None
    expected, how, seen = found.groups()
    length = f"{seen} batch(es), fewer than" if how == "only" else "more than"
    return (f"{COUNT_CHANGED} on rank {rank}: a pass had {length} the {expected} batches "
            "counted on the first pass (every rank's steps are agreed from those counts); make "
            "the dataset's length the same every pass (no random filter), or give "
            "steps_per_epoch for a dataset that repeats")


def zero_weighted(element: tuple) -> tuple:
    """A batch ``(x, y, sample_weight, weight)`` with its loss weights zero: the filler."""
    x, y, sample_weight, weight = element
    return x, y, sample_weight, tf.zeros_like(weight)


@dataclass(frozen=True)
class EqualPass:
    """How one rank makes every pass exactly ``steps`` batches long: ``own`` the batches this
    rank counted (None: ``steps`` is a count the user declared, e.g. ``validation_steps``),
    whether it ``fill``s (hvdtrain's step) or is cut (a model's own), and ``any_short``:
    whether any rank fills, so that every rank reads the filler or none does (the same reads
    everywhere)."""

    steps: int
    own: int | None
    fill: bool
    any_short: bool

    @classmethod
    def for_spec(cls, spec: ShardSpec, declared: bool, count: Callable[[], int]) -> "EqualPass":
        """This rank's under ``spec``: ``declared``: its steps are the user's count; else every
        rank's counts are ``spec.rank_counts`` (a world of one that was not told them counts
        its own, ``count()``)."""
        fill, steps = spec.remainder == "pad", spec.steps_per_epoch
        if declared:
            return cls(steps, None, fill, True)
        counts = spec.rank_counts or (count(),)
        own = counts[spec.world.rank] if spec.rank_counts else counts[0]
        return cls(steps, own, fill, min(counts) < steps)

    @property
    def needs_filler(self) -> bool:
        """Whether every rank reads the filler: some rank fills, or the count is the user's
        (which a rank may not reach)."""
        return self.fill and (self.any_short or self.own is None)

    def apply(self, batches: tf.data.Dataset, filler: tuple | None) -> tf.data.Dataset:
        """One pass of this rank's batches, exactly ``steps`` of them (module doc). A counted
        pass must have the length counted (TensorFlow's ``assert_cardinality`` raises
        otherwise); a declared count takes that many batches and leaves the rest, as Keras'
        ``validation_steps`` does. ``batches``: ``(x, y, sample_weight, weight)``; ``filler``:
        one of them, repeated at loss weight zero where the pass runs short."""
        if not self.fill:
            return batches.take(self.steps).apply(
                tf.data.experimental.assert_cardinality(self.steps))
        if self.own is not None:
            batches = batches.apply(tf.data.experimental.assert_cardinality(self.own))
            if self.own >= self.steps:
                return batches
        repeated = tf.data.Dataset.from_tensors(zero_weighted(filler)).repeat()
        return batches.concatenate(repeated).take(self.steps)


def equal_passes(spec: ShardSpec, declared: bool, count: Callable[[], int],
                 filler: Callable[[], tuple | None],
                 one_pass: Callable[[int], tf.data.Dataset], first_pass: int,
                 end_pass: int) -> tf.data.Dataset:
    """Passes ``[first_pass, end_pass)`` of a rank's batches back to back, each exactly the
    agreed length (``EqualPass``). ``count()``: this rank's batches of a pass, read only where
    the ranks' counts are not in ``spec``; ``filler()``: the data's first batch, read only where
    some rank fills; ``one_pass(index)``: the rank's batches of that pass (reading a user's
    dataset again is its next pass: a ``shuffle`` in it reshuffles, as under Keras)."""
    shape = EqualPass.for_spec(spec, declared, count)
    first = filler() if shape.needs_filler else None
    if shape.needs_filler and first is None:
        raise DataError("the data is empty; give it examples")
    stream = shape.apply(one_pass(first_pass), first)
    for index in range(first_pass + 1, end_pass):
        stream = stream.concatenate(shape.apply(one_pass(index), first))
    return stream


def count_batches(dataset: tf.data.Dataset) -> int:
    """A dataset's elements: its cardinality when TensorFlow knows it, else one pass."""
    known = int(dataset.cardinality())
    if known >= 0:
        return known
    return int(dataset.reduce(np.int64(0), lambda count, _: count + 1))


@dataclass(frozen=True)
class Passes:
    """Which batches each epoch trains on, as Keras' ``fit`` reads data (module doc).

    ``pass_steps``: every rank's steps in one pass (agreed), None for data that repeats
    forever; ``steps_per_epoch``: the user's, None for one pass per epoch; ``first_epoch``: the
    epoch where the stream starts (Keras starts its data afresh at each ``fit`` call: the run's
    initial epoch). Passes are numbered from ``first_epoch``, so without ``steps_per_epoch``
    pass and epoch are the same number (the seed of an in-memory epoch's order)."""

    pass_steps: int | None
    steps_per_epoch: int | None = None
    first_epoch: int = 0

    @property
    def keras_steps(self) -> int:
        """Keras' ``params["steps"]``: ``steps_per_epoch`` when given, else a pass."""
        return self.steps_per_epoch or self.pass_steps

    def _length(self, offset: int) -> int:
        if self.pass_steps is None:
            return self.steps_per_epoch
        left = self.pass_steps - offset
        return left if self.steps_per_epoch is None else min(self.steps_per_epoch, left)

    def _walk(self, end_epoch: int) -> Iterator[tuple[int, int, int]]:
        """(pass, steps into it, steps of the epoch) of every epoch from ``first_epoch`` to
        ``end_epoch`` (inclusive)."""
        pass_index, offset = self.first_epoch, 0
        for _ in range(self.first_epoch, end_epoch + 1):
            steps = self._length(offset)
            yield pass_index, offset, steps
            offset += steps
            if self.pass_steps is not None and offset >= self.pass_steps:
                pass_index, offset = pass_index + 1, 0

    def start(self, epoch: int) -> tuple[int, int, int]:
        """(pass, steps into it, steps of the epoch) where ``epoch`` begins."""
        return deque(self._walk(epoch), maxlen=1)[0]

    def epoch_steps(self, epoch: int) -> int:
        return self.start(epoch)[2]

    def epoch_lengths(self, first: int, end: int) -> list[int]:
        """The steps of epochs ``[first, end)``."""
        return [steps for _, _, steps in self._walk(end - 1)][first - self.first_epoch:]

    def cut_short(self, epoch: int) -> bool:
        """Whether the data runs out before ``steps_per_epoch`` in this epoch (Keras warns)."""
        return self.steps_per_epoch is not None and self.epoch_steps(epoch) < self.steps_per_epoch

    def passes_until(self, end_epoch: int) -> int:
        """The pass after the last one that epochs before ``end_epoch`` read (exclusive end)."""
        return self.start(end_epoch - 1)[0] + 1


def first_element(dataset: tf.data.Dataset) -> Any:
    """The dataset's first element (one iteration, on every rank alike), or None when empty."""
    for element in dataset.take(1):
        return element
    return None
