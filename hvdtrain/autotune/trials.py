"""``--autotune`` on the ranks: the search of ``autotune.search`` timed on the run's own model,
optimizer, loss and a real batch of its data, on the ranks and network it was launched on.

Every rank runs the same trials in the same order: Horovod restarted with the trial's cycle time
(Horovod reads it only when it starts; restarting works under MPI and Gloo), the weights and
optimizer state put back, a few untimed updates, then about ``TIMED_S`` seconds of timed ones on
one batch. Rank 0's median is broadcast so the search makes the same choices everywhere. Nothing
is kept: the weights, optimizer state and cycle time are restored after the last trial, and only
``autotune.json`` is written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Sequence

import tensorflow as tf

from hvdtrain.checkpoints.store import atomic_write_text
from hvdtrain.collectives import Collectives, GradientReduction
from hvdtrain.collectives.horovod_backend import HorovodCollectives
from hvdtrain.config import bucket_bytes
from hvdtrain.errors import UserError
from hvdtrain.autotune.search import (GRID, TABLE_HEADER, Outcome, Setting, search, table_row,
                                      trial_count)
from hvdtrain.training.step.own import OwnStep
from hvdtrain.training.step.core import TrainingStep
from hvdtrain.artifacts import run_files

WARMUP_UPDATES = 3
# Timed updates per trial: enough to fill TIMED_S at the last warm-up's pace, within these.
TIMED_S = 2.0
TIMED_UPDATES = (10, 200)
# Horovod's own cycle time when HOROVOD_CYCLE_TIME is not set.
HOROVOD_CYCLE_MS = 1.0
CYCLE_VARIABLE = "HOROVOD_CYCLE_TIME"
FUSION_NOT_SEARCHED = ("autotune: Horovod's fusion threshold is not searched (Horovod 0.28.1 "
                       "cannot restart in a process once it and the cycle time are set); the "
                       "scaling study times thresholds (python -m hvdtrain.bench.scaling "
                       "--fusion-mib)")
RESULT_FILE = "autotune.json"


@dataclass(frozen=True)
class Tuning:
    """What the search needs of the run: its collectives, a fresh step of it whose gradients
    travel in buckets of a given MiB, one real batch, the calls of the step per update, whether
    it reduces with Adasum (no buckets), the bucket size it was launched with, and where
    ``autotune.json`` goes."""

    collectives: Collectives
    step_for: Callable[[float], TrainingStep]
    batch: Any
    micro_steps: int
    adasum: bool
    bucket_mib: float
    run_dir: Path


# The launch settings the search depends on: read on rank 0 and broadcast, so that ranks whose
# environments differ (a GPU node gets no CPU cycle-time default) still run the same trials.
LAUNCH_VARIABLES = (CYCLE_VARIABLE, "HOROVOD_FUSION_THRESHOLD", "HOROVOD_AUTOTUNE")


def launch_environment(collectives: Collectives) -> dict[str, str | None]:
    """Rank 0's values of ``LAUNCH_VARIABLES``, on every rank."""
    return collectives.broadcast_object({name: os.environ.get(name)
                                         for name in LAUNCH_VARIABLES})


def cycle_fixed(collectives: Collectives, environment: dict[str, str | None]) -> str | None:
    """Why Horovod's cycle time cannot be searched in this job, or None."""
    if collectives.backend != "horovod":
        return f"the {collectives.backend} backend has no cycle time"
    if environment.get("HOROVOD_FUSION_THRESHOLD") is not None:
        return ("launched with HOROVOD_FUSION_THRESHOLD set, Horovod 0.28.1 cannot restart in a "
                "process to take another cycle time")
    return None


def launched_setting(tuning: Tuning, cycle_searched: bool,
                     environment: dict[str, str | None]) -> Setting:
    """The settings this job runs with now (Horovod's cycle time where none is set)."""
    cycle = float(environment.get(CYCLE_VARIABLE) or HOROVOD_CYCLE_MS)
    return Setting(None if tuning.adasum else tuning.bucket_mib,
                   cycle if cycle_searched else None)


