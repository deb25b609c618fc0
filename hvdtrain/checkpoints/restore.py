"""Where a run starts: its run directory (created, locked, resumed or not: decided on rank 0),
the newest intact checkpoint or a user's ``BackupAndRestore`` restored, then rank 0's weights
and optimizer state broadcast to every rank, each rank keeping its own random state."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import keras
import numpy as np

from hvdtrain.checkpoints.store import (CheckpointStore, assign_rank_state, atomic_write_text,
                                        build_optimizers, lock_run_dir, rank_local_variables)
from hvdtrain.checkpoints.state import CheckpointState
from hvdtrain.collectives import Collectives, World, chief_decides
from hvdtrain.config import Config
from hvdtrain.errors import UserError
from hvdtrain.keras_internals import initial_epoch_of, set_initial_epoch
from hvdtrain.log import logger
from hvdtrain.optimizers.state_into_pieces import SavedState
from hvdtrain.training.adapted_state import agree_on_adapted_state
from hvdtrain.training.loops.run_callbacks import resume_metrics_files
from hvdtrain.training.loops.checkpointing import ResumePoint
from hvdtrain.training.checks import check_elastic
from hvdtrain.checkpoints.resume_check import (check_resumable, kept_rate_scale, optimizers_changed,
                                               resumed_step, update_batch)
from hvdtrain.training.step.schedule import PlateauDecay
from hvdtrain.training.step.core import TrainingStep
from hvdtrain.training.step.trainable import Trainable
from hvdtrain.artifacts import run_files


def default_run_dir(config: Config) -> Path:
    model = re.sub(r"[^A-Za-z0-9_.-]+", "_", config.model.model)
    return Path("runs") / f"{model}-{config.data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"


def _usable_run_dir(config: Config) -> tuple[Path, bool]:
    """Rank 0: the run directory, created, writable and locked for this run, and whether the
    run resumes there (--resume required, auto, or never)."""
    run_dir = Path(config.train.run_dir) if config.train.run_dir else default_run_dir(config)
    has_run = CheckpointStore(run_dir, 1).latest() is not None
    mode = config.train.resume
    if mode == "required" and not has_run:
        raise UserError(f"--resume: no checkpoint in {run_dir}; drop --resume to start a new "
                        "run there, or use --resume auto")
    if mode == "never" and has_run:
        raise UserError(f"{run_dir} already holds a run; pass --resume to continue it or choose "
                        "another --run-dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = run_dir / ".write-probe"
        probe.write_text("")
        probe.unlink()
        lock_run_dir(run_dir)
    except OSError as error:
        raise UserError(f"run directory {run_dir} is not writable ({error.strerror}); choose "
                        "another --run-dir") from error
    return run_dir, has_run


def open_run_dir(config: Config, collectives: Collectives) -> tuple[Path, bool]:
    """The run directory and whether to resume there (decided on rank 0)."""
    world = collectives.world
    if not config.train.elastic:
        run_dir, resuming = chief_decides(collectives, lambda: _usable_run_dir(config))
        return Path(run_dir), resuming
    check_elastic(collectives)
    # No collective before the elastic loop (a joining rank starts here): rank 0 alone
    # checks the run directory.
    if world.is_chief:
        return _usable_run_dir(config)
    return Path(config.train.run_dir), config.train.resume != "never"


def weight_fingerprint(weights: Iterable[Any]) -> str:
    """A short digest of every weight's bytes (``model.weights``, or their whole values as
    stage 3 gathers them): equal on all ranks iff the weights are equal. Read one weight at
    a time: ``get_weights`` would copy the whole model at once (measured: the ranks of a
    123M-parameter stage-3 run ended 400 MiB over their limit there)."""
    digest = hashlib.sha256()
    for weight in weights:
        digest.update(np.ascontiguousarray(np.asarray(weight)).tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Restored:
    """What rank 0 restored, for every rank: the checkpoint's name, its state (no optimizer
    state or rate factors when the optimizers changed; its position in this run's steps),
    every rank's random-generator state, for each rank to take its own, and the rate's
    world-size factor this run keeps (None: its own)."""

    name: str
    state: CheckpointState
    rank_states: list[list[np.ndarray]]
    rate_scale: float | None = None

    @property
    def resume(self) -> ResumePoint:
        return ResumePoint(self.state.epoch, self.state.step, self.state.epoch_state)


def _restore(run: CheckpointState, accept_changes: bool, store: CheckpointStore,
             model: keras.Model, optimizers: dict[str, keras.optimizers.Optimizer],
             sharded: bool) -> Restored:
    """Rank 0: check that the newest intact checkpoint was trained with what this ``run``
    trains (``resume_check``), load it into the model and its optimizers (``sharded``: the
    weights only; the optimizers' state goes into pieces when the run starts,
    ``state_into_pieces``)."""
    latest = store.newest_intact(logger.warning)
    state = latest.read_state()
    changed = check_resumable(state, run, latest.path, accept_changes)
    if changed:
        logger.info(f"continuing {latest.path} with changed data or settings "
                    f"({'; '.join(changed)}), as --accept-changes asks")
    if optimizers_changed(state, run):   # only the weights carry over
        optimizers, state = {}, dataclasses.replace(state, optimizers={}, rates={})
    latest.restore(model, {} if sharded else optimizers)
    step, scale = resumed_step(state, run), kept_rate_scale(state, run)
    if step != state.step:
        logger.info(f"{state.step} steps of global batch {update_batch(state).global_batch} "
                    f"into epoch {state.epoch + 1} are {step} steps of this run's global batch "
                    f"{update_batch(run).global_batch}")
    if scale is not None:
        logger.info(f"update batch {update_batch(state)}, now {update_batch(run)}: the same "
                    f"run, so the rate keeps its world-size factor x{scale:g}")
    return Restored(latest.name, dataclasses.replace(state, step=step), latest.rank_states(),
                    scale)


def _resumed(restored: Restored, world: World, run_dir: Path, store: CheckpointStore,
             step: TrainingStep, trainable: Trainable, plateau: PlateauDecay | None,
             sharded: bool) -> ResumePoint:
    """Every rank, after rank 0 restored a checkpoint: the same optimizers built (``sharded``:
    their state left for the step to load into pieces when training starts), this rank's
    own random-generator state back, the rate factors and plateau state loaded; rank 0 makes
    the metrics files end at the checkpoint's epoch."""
    saved = restored.state
    if sharded:
        step.saved_state = SavedState(store.directory / restored.name, saved.optimizers)
    else:
        build_optimizers(trainable.model, step.optimizers, saved.optimizers)
    if restored.rate_scale is not None:
        trainable.schedule.set_world_scale(restored.rate_scale)
    generators = len(rank_local_variables(trainable.model))
    if restored.rank_states[world.rank:world.rank + 1]:
        assign_rank_state(trainable.model, restored.rank_states[world.rank][:generators])
    if step.powersgd is not None:   # saved after each rank's random-generator states
        note = step.powersgd.load([values[generators:] for values in restored.rank_states],
                                  world.rank, world.size)
        if note:
            logger.info(note)
    if plateau is not None and saved.plateau:
        plateau.load(saved.plateau)
    trainable.rates.load(saved.rates)
    start = restored.resume
    if world.is_chief:
        with run_files(run_dir, "the metrics files"):
            resume_metrics_files(run_dir, start.epoch, saved.metrics)
    where = f", step {start.step}" if start.step else ""
    held = (f" (its optimizer state was held by {saved.sharded['ranks']} rank(s) at ZeRO "
            f"stage {saved.sharded['zero_stage']}; saved whole)" if saved.sharded else "")
    logger.info(f"resuming after epoch {start.epoch}{where} from "
                f"{store.directory / restored.name}{held}")
    return start


