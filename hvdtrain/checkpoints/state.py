"""What a checkpoint's ``state.json`` holds, typed, and the one place that writes and reads it.

A run describes what it trains (model, data, optimizers, config) in a ``CheckpointState``; each
checkpoint adds where the run stands (epochs done, or steps into the next with its metric sums),
the rate factors, and, as the store writes it, each optimizer's variables and the files'
SHA-256. A key missing from an older checkpoint reads as its default, and what a resume compares
as ``NOT_RECORDED`` (``None`` is a value some fields hold), so older checkpoints still resume.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any


class Unrecorded(enum.Enum):
    """The type of ``NOT_RECORDED`` (an enum: one value, kept by pickling and copying)."""

    NOT_RECORDED = "not recorded"


NOT_RECORDED = Unrecorded.NOT_RECORDED


def _built_for_the_model_optimizer() -> dict[str, list[str] | None]:
    """Checkpoints of earlier versions hold the state of the model's ``optimizer`` alone,
    without the variables it was built for (None: restore it as the model builds it)."""
    return {"optimizer": None}


# A position as its readers take it: whole numbers, and the epoch's metric sums as a tuple.
_POSITION = {"epoch": int, "step": int, "epoch_state": tuple}


@dataclass(frozen=True)
class CheckpointState:
    """``state.json``. Field order is the order of its keys."""

    # What the run trains: the same for every checkpoint of a run, compared on resume.
    model: str | None = None
    dataset: str | Unrecorded = NOT_RECORDED
    input_shape: Any = NOT_RECORDED          # as JSON holds it: lists, not tuples
    num_classes: int | None | Unrecorded = NOT_RECORDED
    examples: int | None | Unrecorded = NOT_RECORDED       # None: a pipeline's, uncounted
    optimizer_classes: dict[str, str] | Unrecorded = NOT_RECORDED   # attribute -> class name
    world_size: int | Unrecorded = NOT_RECORDED
    config: dict[str, dict[str, Any]] = field(default_factory=dict)   # Config.to_dict()
    # Live training state beside the optimizers' variables.
    rates: dict[str, float] = field(default_factory=dict)       # RateControl's factors
    plateau: dict[str, float] | None = None                     # PlateauDecay's, if any
    # The rate's world-size factor in use (a resume on another world size with the same update
    # batch keeps its checkpoint's); not recorded: the one --lr-scaling gives ``world_size``.
    rate_scale: float | Unrecorded = NOT_RECORDED
    # Where the run stands.
    epoch: int = 0
    step: int = 0                  # > 0: a checkpoint within the epoch after ``epoch``
    epoch_state: tuple = ()        # within an epoch: its metric sums over all ranks so far
    metrics: dict[str, float] = field(default_factory=dict)     # at an epoch's end: its metrics row
    # Written by the store: optimizer attribute -> the model variables (paths) it was built
    # for, and file name -> SHA-256.
    optimizers: dict[str, list[str] | None] = field(
        default_factory=_built_for_the_model_optimizer)
    files: dict[str, str] = field(default_factory=dict)
    # A ZeRO run's {"zero_stage", "ranks"}: its optimizer state was held in pieces, gathered
    # whole into optimizer.npz, so any number of ranks resumes it (None: not sharded).
    sharded: dict[str, int] | None = None

    def to_json(self) -> str:
        """The text of ``state.json``. Left out, as they always were: what is not recorded,
        the plateau state of a run without plateau decay, the step and metric sums at an
        epoch's end and the metrics within an epoch."""
        left_out = {"metrics"} if self.step else {"step", "epoch_state"}
        left_out.update(name for name in ("plateau", "sharded") if getattr(self, name) is None)
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                           if f.name not in left_out
                           and getattr(self, f.name) is not NOT_RECORDED}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CheckpointState:
        """The state ``text`` holds; keys of other versions are ignored, missing fields take
        their defaults. Raises ValueError when the text is not a checkpoint's state (not JSON,
        not a mapping, no epoch, a position that is not a number)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a mapping")
        if "epoch" not in data:
            raise ValueError("it holds no epoch")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {name: value for name, value in data.items() if name in names}
        try:
            values.update({name: kind(values[name]) for name, kind in _POSITION.items()
                           if name in values})
        except TypeError as error:
            raise ValueError(f"its position is not a number ({error})") from error
        return cls(**values)

    def as_saved(self) -> CheckpointState:
        """This state as a checkpoint gives it back (tuples become lists): what a saved state
        is compared with."""
        return self.from_json(self.to_json())