def autotune(tuning: Tuning, say: Callable[[str], None]) -> Outcome:
    """Run the search on this rank (every rank calls it), report its table and best settings
    through ``say`` (hvdtrain's logger: rank 0's lines), write ``autotune.json`` (rank 0) and
    return it."""
    world = tuning.collectives.world
    if world.size == 1:
        raise UserError("--autotune times how gradients travel between ranks; launch it on the "
                        "ranks you train on (horovodrun -np N, mpirun, srun)")
    environment = launch_environment(tuning.collectives)
    if (environment.get("HOROVOD_AUTOTUNE") or "0") != "0":
        raise UserError("--autotune times fixed settings, but HOROVOD_AUTOTUNE makes Horovod "
                        "change them as it runs; unset HOROVOD_AUTOTUNE")
    fixed = cycle_fixed(tuning.collectives, environment)
    if fixed and tuning.adasum:
        raise UserError(f"--autotune has nothing to search: --reduction adasum sends each "
                        f"gradient on its own (no buckets) and {fixed}")
    launched = launched_setting(tuning, fixed is None, environment)
    if tuning.collectives.backend == "horovod":
        say(FUSION_NOT_SEARCHED)
    if fixed:
        say(f"autotune: {fixed}: searching the bucket size only")
    if tuning.adasum:
        say("autotune: --reduction adasum sends each gradient on its own (no buckets): "
            "searching Horovod's cycle time only")
    trials = Trials(tuning, launched)
    if launched.bucket_mib is not None:
        groups = alike(trials.plan, (launched.bucket_mib, *GRID["bucket_mib"]))
        if groups:
            say("autotune: these bucket sizes split this model's gradients alike and are timed "
                "once: " + "; ".join(", ".join(f"{mib:g}" for mib in group) + " MiB"
                                     for group in groups))
    low, high = TIMED_UPDATES
    order = " then ".join(name for knob, name in (("bucket_mib", "the bucket size"),
                                                  ("cycle_ms", "the cycle time"))
                          if getattr(launched, knob) is not None)
    say(f"autotune: up to {trial_count(launched)} settings, each {WARMUP_UPDATES} warm-up and "
        f"{low} to {high} timed updates (about {TIMED_S:g} s) on one batch; {order}, keeping "
        "the fastest; rank 0's median:")
    say(TABLE_HEADER)
    with trials.kept_as_launched():
        outcome = search(launched, trials.measure, lambda trial: say(table_row(trial, launched)),
                         trials.same)
    say(outcome.final_line())
    if world.is_chief:
        with run_files(tuning.run_dir, RESULT_FILE):
            atomic_write_text(tuning.run_dir / RESULT_FILE,
                              json.dumps(outcome.to_json(), indent=2) + "\n")
    return outcome