def starting_point(config: Config, run: CheckpointState, collectives: Collectives,
                   run_dir: Path, resuming: bool, store: CheckpointStore, step: TrainingStep,
                   trainable: Trainable, plateau: PlateauDecay | None,
                   backup: keras.callbacks.BackupAndRestore | None
                   ) -> tuple[ResumePoint, list[str]]:
    """Restore when resuming (or from a user's ``BackupAndRestore``), then give every rank rank
    0's weights and optimizer state; each rank keeps (or takes back) its own random-generator
    state. ``run``: what this run trains (saved in its checkpoints, compared with theirs).
    Returns where to start and each rank's weight fingerprint before the broadcast."""
    world, model, optimizers = collectives.world, trainable.model, step.optimizers
    sharded = config.optim.zero_stage > 0
    if resuming and not sharded and trainable.own_step is None and not trainable.optimizer.built:
        trainable.optimizer.build(model.trainable_variables)

    def restore() -> Restored:
        return _restore(run, config.train.accept_changes, store, model, optimizers, sharded)

    start = ResumePoint()
    if resuming and config.train.elastic:
        # Rank 0 restores; the elastic state carries weights and epoch to the others.
        if world.is_chief:
            restored = restore()
            start = ResumePoint(restored.state.epoch)
            with run_files(run_dir, "the metrics files"):
                resume_metrics_files(run_dir, start.epoch, restored.state.metrics)
    elif resuming:
        start = _resumed(chief_decides(collectives, restore), world, run_dir, store, step,
                         trainable, plateau, sharded)
    elif backup is not None:
        start = ResumePoint(chief_decides(collectives, lambda: _from_backup(backup, model)))
        if start.epoch:
            logger.info(f"BackupAndRestore: continuing after epoch {start.epoch} from "
                        f"{backup.backup_dir}")
        if start.epoch and step.powersgd is not None:
            logger.warning("note: BackupAndRestore keeps the weights and optimizer, not "
                           "PowerSGD's error buffers and Q matrices, which start afresh; "
                           "hvdtrain's own checkpoints (--resume auto) resume them exactly")
    if world.is_chief:   # only now: a rejected run must not overwrite a run's config
        with run_files(run_dir, "config.yaml"):
            atomic_write_text(run_dir / "config.yaml", config.to_yaml())
    if config.train.elastic:   # the elastic state broadcasts on every (re)start instead
        return ResumePoint(start.epoch), []
    changed = agree_on_adapted_state(model, collectives)
    if changed:
        logger.warning(f"note: rank {world.rank}'s adapted state of {', '.join(changed)} "
                       "differed from rank 0's; every rank now uses rank 0's")
    before_broadcast = collectives.allgather_object(weight_fingerprint(model.weights))
    # One starting point for every rank: rank 0's weights and optimizer state (not the dropout
    # seeds: those stay rank-local so ranks drop different units).
    collectives.broadcast_variables(model.weights + [
        v for optimizer in optimizers.values() if optimizer.built for v in optimizer.variables])
    return start, before_broadcast


def _from_backup(backup: keras.callbacks.BackupAndRestore, model: keras.Model) -> int:
    """Rank 0: what a user's ``BackupAndRestore`` restores at train begin (weights, optimizer,
    the epoch to start at), done once before the broadcast instead."""
    backup.set_model(model)
    backup.on_train_begin()
    epoch = initial_epoch_of(model)
    set_initial_epoch(model, None)
    return epoch
