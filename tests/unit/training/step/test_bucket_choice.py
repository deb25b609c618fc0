"""``--bucket-choice measured`` in one process: which runs measure, the fixed schedule of timed
steps, and the margin the second way must win by. On real ranks: the bucket cases of
test_training_distributed.py (several buckets, both loops and backends) switch mid-run."""

from __future__ import annotations

import numpy as np
import pytest

from hvdtrain.collectives import GradientReduction
from hvdtrain.training.step.bucket_choice import (MARGIN, TIMED_STEPS, WARMUP_STEPS,
                                                  BucketChoice, measured_candidates)

BUCKETS = GradientReduction("sum", bucket_bytes=1024)
VARIABLES = [np.zeros(200, np.float32), np.zeros(300, np.float32)]   # 800 and 1,200 bytes


def test_only_gradients_in_two_buckets_or_more_are_measured():
    buckets, one_group = measured_candidates(BUCKETS, VARIABLES, applies=True)
    assert buckets is BUCKETS and one_group.bucket_bytes == 0 and one_group.op == "sum"
    assert measured_candidates(BUCKETS, VARIABLES[:1], applies=True) is None
    assert measured_candidates(BUCKETS, VARIABLES, applies=False) is None
    issued = GradientReduction("sum", bucket_bytes=1024, in_issue_order=True)
    assert measured_candidates(issued, VARIABLES, applies=True) is None


def chosen(step_s: tuple[float, float]) -> tuple[list[int], int | None, int]:
    """The switches a run makes when its steps take ``step_s`` with each way, and the way
    kept; and how many steps it trained."""
    now = [0.0]
    switches: list[int] = []
    choice = BucketChoice(measured_candidates(BUCKETS, VARIABLES, True), switches.append,
                          lambda: None, lambda medians: medians, clock=lambda: now[0])
    steps = 0
    while choice.kept is None:
        way = choice.current
        choice.on_train_batch_begin(steps)
        now[0] += step_s[way] * (5 if steps in (0, WARMUP_STEPS + TIMED_STEPS) else 1)
        choice.on_train_batch_end(steps)
        steps += 1
    return switches, choice.kept, steps


@pytest.mark.parametrize("step_s, switches, kept", [
    ((1.0, 0.5), [1], 1),                           # one group clearly faster: kept
    ((1.0, 1.0 - MARGIN / 2), [1, 0], 0),           # within the margin: the buckets come back
    ((0.5, 1.0), [1, 0], 0),
])
def test_the_first_steps_time_both_ways_and_keep_the_faster(step_s, switches, kept):
    """The first step of each way traces (here 5x longer) and is not timed."""
    assert chosen(step_s) == (switches, kept, 2 * (WARMUP_STEPS + TIMED_STEPS))


def test_after_the_choice_nothing_is_timed_or_switched():
    switches: list[int] = []
    choice = BucketChoice(measured_candidates(BUCKETS, VARIABLES, True), switches.append,
                          lambda: pytest.fail("settled after the choice"), lambda m: m)
    choice.kept = 0
    choice.on_train_batch_begin(0)
    choice.on_train_batch_end(0)
    assert switches == []
