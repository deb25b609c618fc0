"""What a program is, and the instruments it counts with.

Each program is a function ``program(ctx: Context) -> Outcome`` written once and run three
ways (``programs.ranks``):

* ``hvdtrain``: on 2 ranks, ``ctx.fit`` is ``hvdtrain.fit`` with ``ctx.batch`` per rank;
* ``dropin``: on 2 ranks the Horovod way (``import hvdtrain.keras as hvd``): the program shards
  its own data where a Horovod user does (``ctx.shard``: ``x[hvd.rank()::hvd.size()]``;
  ``ctx.shard_dataset``: ``dataset.shard(hvd.size(), hvd.rank())``), wraps its optimizer in
  ``hvd.DistributedOptimizer`` (``ctx.optimizer``, no rate scaling) and ``ctx.fit`` is
  ``model.fit`` with ``BroadcastGlobalVariablesCallback(0)`` and ``MetricAverageCallback()``
  first;
* ``keras``: one plain process, ``ctx.batch`` twice the per-rank batch: the reference.

In the ``hvdtrain`` and ``keras`` modes ``ctx.shard``, ``ctx.shard_dataset`` and
``ctx.optimizer`` change nothing. An unbatched ``tf.data.Dataset`` is batched by
``batch_size`` in ``ctx.fit`` outside hvdtrain (Keras takes datasets batched); a function that
builds the dataset (``hvdtrain.fit(model, x=make_dataset)``) is called there.

How the tests count examples. Under hvdtrain's exact step a rank that runs short of batches is
filled with real batches of its own data carrying loss weight zero, so a layer counting ids in
the forward pass would count the filler rows too. Compiled metrics see real rows only (and
Keras updates them once per example it trains on or evaluates), so a counted program gives its
model one more input, ``example_id``, echoed to one more output, ``ids``, that has no loss and
one metric, ``SeenIds``, which adds one per id to a counter. Training and validation ids come
from disjoint ranges, so one counter tells both apart. A model with its own ``train_step`` (the
Distiller) counts the ids of the batches its step trains on, which never include filler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

MODES = ("hvdtrain", "dropin", "keras")
WORLD = 2                # ranks of the distributed jobs; one process runs WORLD x the batch
VAL_IDS = 10_000         # validation example ids start here; training ids below


@dataclass
class Context:
    """Where a program runs: the mode, this process's rank and world size, the batch size its
    own code uses (per rank on 2 ranks, the global batch in one process) and ``fit``."""

    mode: str
    rank: int
    size: int
    batch: int
    fit_function: Callable[..., dict[str, Any]]
    directory: Path                  # for the files a program's callbacks write

    def fit(self, model: keras.Model, x: Any = None, y: Any = None, **kwargs: Any) -> dict:
        """``model.fit`` (``hvdtrain.fit`` in hvdtrain mode); returns the History's dict."""
        return self.fit_function(model, x, y, **kwargs)

    def shard(self, *values: Any) -> Any:
        """The drop-in user's ``values[hvd.rank()::hvd.size()]`` (arrays or dicts of them)."""
        if self.mode != "dropin":
            return values if len(values) > 1 else values[0]
        shards = tuple(tf.nest.map_structure(lambda a: a[self.rank::self.size], v)
                       for v in values)
        return shards if len(shards) > 1 else shards[0]

    def shard_dataset(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """The drop-in user's ``dataset.shard(hvd.size(), hvd.rank())``."""
        return dataset.shard(self.size, self.rank) if self.mode == "dropin" else dataset

    def writers(self, *callbacks: keras.callbacks.Callback) -> list[keras.callbacks.Callback]:
        """Callbacks that write files: the drop-in user gives them to rank 0 alone
        (``if hvd.rank() == 0``); hvdtrain takes them on every rank and writes from rank 0."""
        return list(callbacks) if self.mode != "dropin" or self.rank == 0 else []

    def optimizer(self, optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
        """The drop-in user's ``hvd.DistributedOptimizer(optimizer)`` (no rate scaling)."""
        if self.mode != "dropin":
            return optimizer
        import hvdtrain.keras as hvd

        return hvd.DistributedOptimizer(optimizer)


@dataclass
class Outcome:
    """What a program leaves for the tests: models whose final weights are compared, example
    counters (by name; index = example id), its own ``train_step`` counter and notes."""

    models: dict[str, keras.Model]
    counts: dict[str, tf.Variable] = field(default_factory=dict)
    own_steps: tf.Variable | None = None
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Spec:
    """A program, the modes it runs in (and why not in the others), its batch, and the
    tolerance of its comparison with one process:

    * ``batch``: per rank on 2 ranks (one process runs ``WORLD`` times it); ``options``: more
      ``hvdtrain.fit`` arguments in hvdtrain mode (the user programs' small gradient buckets);
    * ``tolerance``: relative, for the final weights and every epoch's metrics, on 2 ranks
      under hvdtrain (absolute: a tenth of it); ``dropin_tolerance`` the same for the drop-in,
      whose update is the mean of the ranks' means and so equals one process only when both
      ranks' batches have the same size (not with an odd example count);
    * None where that does not hold or the program draws at random (augmentation, unseeded
      shuffles): then every epoch's loss within ``loss_tolerance`` relative;
    * ``rank_averaged``: metrics Horovod's ``MetricAverageCallback`` averages over the ranks'
      own values where one process computes them over all the data; the drop-in's training
      values are compared as such: a count is half the total, a ratio (precision, recall)
      within 0.01 absolute of the whole data's.
    """

    build: Callable[[Context], Outcome]
    modes: tuple[str, ...] = MODES
    skipped: str = ""                 # why a mode is left out
    batch: int = 16
    options: dict[str, Any] = field(default_factory=dict)
    tolerance: float | None = 1e-5
    dropin_tolerance: float | None = 1e-5
    loss_tolerance: float = 0.0
    rank_averaged: dict[str, str] = field(default_factory=dict)   # metric -> count | ratio
    counted: str = ""                 # what the counters must show ("" not counted)
    # Rows coupled within a batch (a loss over the batch, batch normalisation): hvdtrain is
    # exact (1e-5) or says so on rank 0 in one line containing one of these.
    coupled: tuple[str, ...] = ()


def digits() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's 1,797 digits: images of 8 x 8 x 1 in [0, 1], labels 0-9."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images / 16.0).astype(np.float32)[..., None], bunch.target.astype(np.int64)


def counter(size: int) -> tf.Variable:
    """How often each example id was seen (a TensorFlow variable: no model or metric tracks it,
    so every rank keeps its own)."""
    return tf.Variable(tf.zeros([size], tf.int64), trainable=False)


class SeenIds(keras.metrics.Metric):
    """The tests' instrument (see the module doc): adds one per id in ``y_true`` to ``counts``;
    its result is always 0, so the logs do not depend on it."""

    def __init__(self, counts: tf.Variable, name: str = "seen", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self._counts = [counts]

    def update_state(self, y_true, y_pred, sample_weight=None):
        ids = tf.reshape(tf.cast(y_true, tf.int64), [-1])
        self._counts[0].scatter_nd_add(ids[:, None], tf.ones_like(ids))

    def result(self):
        return tf.constant(0.0)

    def reset_state(self):
        pass


def example_id_input() -> keras.KerasTensor:
    return keras.Input((), dtype="int64", name="example_id")


def echoed(example_id: keras.KerasTensor) -> keras.KerasTensor:
    """The ``ids`` output: the example's id, unchanged (no loss; counted by ``SeenIds``)."""
    return keras.layers.Identity(name="ids")(example_id)


def ids(first: int, count: int) -> np.ndarray:
    return np.arange(first, first + count, dtype=np.int64)