class Trials:
    """This rank's side of the search: measures a setting (see the module doc)."""

    def __init__(self, tuning: Tuning, launched: Setting) -> None:
        self.tuning = tuning
        self.running = launched        # the setting whose cycle time Horovod runs with now
        self.steps: dict[float | None, tuple[TrainingStep, Callable[..., Any]]] = {}
        first = self._step(launched.bucket_mib)[0]
        self.state = State(first)
        self.variables = first.model.trainable_variables

    def plan(self, bucket_mib: float | None) -> tuple[tuple[int, ...], ...] | None:
        """How buckets of ``bucket_mib`` split the model's gradients (None: no buckets)."""
        if bucket_mib is None:
            return None
        reduction = GradientReduction(bucket_bytes=bucket_bytes(bucket_mib))
        return tuple(tuple(bucket) for bucket in reduction.buckets(self.variables))

    def same(self, setting: Setting) -> Hashable:
        """Settings that run alike: the same split of the gradients, the same cycle time."""
        return self.plan(setting.bucket_mib), setting.cycle_ms

    def _step(self, bucket_mib: float | None) -> tuple[TrainingStep, Callable[..., Any]]:
        """The run's step with gradients in buckets of ``bucket_mib`` (the launched size when
        None: Adasum has none) and its traced function, made once per size."""
        if bucket_mib not in self.steps:
            step = self.tuning.step_for(self.tuning.bucket_mib if bucket_mib is None
                                        else bucket_mib)
            self.steps[bucket_mib] = (step, tf.function(step.keras_step, jit_compile=False))
        return self.steps[bucket_mib]

    def measure(self, setting: Setting) -> float:
        """Rank 0's median time per update in ms under ``setting``, on every rank."""
        self._run_horovod_with(setting)
        step, call = self._step(setting.bucket_mib)
        self.state.restore()
        with step.training():
            seconds = update_times(lambda: call(self.tuning.batch), step,
                                   self.tuning.micro_steps,
                                   self.tuning.collectives.broadcast_object)
        return self.tuning.collectives.broadcast_object(statistics.median(seconds) * 1e3)

    def _run_horovod_with(self, setting: Setting) -> None:
        """Restart Horovod when ``setting``'s cycle time is not the one it runs with: every rank
        is at the same point of the same trial, past its last collective, so none has one
        pending."""
        if setting.environment() == self.running.environment():
            return
        self.tuning.collectives.shutdown()
        os.environ.update(setting.environment())
        # Starts Horovod again in this process; the collectives the steps hold call the same
        # Horovod, now running with the new settings.
        restarted = HorovodCollectives()
        if restarted.world != self.tuning.collectives.world:
            raise RuntimeError(f"Horovod restarted as {restarted.world}, not "
                               f"{self.tuning.collectives.world}")
        self.running = setting

    @contextlib.contextmanager
    def kept_as_launched(self) -> Iterator[None]:
        """The search in the block; afterwards the weights, optimizer state and environment as
        they were before it, and Horovod with the launched cycle time (set now, if it was
        Horovod's default)."""
        launched = self.running
        saved = os.environ.get(CYCLE_VARIABLE)
        searched = False
        try:
            yield
            searched = True
        finally:   # after a failed trial too (a notebook's process goes on), without a restart
            self.state.restore()
            if searched and self.running.environment() != launched.environment():
                self._run_horovod_with(launched)
            if saved is None:
                os.environ.pop(CYCLE_VARIABLE, None)
            else:
                os.environ[CYCLE_VARIABLE] = saved


class State:
    """The model's weights and its optimizers' variables as they were before the search.
    hvdtrain's step's optimizer is built first (it would be at its first update), so its whole
    state is kept."""

    def __init__(self, step: TrainingStep) -> None:
        model = step.model
        if not isinstance(step, OwnStep) and not step.optimizer.built:
            step.optimizer.build(model.trainable_variables)
        self.variables = [*model.weights, *(variable for optimizer in step.optimizers.values()
                                            for variable in optimizer.variables)]
        self.values = [variable.numpy() for variable in self.variables]

    def restore(self) -> None:
        for variable, value in zip(self.variables, self.values):
            variable.assign(value)


def alike(plan: Callable[[float], Hashable], sizes: Sequence[float]) -> list[list[float]]:
    """The groups of two or more of ``sizes`` (MiB) that ``plan`` splits alike, in order."""
    groups: dict[Hashable, list[float]] = {}
    for mib in dict.fromkeys(sizes):
        groups.setdefault(plan(mib), []).append(mib)
    return [group for group in groups.values() if len(group) > 1]


def timed_updates(update_s: float) -> int:
    """How many updates of ``update_s`` seconds fill ``TIMED_S``, within ``TIMED_UPDATES``."""
    low, high = TIMED_UPDATES
    return max(low, min(high, math.ceil(TIMED_S / max(update_s, 1e-6))))


def update_times(call: Callable[[], Any], step: TrainingStep, micro_steps: int,
                 agree: Callable[[int], int], warmup: int = WARMUP_UPDATES,
                 clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds of each timed update after ``warmup`` untimed ones: as many as
    ``timed_updates`` says for the last warm-up's time, rank 0's count on every rank
    (``agree``: a broadcast from rank 0). An update is ``micro_steps`` calls and ends when
    reading the step's stop votes (set after its last collective) returns."""
    def update() -> float:
        start = clock()
        for _ in range(micro_steps):
            call()
        step.votes.stop_agreed()
        return clock() - start

    last = 0.0
    for _ in range(warmup):
        last = update()
    return [update() for _ in range(agree(timed_updates(last)))]
