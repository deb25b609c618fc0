"""What the setup phase of a run hands the later ones (``Prepared``: the world, the data and its
plan, the model with its step, validation, checkpoints), and where training starts after the
restore phase (``StartingPoint``). ``run`` holds the phases themselves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import keras

from hvdtrain.checkpoints.state import CheckpointState
from hvdtrain.checkpoints.store import CheckpointStore
from hvdtrain.collectives import Collectives
from hvdtrain.data.contract import DataBundle
from hvdtrain.data.pipeline import ShardSpec
from hvdtrain.training.data_plan import DataPlan
from hvdtrain.training.loops.checkpointing import ResumePoint
from hvdtrain.training.loops.run_callbacks import FirstStepClock
from hvdtrain.training.loops.run_columns import RunColumnsLog
from hvdtrain.training.memory import HeldMemory
from hvdtrain.training.step.core import TrainingStep
from hvdtrain.training.step.schedule import PlateauDecay
from hvdtrain.training.step.trainable import Trainable


@dataclass(kw_only=True)
class Prepared:
    """What the setup phase hands the later ones: the world and run directory, the data and
    its shard plan, the model with the step and rates that train it, validation, the user's
    callbacks, and what every checkpoint of this run records (``state``)."""

    collectives: Collectives
    run_dir: Path
    resuming: bool
    data: DataBundle
    trainable: Trainable
    step: TrainingStep
    plan: DataPlan
    evaluate: Callable[[ShardSpec], dict[str, float]]
    plateau: PlateauDecay | None
    user_callbacks: list[keras.callbacks.Callback]
    store: CheckpointStore
    state: CheckpointState
    launched: float
    first_step: FirstStepClock = dataclasses.field(default_factory=FirstStepClock)
    run_columns: RunColumnsLog = dataclasses.field(default_factory=RunColumnsLog)
    # The last validation during training: (epoch, the weights' fingerprint, exact metrics).
    validated: tuple[int, str, dict[str, float]] | None = None
    # What this rank held for training, measured as the loop ended (None: elastic).
    memory: HeldMemory | None = None
    # Where this rank computes (``place_devices``' words).
    device: str = ""
    # Rank 0's ``tracking.live.Tracker`` of a tracked job (None: not tracked, other ranks).
    tracker: Any = None

    @property
    def spec(self) -> ShardSpec:
        """The training shard spec (its ``steps_per_epoch``: one pass, agreed)."""
        return self.plan.spec

    def validate(self) -> dict[str, float]:
        """Exact held-out metrics on this world's shards (none without validation data)."""
        if self.data.val is None:
            return {}
        spec, world = self.plan.val_spec, self.collectives.world
        if spec.world != world:   # an elastic job's world changed: this world's shards
            spec = ShardSpec(spec.num_examples, world, spec.batch_size, "pad", False)
        return self.evaluate(spec)


@dataclass(frozen=True)
class StartingPoint:
    """Where training starts (after a restore) and every rank's weight fingerprint before rank
    0's weights were broadcast."""

    resume: ResumePoint
    initial_epoch: int
    before_broadcast: list[str]
