"""A resume never mixes runs: a checkpoint records what it was trained with, and a run that
resumes it must match.

A different model is refused (its weights would not fit). Different data, optimizers or
settings that change the math (rate, batch size, seed, ...) are refused with one line naming the
difference, unless ``--accept-changes`` (fine-tuning, more epochs at another rate). Options that
change neither (epochs, checkpointing, progress, the loop, ...) and the world size change freely.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hvdtrain.checkpoint_state import NOT_RECORDED, CheckpointState
from hvdtrain.errors import UserError

# What defines the model beside its name: the weights of another would not fit (state fields,
# and options).
MODEL = {"input_shape": "example shape", "num_classes": "class count"}
MODEL_OPTIONS = ("hidden_units", "weight_decay", "resnet_blocks", "precision")
# What the model is trained on and with (state fields); changeable on request.
RUN = {"dataset": "--dataset", "examples": "training examples",
       "optimizer_classes": "optimizer"}
# Config options that neither define nor change what a step computes (the model, the dataset
# and the optimizer are compared as what was built from them).
OPERATIONAL = ("epochs", "run_dir", "resume", "accept_changes", "progress", "debug",
               "tensorboard", "keep_checkpoints", "checkpoint_every_steps", "stall_timeout",
               "threads", "deterministic", "loop", "callbacks", "validation_freq",
               "initial_epoch", "commit_every", "cache", "data_dir", "steps_per_epoch",
               "elastic", "dataset", "model", "optimizer", "backend", "zero_stage",
               "tracking", "tracking_uri", "experiment", "track_every_steps")


class MixedRuns(UserError):
    """The checkpoint to resume was trained with something else."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _options(state: CheckpointState) -> dict[str, Any]:
    return {name: value for section in state.config.values()
            for name, value in section.items()}


def _differs(saved: CheckpointState, current: CheckpointState, name: str) -> bool:
    """Whether the checkpoint recorded field ``name`` (older ones lack some) with another
    value."""
    value = getattr(saved, name)
    return value is not NOT_RECORDED and value != getattr(current, name)


def check_resumable(saved: CheckpointState, current: CheckpointState, path: Path,
                    accept_changes: bool) -> list[str]:
    """Refuse (one line) a resume that would mix runs; return the changes accepted with
    ``--accept-changes`` (as ``what old -> new``)."""
    current = current.as_saved()     # as the checkpoint holds it: lists
    before, now = _options(saved), _options(current)
    if saved.model != current.model:
        raise MixedRuns(f"{path} was trained with model {saved.model!r}, not "
                        f"{current.model!r}; resume with the same --model")
    for name, what in MODEL.items():
        if _differs(saved, current, name):
            raise MixedRuns(f"{path} was trained with {what} {getattr(saved, name)!r}, not "
                            f"{getattr(current, name)!r}; resume with the same model, or start "
                            "a new --run-dir")
    for name in MODEL_OPTIONS:
        if name in before and before[name] != now.get(name):
            raise MixedRuns(f"{path} was trained with {_flag(name)} {before[name]!r}, not "
                            f"{now.get(name)!r}: another model; start a new --run-dir")
    changed = [f"{what} {getattr(saved, name)!r} -> {getattr(current, name)!r}"
               for name, what in RUN.items() if _differs(saved, current, name)]
    changed += [f"{_flag(name)} {before[name]!r} -> {now[name]!r}" for name in now
                if name in before and before[name] != now[name]
                and name not in MODEL_OPTIONS and name not in OPERATIONAL]
    if changed and not accept_changes:
        raise MixedRuns(f"{path} was trained with other data or settings ({'; '.join(changed)}"
                        "); pass --accept-changes to continue with the new ones, or start a "
                        "new --run-dir")
    return changed


def optimizers_changed(saved: CheckpointState, current: CheckpointState) -> bool:
    """Whether the optimizers' classes differ (their saved state then does not apply)."""
    return _differs(saved, current, "optimizer_classes")
