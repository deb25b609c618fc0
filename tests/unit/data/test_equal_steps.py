"""Equal steps without made-up input, single process (``hvdtrain.data.equal_steps``): what a
rank that runs short is given, what a rank that may not fill does, what a pass of the wrong
length raises, and ``steps_per_epoch`` read exactly as Keras' own ``fit`` reads it."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.collectives import World
from hvdtrain.data.datasets import DatasetSplit
from hvdtrain.data.equal_steps import (COUNT_CHANGED, EqualPass, Passes, count_changed_line,
                                       left_out_line)
from hvdtrain.data.pipeline import ShardSpec

WORDS = np.array(["alpha", "beta", "gamma", "delta", "epsilon"])


def _strings(batches: int, batch: int = 4) -> tf.data.Dataset:
    """A pre-batched dataset of vocabulary strings (what broke on a filler of "")."""
    rows = batches * batch
    return tf.data.Dataset.from_tensor_slices((WORDS[np.arange(rows) % 5],
                                               np.arange(rows, dtype=np.int64))).batch(batch)


def test_a_short_rank_is_filled_with_real_examples_at_weight_zero():
    """7 batches over 2 ranks: rank 1 has 3, the ranks agree on 4; its fourth batch is the
    data's first batch (real strings, real ids) with loss weight zero, never "" or zeros."""
    split = DatasetSplit(_strings(7))
    spec = ShardSpec(0, World(1, 2), 4, "pad", agreed_steps=4)
    assert split.steps_per_epoch(spec) == 3
    batches = list(split.dataset(spec, 0, 1))
    assert len(batches) == 4
    assert [float(b[3].numpy().sum()) for b in batches] == [4.0, 4.0, 4.0, 0.0]
    filler = batches[3]
    assert set(filler[0].numpy().astype(str)) <= set(WORDS)
    np.testing.assert_array_equal(filler[1].numpy(), [0, 1, 2, 3])   # the data's first batch
    assert all(b[0].numpy().astype(str).all() for b in batches)      # no empty string


def test_a_rank_that_may_not_fill_stops_at_the_agreed_count():
    """A model's own step: rank 0 has 4 batches, the ranks agree on the fewest, 3."""
    split = DatasetSplit(_strings(7))
    spec = ShardSpec(0, World(0, 2), 4, "drop", agreed_steps=3)
    batches = list(split.dataset(spec, 0, 2))
    assert len(batches) == 6 and all(float(b[3].numpy().min()) == 1.0 for b in batches)


def test_a_declared_count_takes_that_many_batches_and_leaves_the_rest():
    """``validation_steps=2`` (a count the user gave, not one counted): rank 0's 4 batches
    give 2, as Keras' evaluate takes 2; no error for the rest; a validation dataset that
    repeats forever gives 2 too, filled or as one rank's own share (a model's own step)."""
    split = DatasetSplit(_strings(7), declared_steps=2)
    spec = ShardSpec(0, World(0, 2), 4, "pad", agreed_steps=2)
    assert [float(b[3].numpy().sum()) for b in split.dataset(spec, 0, 1)] == [4.0, 4.0]
    endless = DatasetSplit(_strings(7).repeat(), declared_steps=2)
    assert len(list(endless.dataset(spec, 0, 1))) == 2
    unpadded = ShardSpec(0, World(0, 2), 4, "pad", False, equal_steps=False)
    assert len(list(endless.dataset(unpadded))) == 2


def _pass_of(lengths: list[int]) -> tf.data.Dataset:
    """A dataset whose k-th pass yields ``lengths[k]`` batches (a random filter's effect)."""
    passes = iter(lengths)

    def batches():
        for index in range(next(passes)):
            yield np.full((2, 1), index, np.float32)

    return tf.data.Dataset.from_generator(
        batches, output_signature=tf.TensorSpec((None, 1), tf.float32)).map(
        lambda x: (x, (), tf.ones([2]), tf.ones([2])))


@pytest.mark.parametrize("fill, own, lengths, wrong", [
    (False, 3, [3, 2], "a pass had 2 batch(es), fewer than the 3 batches counted"),
    (True, 3, [3, 4], "a pass had more than the 3 batches counted"),
    (True, 2, [2, 1], "a pass had 1 batch(es), fewer than the 2 batches counted")])
def test_a_pass_of_another_length_than_counted_stops_with_one_line(fill, own, lengths, wrong):
    """Every pass must have the length its rank counted on the first (no more reading than
    that): a model's own step cannot be filled, and a filled rank must not lose batches."""
    template = (tf.zeros([2, 1]), (), tf.ones([2]), tf.ones([2]))
    shape = EqualPass(3, own, fill, any_short=own < 3)
    one = _pass_of(lengths)
    stream = shape.apply(one, template).concatenate(shape.apply(one, template))
    with pytest.raises(tf.errors.FailedPreconditionError) as raised:
        list(stream)
    line = count_changed_line(str(raised.value), 1)
    assert line.startswith(f"{COUNT_CHANGED} on rank 1: {wrong}"), line
    assert "\n" not in line and "steps_per_epoch" in line


def test_the_filler_is_read_only_when_some_rank_fills():
    """Ranks that all counted the same read no filler (a seeded shuffle's order then moves
    no further than the order check and the probe move it); one short rank, or a count the
    user declared, makes every rank read it."""
    assert not EqualPass(3, 3, True, any_short=False).needs_filler
    assert EqualPass(3, 3, True, any_short=True).needs_filler
    assert EqualPass(3, None, True, any_short=True).needs_filler     # a declared count
    assert not EqualPass(3, 4, False, any_short=False).needs_filler  # a model's own step


def test_the_left_out_line_counts_examples_or_batches():
    assert left_out_line([3, 3], 3, None, 4) is None
    assert "leaves out 1 batch(es) (rank 0: 4 batches, rank 1: 3 batches)" in left_out_line(
        [4, 3], 3, None, 4)
    # 1,001 examples, batch 32: 501 and 500 rows make 15 whole batches each; 41 left out.
    assert "leaves out 41 example(s) (rank 0: 501, rank 1: 500)" in left_out_line(
        [15, 15], 15, [501, 500], 32)


class _EpochLengths(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.lengths.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.lengths[-1] += 1


@pytest.mark.parametrize("pass_steps, steps_per_epoch, epochs", [
    (5, None, 3), (5, 8, 3), (10, 4, 7), (6, 3, 5), (7, 7, 2)])
def test_passes_read_steps_per_epoch_as_keras_fit_does(pass_steps, steps_per_epoch, epochs):
    """The epoch lengths ``Passes`` gives are the ones plain Keras ``fit`` runs on a dataset of
    ``pass_steps`` batches with that ``steps_per_epoch`` (8 > 5: every epoch one whole pass;
    4 of 10: 4, 4, 2, then a new pass)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    data = tf.data.Dataset.from_tensor_slices((np.ones((pass_steps, 1)),
                                               np.ones((pass_steps, 1)))).batch(1)
    counter = _EpochLengths()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.fit(data, epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=[counter],
                  verbose=0)
    passes = Passes(pass_steps, steps_per_epoch, 0)
    assert passes.epoch_lengths(0, epochs) == counter.lengths
    cut = [passes.cut_short(epoch) for epoch in range(epochs)]
    assert cut == [steps_per_epoch is not None and length < steps_per_epoch
                   for length in counter.lengths]
    ran_out = sum("ran out of data" in str(w.message) for w in seen)
    assert ran_out == sum(cut)                     # Keras warns where Passes says it is cut
