"""A resume never mixes runs: a checkpoint records what it was trained with, and a run that
resumes it must match.

A different model is refused (its weights would not fit). Different data, optimizers or
settings that change the math (rate, seed, the update batch, ...) are refused with one line
naming the difference, unless ``--accept-changes`` (fine-tuning, more epochs at another rate).
Options that change neither (epochs, checkpointing, progress, the loop, ...) change freely.

The batch is compared as what the optimizer sees: the update batch, ranks x ``--batch-size`` x
``--accumulation-steps``. Every rank cuts one permutation per epoch, seeded by (seed, epoch),
into global batches, and an update takes the next ``accumulation-steps`` of them, so an equal
update batch on another world size (2 x 16 -> 1 x 32, or 1 x 16 x 2 accumulation steps) trains
on the same examples per update: the same run, resumed without ``--accept-changes``, its rate
keeping the checkpoint's world-size factor and its position within an epoch counted in
examples. An elastic run changes its world size (and so its global batch) by design: there
the per-rank batch is compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdtrain.checkpoints.state import NOT_RECORDED, CheckpointState
from hvdtrain.errors import UserError
from hvdtrain.training.step.schedule import scale_factor

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
# Compared together with the world size, as the update batch (``UpdateBatch``).
UPDATE_BATCH = ("batch_size", "accumulation_steps")


class MixedRuns(UserError):
    """The checkpoint to resume was trained with something else."""


@dataclass(frozen=True)
class UpdateBatch:
    """The examples behind one optimizer update: ranks x per-rank batch x accumulation steps."""

    ranks: int
    batch: int
    accumulation: int

    @property
    def global_batch(self) -> int:
        return self.ranks * self.batch

    @property
    def examples(self) -> int:
        return self.global_batch * self.accumulation

    def __str__(self) -> str:
        ranks = f"{self.ranks} rank{'' if self.ranks == 1 else 's'} x {self.batch}"
        steps = f" x {self.accumulation} accumulation steps" if self.accumulation > 1 else ""
        return f"{self.examples} ({ranks}{steps})"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _options(state: CheckpointState) -> dict[str, Any]:
    return {name: value for section in state.config.values()
            for name, value in section.items()}


def update_batch(state: CheckpointState) -> UpdateBatch | None:
    """The state's update batch; None where a checkpoint recorded no world size or batch."""
    options = _options(state)
    if state.world_size is NOT_RECORDED or "batch_size" not in options:
        return None
    return UpdateBatch(state.world_size, options["batch_size"],
                       options.get("accumulation_steps", 1))


def _by_update_batch(saved: CheckpointState, current: CheckpointState) -> bool:
    """Whether the batches compare as update batches (else as the per-rank options): both
    known, and not an elastic run, whose world size changes its global batch by design."""
    return (update_batch(saved) is not None and update_batch(current) is not None
            and not _options(current).get("elastic", False))


def _batch_changes(saved: CheckpointState, current: CheckpointState) -> list[str]:
    """The change of update batch, as ``what old -> new`` (none: the same run)."""
    before, now = _options(saved), _options(current)
    if not _by_update_batch(saved, current):
        return [f"{_flag(name)} {before[name]!r} -> {now[name]!r}" for name in UPDATE_BATCH
                if name in before and name in now and before[name] != now[name]]
    old, new = update_batch(saved), update_batch(current)
    if old.examples == new.examples:
        return []
    what = ("global batch" if old.accumulation == new.accumulation == 1 else
            "update batch (global batch x accumulation steps)")
    return [f"{what} {old} -> {new}"]


def resumed_step(saved: CheckpointState, current: CheckpointState) -> int:
    """The checkpoint's steps into its epoch as this run's steps: the same examples of the
    epoch's permutation done (rounded down, where an accepted change of global batch does not
    divide them: those few examples are trained again)."""
    if not saved.step or not _by_update_batch(saved, current):
        return saved.step
    old, new = update_batch(saved), update_batch(current)
    return saved.step * old.global_batch // new.global_batch


def _rate_policy(state: CheckpointState) -> str | None:
    """What scales the state's rate with the world size (None: not recorded)."""
    optim = state.config.get("optim", {})
    if "lr_scaling" not in optim:
        return None
    return "none" if optim.get("reduction") == "adasum" else optim["lr_scaling"]


def kept_rate_scale(saved: CheckpointState, current: CheckpointState) -> float | None:
    """The rate's world-size factor the checkpoint trained with, where this run must keep it
    rather than take its own: the same update batch and rate scaling on another world size is
    the same run, at the same rate (None: the run's own factor is the checkpoint's, or applies
    because the update batch or the scaling changed, as ``--accept-changes`` allowed)."""
    policy = _rate_policy(saved)
    if (not _by_update_batch(saved, current) or policy is None or policy != _rate_policy(current)
            or update_batch(saved).examples != update_batch(current).examples):
        return None
    kept = (scale_factor(policy, saved.world_size) if saved.rate_scale is NOT_RECORDED
            else float(saved.rate_scale))
    return None if kept == scale_factor(policy, current.world_size) else kept


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
    changed += _batch_changes(saved, current)
    changed += [f"{_flag(name)} {before[name]!r} -> {now[name]!r}" for name in now
                if name in before and before[name] != now[name]
                and name not in (*MODEL_OPTIONS, *OPERATIONAL, *UPDATE_BATCH)]
    if changed and not accept_changes:
        raise MixedRuns(f"{path} was trained with other data or settings ({'; '.join(changed)}"
                        "); pass --accept-changes to continue with the new ones, or start a "
                        "new --run-dir")
    return changed


def optimizers_changed(saved: CheckpointState, current: CheckpointState) -> bool:
    """Whether the optimizers' classes differ (their saved state then does not apply)."""
    return _differs(saved, current, "optimizer_classes")
