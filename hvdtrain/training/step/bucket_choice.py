"""``--bucket-choice measured``: the run's first steps time both ways the gradients can travel,
and the faster is kept.

Buckets sent during the backward pass hide communication behind compute where the nodes have
cores to spare for it; where the compute takes every core the buckets' collectives take cores
from it, and where the link is slow many mid-sized messages move fewer bytes a second than one
large one. Measured on the two-node cluster (ResNet-50, one core per rank): 4 MiB buckets made a
step faster than one allreduce after the backward pass at 10 Gbit/s and slower at 1 Gbit/s
(hvdtrain/bench/README.md, "A bucket policy measured at the start"), so no fixed size wins on
both. Both are the same sums, so the choice changes when the bytes travel, not the update (with
3 or more ranks a ring adds an element's terms in an order that depends on where the message
holds it: equal up to rounding).

The schedule is fixed and every rank follows it at the same steps: ``WARMUP_STEPS`` untimed
then ``TIMED_STEPS`` timed steps with ``--bucket-mib`` buckets, the same with one allreduce after
the backward pass (the first of them traces the step again), then rank 0's medians decide on
every rank; the second way must win by ``MARGIN`` (steps on shared cores move by a few
percent), or the buckets come back (their traced function is kept, not traced a third time).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import keras

from hvdtrain.collectives import GradientReduction
from hvdtrain.log import logger

if TYPE_CHECKING:
    from hvdtrain.training.step.core import TrainingStep

WARMUP_STEPS = 2
TIMED_STEPS = 6
MARGIN = 0.05


def measured_candidates(reduction: GradientReduction, variables: Sequence[Any],
                        applies: bool) -> tuple[GradientReduction, GradientReduction] | None:
    """(the buckets, one allreduce after the backward pass) when the run measures which is
    faster: ``applies`` (the run asked for it, and its gradients travel in buckets at all:
    several ranks, no Adasum, ZeRO, PowerSGD, accumulation or XLA, submitted as ready) and the
    gradients fill two buckets or more; else None."""
    if not applies or reduction.in_issue_order or len(reduction.buckets(variables)) < 2:
        return None
    return reduction, dataclasses.replace(reduction, bucket_bytes=0)


def describe(candidates: Sequence[GradientReduction]) -> str:
    return (f"gradients: the first {2 * (WARMUP_STEPS + TIMED_STEPS)} steps time "
            f"{candidates[0].bucket_bytes / 2**20:g} MiB buckets against one allreduce after "
            "the backward pass and keep the faster (--bucket-choice measured)")


def decided(medians_s: Sequence[float], candidates: Sequence[GradientReduction]) -> int:
    """The index of the way kept, from each way's median step (rank 0's, on every rank)."""
    keep = 1 if medians_s[1] < medians_s[0] * (1 - MARGIN) else 0
    mib = candidates[0].bucket_bytes / 2**20
    shown = [f"{seconds * 1e3:,.1f} ms" for seconds in medians_s]
    ways = (f"{mib:g} MiB buckets during the backward pass",
            "one allreduce after the backward pass")
    logger.info(f"gradients: {ways[keep]} kept for the run ({shown[0]} per step with "
                f"{mib:g} MiB buckets, {shown[1]} with one allreduce; the second must win by "
                f"{MARGIN:.0%}; --bucket-choice fixed keeps --bucket-mib)")
    return keep


class BucketChoice(keras.callbacks.Callback):
    """The schedule of the module doc on a training loop's steps. ``switch(i)``: the loop
    trains with candidate ``i`` from the next step (sets the step's reduction and its traced
    function); ``settle``: waits for the last step's collectives (a read of the step's stop
    votes); ``agree``: rank 0's value on every rank (a broadcast)."""

    def __init__(self, candidates: Sequence[GradientReduction], switch: Callable[[int], None],
                 settle: Callable[[], Any], agree: Callable[[Any], Any],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.candidates = list(candidates)
        self.switch, self.settle, self.agree, self.clock = switch, settle, agree, clock
        self.times: list[list[float]] = [[], []]
        self.current = 0
        self.kept: int | None = None
        self.seen = 0
        self._began = 0.0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.kept is None:
            self._began = self.clock()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.kept is not None:
            return
        self.settle()
        self.seen += 1
        if self.seen > WARMUP_STEPS:
            self.times[self.current].append(self.clock() - self._began)
        if self.seen < WARMUP_STEPS + TIMED_STEPS:
            return
        if self.current == 0:
            self.current, self.seen = 1, 0
            self.switch(1)
            return
        medians = self.agree([statistics.median(times) for times in self.times])
        self.kept = decided(medians, self.candidates)
        if self.kept != self.current:
            self.switch(self.kept)


class TracedPerWay:
    """A loop's traced step for each way the gradients travel: ``switch(i)`` sets the step's
    reduction to candidate ``i`` and makes its function current, traced on first use."""

    def __init__(self, step: TrainingStep, trace: Callable[[], Any],
                 install: Callable[[Any], None] = lambda function: None,
                 traces_next: Callable[[], None] = lambda: None) -> None:
        """``trace``: a new traced function of the step as it is now; ``install``: put a
        function where the loop calls it (Keras' ``model.train_function``); ``traces_next``:
        told when the next step will trace (the liveness monitor then gives it a phase's
        time, not a step's)."""
        self.step, self.trace, self.install = step, trace, install
        self.traces_next = traces_next
        self.traced: dict[int, Any] = {}
        self.current = 0

    def __call__(self, *args: Any) -> Any:
        """The current way's function (the custom loop calls this)."""
        if self.current not in self.traced:
            self.traced[self.current] = self.trace()
        return self.traced[self.current](*args)

    def switch(self, index: int, now: Any = None) -> None:
        """From the next step on, candidate ``index``; ``now``: the function the loop runs at
        present (kept for the way it belongs to)."""
        if now is not None:
            self.traced[self.current] = now
        assert self.step.bucket_candidates is not None
        self.step.reduction = self.step.bucket_candidates[index]
        self.current = index
        if index not in self.traced:
            self.traces_next()
            self.traced[index] = self.trace()
        self.install(self.traced[index])


def choosing(step: TrainingStep, switch: Callable[[int], None]) -> list[keras.callbacks.Callback]:
    """The loop's ``BucketChoice`` when the step measures its buckets (else none)."""
    if step.bucket_candidates is None:
        return []
    return [BucketChoice(step.bucket_candidates, switch, step.votes.stop_agreed,
                         step.collectives.broadcast_object)]
