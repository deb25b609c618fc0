"""The data plan in one process (``data/pipeline.py``): which example ids each rank trains at
each step under a ``ShardSpec``: a partial global batch padded with zero-weight rows or dropped,
a shuffle seeded per epoch, the same global batches as one process with the larger batch, an
epoch resumed on another world size, and the dataset that gathers the planned ids' features."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from hvdtrain.collectives import World
from hvdtrain.data.pipeline import ShardSpec, array_dataset, epoch_plan, real_rows_only


def plans(n: int, size: int, batch: int, remainder: str = "pad", epoch: int = 0):
    specs = [ShardSpec(n, World(rank, size), batch, remainder, True, 5) for rank in range(size)]
    return specs, [tuple(t.numpy() for t in epoch_plan(spec, epoch)) for spec in specs]


@pytest.mark.parametrize("n, size, batch", [(100, 2, 8), (101, 2, 8), (37, 3, 4), (5, 2, 4)])
def test_pad_policy_partitions_every_epoch(n, size, batch):
    specs, shards = plans(n, size, batch)
    ids = np.concatenate([s[0].ravel() for s in shards])
    assert sorted(ids[ids >= 0].tolist()) == list(range(n))       # each example exactly once
    assert len({s[0].shape for s in shards}) == 1                  # same step count per rank
    weights = sum(s[1].sum(axis=1) for s in shards)                # per-step weights sum to 1
    np.testing.assert_allclose(weights, np.ones(specs[0].steps_per_epoch), rtol=1e-6)


def test_drop_policy_skips_only_the_partial_global_batch():
    specs, shards = plans(101, 2, 8, "drop")
    ids = np.concatenate([s[0].ravel() for s in shards])
    assert specs[0].steps_per_epoch == 6 and len(set(ids.tolist())) == 96 and ids.min() >= 0


def test_shuffle_is_seeded_and_changes_each_epoch():
    first = plans(64, 2, 8, epoch=0)[1][0][0]
    again = plans(64, 2, 8, epoch=0)[1][0][0]
    second = plans(64, 2, 8, epoch=1)[1][0][0]
    assert np.array_equal(first, again) and not np.array_equal(first, second)


def test_global_batches_match_one_process_with_the_larger_batch():
    """Rank blocks of each global batch, side by side, are the single process's batch; the
    short last one (2 rows) is spread over both ranks, one row each."""
    _, two = plans(50, 2, 4)
    _, one = plans(50, 1, 8)
    for step, expected in enumerate(one[0][0]):
        side_by_side = np.concatenate([two[0][0][step], two[1][0][step]])
        assert side_by_side[side_by_side >= 0].tolist() == expected[expected >= 0].tolist()
    assert [(two[rank][0][-1] >= 0).sum() for rank in (0, 1)] == [1, 1]


def test_an_epoch_resumed_with_another_world_size_is_still_a_partition():
    """Elastic training: 3 global batches on 2 ranks, then the rest of the epoch on 3 ranks
    from the offset: together every example exactly once."""
    first = [epoch_plan(ShardSpec(101, World(r, 2), 5, "pad", True, 9), 4)[0].numpy()[:3]
             for r in range(2)]
    rest = [epoch_plan(ShardSpec(101, World(r, 3), 5, "pad", True, 9, offset=30), 4)[0].numpy()
            for r in range(3)]
    ids = np.concatenate([a.ravel() for a in first + rest])
    assert sorted(ids[ids >= 0].tolist()) == list(range(101))


def test_dataset_gathers_features_for_the_planned_ids():
    x = np.arange(10, dtype=np.float32)[:, None] * 10
    y = np.arange(10)
    spec = ShardSpec(10, World(1, 2), 3, "pad", True, 1)
    ids, _ = epoch_plan(spec, 0)
    for (features, labels, _, weights), row in zip(array_dataset(x, y, spec), ids.numpy()):
        real = row >= 0
        assert np.array_equal(labels.numpy()[real], row[real])
        assert np.array_equal(features.numpy()[real, 0], row[real] * 10)
        assert np.all(weights.numpy()[~real] == 0)


def test_only_a_plan_with_short_batches_is_cut_to_real_rows():
    """Whole global batches keep the batch size static (as Keras' fit keeps it when no batch is
    short); a short last one is cut to each rank's real rows."""
    whole = ShardSpec(64, World(0, 2), 8, "pad", False)
    short = ShardSpec(50, World(1, 2), 8, "pad", False)
    assert not whole.short_batches and short.short_batches
    assert not ShardSpec(50, World(0, 2), 8, "drop", False).short_batches
    batches = array_dataset(np.arange(50, dtype=np.float32)[:, None], np.zeros(50), short)
    rows = [int(tf.shape(x)[0]) for x, *_ in real_rows_only(batches, short)]
    assert rows == [8, 8, 8, 1]
