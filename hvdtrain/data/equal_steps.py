"""Equal steps on every rank, and nothing made up: the one place that decides how many steps
each rank runs per pass over the data, what a rank that runs short does, and how epochs map
onto passes.

Every step holds collectives, so every rank must run the same number of steps. How that is
kept, for every form of data (arrays, files, a user's ``tf.data`` dataset batched or not, a
``PyDataset``, a ``Pipeline``, training and validation alike):

* **Counting.** Sources that plan a whole pass themselves (arrays, files) give every rank the
  same count by construction. A user's dataset or pipeline is counted on each rank (its
  cardinality, or one pass) and the ranks agree (``agreed_steps``): on the most any rank has
  under hvdtrain's exact step, on the fewest under a model's own ``train_step``.
* **Filling (hvdtrain's exact step).** A rank with fewer batches than agreed repeats a real
  batch of the data (its first, ``template``) with loss weight zero: every input the model sees
  is one the user gave (vocabulary strings, real shapes, unknown dimensions as the data has
  them), and zero-weight rows add nothing to the loss, the gradients or the metrics. Arrays and
  files fill a short global batch the same way, row by row, with real examples of weight zero.
* **Cutting (a model's own step).** A mean per rank is exact only over real batches, and the
  model's code cannot be told to ignore a row, so it never sees a filler: every rank stops at
  the fewest real batches any rank has, and rank 0 says how many examples a pass leaves out
  (``left_out_line``).
* **Checked.** A pass is read until one batch past the agreed count. A rank whose pass ends
  before it while it may not fill (a model's own step), or runs past it (a pipeline whose
  length changed from the pass that was counted), stops with an error naming the problem
  (``COUNT_CHANGED``) instead of leaving the other ranks waiting or leaving data out unsaid.
* **Epochs and passes (``Passes``).** Without ``steps_per_epoch`` an epoch is one pass. With
  it, the data is one stream across epochs, as Keras' ``fit`` reads it: an epoch takes the next
  ``steps_per_epoch`` batches of the current pass, ends early when the pass ends (Keras'
  warning ``RAN_OUT``, shown once by rank 0), and the next epoch starts a new pass. A dataset
  that repeats forever is one endless pass. Every rank ends every epoch at the same step.

The order of a user's ``tf.data`` pipeline with a seeded ``shuffle`` depends on how many
times it was iterated before (each iteration draws the next seed from the shuffle's seed
generator, shared by every dataset made from it): whatever reads such a dataset before training
(counting, the template, the order check) must do so the same number of times on every rank,
which everything here does.
"""

from __future__ import annotations

from dataclasses import dataclass
import re
from collections import deque
from typing import Any, Callable, Iterator

import tensorflow as tf

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


def count_changed_line(message: str) -> str | None:
    """The one line of a ``COUNT_CHANGED`` error raised inside TensorFlow (which wraps the
    assertion's parts in brackets), or None for any other error."""
    start = message.find(COUNT_CHANGED)
    if start < 0:
        return None
    text = message[start:].splitlines()[0].replace("\\'", "'")
    return re.sub(r"\]?\s*\[|\]\s*$", " ", text).replace("  ", " ").strip()


def zero_weighted(element: tuple) -> tuple:
    """A batch ``(x, y, sample_weight, weight)`` with its loss weights zero: the filler."""
    x, y, sample_weight, weight = element
    return x, y, sample_weight, tf.zeros_like(weight)


def _is_filler(element: tuple) -> tf.Tensor:
    """Whether a batch is the filler (every loss weight zero; a real batch of a user's dataset
    has weight 1 per row)."""
    weight = element[3]
    return tf.logical_and(tf.size(weight) > 0, tf.reduce_all(tf.equal(weight, 0.0)))


def evened(batches: tf.data.Dataset, steps: int, template: tuple, fill: bool,
           rank: int, counted: bool = True) -> tf.data.Dataset:
    """One pass of this rank's batches, exactly ``steps`` of them (module doc). ``fill``: a
    short pass goes on with ``template`` at loss weight zero; else every rank has at least
    ``steps`` real batches (the fewest any rank counted), the rest of a pass is left out, and a
    shorter pass is an error. ``counted``: ``steps`` is the most any rank counted, so a longer
    pass is an error too (not when the user declared the count, e.g. ``validation_steps``:
    then the rest is left out, as Keras leaves it). ``batches`` are ``(x, y, sample_weight,
    weight)``, weight 1 for real rows."""
    filler = tf.data.Dataset.from_tensors(zero_weighted(template)).repeat()
    look_past = fill and counted         # read one batch past the count: filler, or too long
    checked = batches.concatenate(filler).take(steps + 1 if look_past else steps).enumerate()
    fix = ("make the dataset's length the same every pass (no random filter), or give "
           "steps_per_epoch for a dataset that repeats")

    def check(index: tf.Tensor, element: tuple) -> tuple:
        if fill:
            wrong = tf.logical_and(index >= steps, tf.logical_not(_is_filler(element)))
            message = [f"{COUNT_CHANGED} on rank {rank}: a pass has more than the {steps} "
                       f"batches counted on the first pass; {fix}"]
        else:
            wrong = _is_filler(element)
            message = [f"{COUNT_CHANGED} on rank {rank}: a pass ended after", index,
                       f"batches, fewer than the {steps} every rank runs, and a model's own "
                       f"train_step cannot be given filler; {fix}"]
        with tf.control_dependencies([tf.debugging.Assert(tf.logical_not(wrong), message)]):
            return index, tf.nest.map_structure(tf.identity, element)

    checked = checked.map(check)
    if look_past:
        checked = checked.filter(lambda index, _: index < steps)
    return checked.map(lambda _, element: element)


def even_passes(one_pass: Callable[[int], tf.data.Dataset], template: tuple, steps: int,
                fill: bool, rank: int, first_pass: int, end_pass: int,
                counted: bool = True) -> tf.data.Dataset:
    """Passes ``[first_pass, end_pass)`` of a rank's batches back to back, each ``evened`` to
    ``steps``. ``one_pass(index)``: the rank's batches of that pass (reading a user's dataset
    again is its next pass: a ``shuffle`` in it reshuffles, as under Keras)."""
    stream = evened(one_pass(first_pass), steps, template, fill, rank, counted)
    for index in range(first_pass + 1, end_pass):
        stream = stream.concatenate(evened(one_pass(index), steps, template, fill, rank,
                                           counted))
    return stream


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
