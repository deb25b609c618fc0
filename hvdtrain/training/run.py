"""One training run, start to end, on every rank: the ``Run`` object the CLI and the Python API
(``hvdtrain.fit``) share.

config -> world (Horovod or a world of one; devices; seeds) -> run directory -> data (sharded)
-> the model and the step that trains it (hvdtrain's exact step, or the model's own), its
optimizers and rates -> a probe batch (metrics built, output kind checked) -> restore (resume)
-> broadcast from rank 0 -> train (the model's own ``fit``, or a custom loop; same step and
callbacks) -> final model, exact held-out metrics, and a check that every rank ended with the
same weights.

Global state a run changes (random generators, Keras' precision policy, the umask, op
determinism: ``process_state``) is restored when it ends, so a program goes on after it as
after a plain ``model.fit``, and a second run in the same process starts clean. A run that
fails on one rank shuts Horovod down there, so the other ranks' collectives end with an error
at once (one line each: another rank failed) instead of waiting, and a second run in the same
processes starts Horovod afresh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from hvdtrain import output
from hvdtrain.checkpoint import (CheckpointStore, assign_rank_state, atomic_write_text,
                                 build_optimizers, lock_run_dir)
from hvdtrain.checkpoint_state import CheckpointState
from hvdtrain.collectives import (Collectives, GradientReduction, World, ended_by_another_rank,
                                  init_collectives, place_devices)
from hvdtrain.config import Config, DataConfig, OptimConfig
from hvdtrain.data.contract import ArraySplit, DataBundle
from hvdtrain.data.equal_steps import count_changed_line
from hvdtrain.data.files import LABEL_RANGE_MESSAGE, corrupt_record_message
from hvdtrain.data.load import load_source
from hvdtrain.data.pipeline import ShardSpec
from hvdtrain.errors import (AgreedError, CheckpointWriteFailed, PeerFailed, StoppedBySignal,
                             TrainingDiverged, UserError, first_sentence)
from hvdtrain.keras_internals import (build_compiled_metrics, initial_epoch_of, set_initial_epoch,
                                      sublayers)
from hvdtrain.log import for_run, logger
from hvdtrain.models import build_model, check_input_shape
from hvdtrain.plots import plot_curves
from hvdtrain.plugins import load_callable
from hvdtrain.training.adapted_state import agree_on_adapted_state
from hvdtrain.training.autotune_run import Tuning, autotune
from hvdtrain.training.callbacks import (CheckpointPlan, FirstStepClock, PlateauDecay, Reporting,
                                         ResumePoint, RunHooks, StepPosition, resume_metrics_files,
                                         standard_callbacks)
from hvdtrain.training.data_plan import DataPlan, plan_data
from hvdtrain.training.elastic import ElasticRun, elastic_loop
from hvdtrain.training.liveness import Liveness, liveness_for
from hvdtrain.training.loops import LOOPS
from hvdtrain.training.objective import probe
from hvdtrain.training.own_step import OwnStep
from hvdtrain.training.process_state import run_environment, seed_alike, seed_per_rank
from hvdtrain.training.resume_check import check_resumable, optimizers_changed
from hvdtrain.training.run_columns import RunColumns, RunColumnsLog
from hvdtrain.training.step import Evaluation, StepMath, StepOptions, TrainingStep
from hvdtrain.training.trainable import Trainable, own_step_reason, prepare
from hvdtrain.writes import run_files


def default_run_dir(config: Config) -> Path:
    model = re.sub(r"[^A-Za-z0-9_.-]+", "_", config.model.model)
    return Path("runs") / f"{model}-{config.data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"


def chief_decides(collectives: Collectives, decide: Callable[[], Any]) -> Any:
    """Run ``decide`` on rank 0 and give every rank its result, or raise its error everywhere.

    Rank 0 alone reads the file system for these decisions; a user error found there must stop
    every rank with the same message rather than leave the others waiting in a collective.
    """
    outcome: tuple[Any, str] = (None, "")
    if collectives.world.is_chief:
        try:
            outcome = (decide(), "")
        except UserError as error:
            outcome = (None, str(error))
    value, error = collectives.broadcast_object(outcome)
    if error:
        raise AgreedError(error)
    return value


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


def weight_fingerprint(model: keras.Model) -> str:
    """A short digest of every weight's bytes: equal on all ranks iff the weights are equal."""
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(np.ascontiguousarray(weight).tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Restored:
    """What rank 0 restored, for every rank: the checkpoint's name, its state (no optimizer
    state or rate factors when the optimizers changed) and every rank's random-generator
    state, for each rank to take its own."""

    name: str
    state: CheckpointState
    rank_states: list[list[np.ndarray]]

    @property
    def resume(self) -> ResumePoint:
        return ResumePoint(self.state.epoch, self.state.step, self.state.epoch_state)


def _restore(run: CheckpointState, accept_changes: bool, store: CheckpointStore,
             model: keras.Model,
             optimizers: dict[str, keras.optimizers.Optimizer]) -> Restored:
    """Rank 0: check that the newest intact checkpoint was trained with what this ``run``
    trains (``resume_check``), load it into the model and its optimizers."""
    latest = store.newest_intact(logger.warning)
    state = latest.read_state()
    changed = check_resumable(state, run, latest.path, accept_changes)
    if changed:
        logger.info(f"continuing {latest.path} with changed data or settings "
                    f"({'; '.join(changed)}), as --accept-changes asks")
    if optimizers_changed(state, run):   # only the weights carry over
        optimizers, state = {}, dataclasses.replace(state, optimizers={}, rates={})
    latest.restore(model, optimizers)
    return Restored(latest.name, state, latest.rank_states())


def raised_here(error: BaseException) -> bool:
    """Whether an error began on this rank (the user's code, a one-rank mistake) while its
    peers may wait for it in a collective, rather than in a collective (a peer's process is
    gone: shutting Horovod down then waits on it, until Slurm kills the rank, measured) or by
    agreement of every rank (a stop, a divergence, a failed checkpoint write, a refusal all
    ranks reached together)."""
    if isinstance(error, (StoppedBySignal, TrainingDiverged, CheckpointWriteFailed,
                          AgreedError)):
        return False
    return ("Horovod" not in str(error) and not ended_by_another_rank(error)
            and not isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError)))


ModelFactory = Callable[[Any, "int | None"], keras.Model]
DataFactory = Callable[[DataConfig, int], DataBundle]


def _check_backend(config: Config, collectives: Collectives) -> None:
    """What the backend auto chose cannot do (a backend asked for by name is checked with the
    config)."""
    if collectives.backend != "tensorflow":
        return
    if config.train.elastic or config.optim.reduction == "adasum":
        what = "--elastic" if config.train.elastic else "--reduction adasum"
        raise UserError(f"{what} needs the Horovod backend, and {collectives.chosen}; install "
                        "Horovod (launch/setup.sh) or drop the option")


def check_elastic(collectives: Collectives) -> None:
    """Elastic training needs Horovod's elastic launcher (what --elastic needs of the config
    alone, ``config.validate`` checks)."""
    if not hasattr(collectives, "elastic_run") or os.environ.get("HOROVOD_ELASTIC") != "1":
        raise UserError("--elastic needs Horovod's elastic launcher: horovodrun --min-np N "
                        "--max-np M --host-discovery-script SCRIPT ... python -m hvdtrain "
                        "--elastic")


@contextlib.contextmanager
def data_errors_named(data: DataBundle, rank: int = 0):
    """Turn TensorFlow's errors about the data mid-run (a corrupt record, a label out of range,
    a pass of another length than counted) into one line naming the problem. Read from the
    message: an error raised inside a generator reaches here as another kind."""
    try:
        yield
    except tf.errors.OpError as error:
        message = str(error)
        changed = count_changed_line(message, rank)
        if changed is not None:
            raise UserError(changed) from error
        if isinstance(error, tf.errors.DataLossError) or "DataLossError" in message:
            raise UserError(corrupt_record_message((data.train, data.val), message)) from error
        if LABEL_RANGE_MESSAGE in message:
            classes = data.num_classes or 0
            raise UserError(f"a label lies outside [0, {classes - 1}] for {classes} classes; "
                            "fix the labels or set --num-classes") from error
        raise


def _open_run_dir(config: Config, collectives: Collectives) -> tuple[Path, bool]:
    """Checks that need the world size, then the run directory and whether to resume there
    (decided on rank 0)."""
    world = collectives.world
    if config.optim.reduction == "adasum" and world.size & (world.size - 1):
        raise UserError(f"--reduction adasum needs a power-of-two number of ranks, not "
                        f"{world.size}; launch 2, 4, 8... ranks or use --reduction mean")
    if not config.train.elastic:
        run_dir, resuming = chief_decides(collectives, lambda: _usable_run_dir(config))
        return Path(run_dir), resuming
    check_elastic(collectives)
    # No collective before the elastic loop (a joining rank starts here): rank 0 alone
    # checks the run directory.
    if world.is_chief:
        return _usable_run_dir(config)
    return Path(config.train.run_dir), config.train.resume != "never"


def _resumed(restored: Restored, world: World, run_dir: Path, store: CheckpointStore,
             step: TrainingStep, trainable: Trainable,
             plateau: PlateauDecay | None) -> ResumePoint:
    """Every rank, after rank 0 restored a checkpoint: the same optimizers built, this rank's
    own random-generator state back, the rate factors and plateau state loaded; rank 0 makes
    the metrics files end at the checkpoint's epoch."""
    saved = restored.state
    build_optimizers(trainable.model, step.optimizers, saved.optimizers)
    if restored.rank_states[world.rank:world.rank + 1]:
        assign_rank_state(trainable.model, restored.rank_states[world.rank])
    if plateau is not None and saved.plateau:
        plateau.load(saved.plateau)
    trainable.rates.load(saved.rates)
    start = restored.resume
    if world.is_chief:
        with run_files(run_dir, "the metrics files"):
            resume_metrics_files(run_dir, start.epoch, saved.metrics)
    where = f", step {start.step}" if start.step else ""
    logger.info(f"resuming after epoch {start.epoch}{where} from "
                f"{store.directory / restored.name}")
    return start


def _starting_point(config: Config, run: CheckpointState, collectives: Collectives,
                    run_dir: Path, resuming: bool, store: CheckpointStore, step: TrainingStep,
                    trainable: Trainable, plateau: PlateauDecay | None,
                    backup: keras.callbacks.BackupAndRestore | None
                    ) -> tuple[ResumePoint, list[str]]:
    """Restore when resuming (or from a user's ``BackupAndRestore``), then give every rank rank
    0's weights and optimizer state; each rank keeps (or takes back) its own random-generator
    state. ``run``: what this run trains (saved in its checkpoints, compared with theirs).
    Returns where to start and each rank's weight fingerprint before the broadcast."""
    world, model, optimizers = collectives.world, trainable.model, step.optimizers

    def restore() -> Restored:
        return _restore(run, config.train.accept_changes, store, model, optimizers)

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
                         trainable, plateau)
    elif backup is not None:
        start = ResumePoint(chief_decides(collectives, lambda: _from_backup(backup, model)))
        if start.epoch:
            logger.info(f"BackupAndRestore: continuing after epoch {start.epoch} from "
                        f"{backup.backup_dir}")
    if world.is_chief:   # only now: a rejected run must not overwrite a run's config
        with run_files(run_dir, "config.yaml"):
            atomic_write_text(run_dir / "config.yaml", config.to_yaml())
    if config.train.elastic:   # the elastic state broadcasts on every (re)start instead
        return ResumePoint(start.epoch), []
    changed = agree_on_adapted_state(model, collectives)
    if changed:
        logger.warning(f"note: rank {world.rank}'s adapted state of {', '.join(changed)} "
                       "differed from rank 0's; every rank now uses rank 0's")
    before_broadcast = collectives.allgather_object(weight_fingerprint(model))
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


@dataclass(frozen=True)
class RunSummary:
    """What a finished run reports; rank 0 writes it as ``summary.json``."""

    metrics: dict[str, float]
    world_size: int
    weights_identical: bool
    fingerprints: list[str]
    fingerprints_before_broadcast: list[str]
    train_seconds: float
    setup_seconds: float
    first_step_seconds: float | None
    first_step_unix_time: float | None
    validation_examples: int | None
    ranks: list[dict[str, Any]]   # every rank's World: host, local and cross rank and size
    # The epoch (from 1) after which ``metrics`` were measured (None: after training).
    validation_epoch: int | None = None


@dataclass(frozen=True)
class RunResult:
    """What ``Run.execute`` (and ``hvdtrain.fit``) returns on every rank: the run directory,
    the exact final metrics, every rank's weight fingerprint, the trained model, Keras'
    ``History`` of the epochs' logs (``history.history["val_loss"]``...: the keys one plain
    ``model.fit`` has) and, for the same epochs, the run's own columns (``run_columns``: the
    learning rates and throughput that ``metrics.jsonl`` adds to the logs)."""

    run_dir: Path
    metrics: dict[str, float]
    fingerprints: list[str]
    model: keras.Model
    history: keras.callbacks.History | None = None
    run_columns: list[RunColumns] = dataclasses.field(default_factory=list)


@dataclass
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


class Run:
    """One training run on this rank, in four phases: ``_setup`` (world, run directory, data,
    model and step), ``_restore`` (a checkpoint or a user's backup, then rank 0's weights to
    every rank), ``_train`` (the loop) and ``_finish`` (exact held-out metrics, the final model
    and summary); with ``--autotune``, a timed search of how gradients travel (``_autotune``)
    replaces the last three. The CLI builds it from a config; ``hvdtrain.fit`` also hands it the
    user's model factory, data and callbacks. The run owns this rank's ``Liveness`` (signals,
    stalls) and puts back whatever it changed in the process when it ends."""

    def __init__(self, config: Config, model_factory: ModelFactory | None = None,
                 data_factory: DataFactory | None = None,
                 callbacks: Sequence[keras.callbacks.Callback] = (),
                 model_label: str | None = None,
                 validation_freq: int | list[int] | None = None,
                 process_ends_with_run: bool = False,
                 liveness: Liveness | None = None) -> None:
        """``process_ends_with_run`` (the CLI): an error here ends the process, whose exit
        shuts Horovod down after the error's line and code are out (so the launcher reports
        them, not a peer's); otherwise (``hvdtrain.fit``) the run shuts it down itself, so no
        peer waits and the next run starts afresh. ``liveness``: one the caller installed
        early (the CLI, before TensorFlow loads); the run uninstalls it when it ends."""
        self.process_ends_with_run = process_ends_with_run
        self.config = config
        self.model_factory = model_factory or (
            lambda shape, classes: build_model(config.model, shape, classes))
        self.data_factory = data_factory or load_source
        self.extra_callbacks = list(callbacks)
        self.model_label = model_label or config.model.model
        self.validation_freq = validation_freq or config.train.validation_freq
        self.liveness = liveness or liveness_for(config)

    def execute(self) -> RunResult:
        """Train on this rank; return the final exact metrics (every rank gets them)."""
        launched = time.perf_counter()
        train = self.config.train
        with run_environment(train.precision, train.deterministic), self.liveness.installed():
            placed: list[str] = []
            collectives = init_collectives(self.config.train.backend, lambda world: placed.append(
                place_devices(world, self.config.train.threads)))
            with for_run(train.log_level, lambda: collectives.world.rank):
                return self._execute(collectives, placed[0], launched)

    def _execute(self, collectives: Collectives, device: str, launched: float) -> RunResult:
        """``execute`` once the world is known: the phases; on an error, leave the job's
        collectives where no peer waits for this rank."""
        try:
            self.liveness.attach(collectives.world)
            prepared = self._setup(collectives, device, launched)
            if self.config.train.autotune:
                return self._autotune(prepared)
            start = self._restore(prepared)
            started = time.perf_counter()
            history = self._train(prepared, start)
            return self._finish(prepared, start, history, started)
        except BaseException as error:
            peer_failed = ended_by_another_rank(error)
            leave = peer_failed or (raised_here(error) and not self.process_ends_with_run)
            if leave and collectives.world.size > 1 and not self.config.train.elastic:
                # No peer waits for this rank in a collective; the next run starts
                # Horovod afresh.
                collectives.shutdown()
            if peer_failed:
                raise PeerFailed("another rank ended with an error (shown by that rank); "
                                 "this rank stopped with it") from error
            raise

    # --- setup -------------------------------------------------------------------------------

    def _setup(self, collectives: Collectives, device: str, launched: float) -> Prepared:
        """Seeds, the run directory, the data and its shard plan, the model with the step that
        trains it (probed on one real batch), and the callbacks (``device``: where this rank
        was placed)."""
        config, world = self.config, collectives.world
        _check_backend(config, collectives)
        seed_alike(config.train.seed)
        run_dir, resuming = _open_run_dir(config, collectives)
        if world.is_chief:
            output.log_to(run_dir)
        logger.info(f"{world.size} rank(s) on {world.cross_size} node(s); rank {world.rank} on "
                    f"{world.host}, {device}; run directory {run_dir}")
        logger.info(f"backend: {collectives.backend} ({collectives.chosen})")
        logger.info("resolved config:\n" + config.to_yaml().rstrip())

        data = self.data_factory(config.data, config.train.seed)
        seed_per_rank(config.train.seed, world.rank)
        model = self._model(data)
        own_step = own_step_reason(model, data)
        plan = plan_data(config, data, collectives, own_step)
        for note in plan.notes:
            logger.info(note)
        optim = config.optim
        trainable = prepare(config, model, data, world,
                            plan.updates_per_epoch(optim.accumulation_steps), own_step)
        if config.train.elastic and not isinstance(data.train, ArraySplit):
            raise UserError("--elastic supports in-memory datasets (arrays); a pipeline cannot "
                            "be re-sharded at an offset into its epoch")
        logger.info("step: " + ("hvdtrain's exact step (the model uses Keras' train_step)"
                                if own_step is None else
                                f"the model's own train_step ({own_step})"))
        logger.info(trainable.description)
        step = self._step(trainable, data, collectives)
        if world.size > 1 and optim.reduction != "adasum":
            logger.info(GradientReduction(bucket_bytes=optim.bucket_bytes).describe(
                trainable.model.trainable_variables, optim.accumulation_steps > 1))
        evaluate, metric_states = self._evaluation(step, trainable, data, collectives)
        with data_errors_named(data):
            first = next(iter(data.train.dataset(plan.spec, 0, 1)))
            self._probe(trainable, first, metric_states)
        plan = dataclasses.replace(plan, first_rows=int(tf.shape(tf.nest.flatten(first[0])[0])[0]))
        plateau = (PlateauDecay(trainable.schedule, optim.lr_decay_factor, optim.plateau_patience)
                   if optim.lr_schedule == "plateau" else None)
        if plateau is not None and (data.val is None or self.validation_freq != 1):
            raise UserError("--lr-schedule plateau watches val_loss after every epoch; give "
                            "validation data (every epoch) or choose another schedule")
        state = CheckpointState(
            model=self.model_label, dataset=config.data.dataset, input_shape=data.input_shape,
            num_classes=data.num_classes, examples=data.train.num_examples,
            optimizer_classes={name: type(optimizer).__name__
                               for name, optimizer in step.optimizers.items()},
            world_size=world.size, config=config.to_dict())
        return Prepared(collectives, run_dir, resuming, data, trainable, step, plan,
                        evaluate, plateau, self._callbacks(),
                        CheckpointStore(run_dir, config.train.keep_checkpoints), state, launched)

    def _callbacks(self) -> list[keras.callbacks.Callback]:
        """The user's callbacks: from ``--callbacks module:fn`` and from the Python API."""
        found = list(self.extra_callbacks)
        for path in self.config.train.callbacks:
            made = load_callable(path, "callbacks")()
            made = list(made) if isinstance(made, (list, tuple)) else [made]
            wrong = [type(c).__name__ for c in made
                     if not isinstance(c, keras.callbacks.Callback)]
            if wrong:
                raise UserError(f"'{path}' returned {', '.join(wrong)}, not Keras callbacks; "
                                "return a list of keras.callbacks.Callback")
            found += made
        return found

    def _model(self, data: DataBundle) -> keras.Model:
        model = self.model_factory(data.input_shape, data.num_classes)
        if not isinstance(model, keras.Model):
            raise UserError(f"'{self.model_label}' gave {type(model).__name__}, not a "
                            "keras.Model")
        check_input_shape(model, self.model_label, data.input_shape)
        return model

    def _step(self, trainable: Trainable, data: DataBundle, collectives: Collectives,
              optim: OptimConfig | None = None) -> TrainingStep:
        """The step that trains ``trainable`` as ``optim`` (the config's) says."""
        optim = optim or self.config.optim
        if trainable.own_step is not None:
            op = "adasum" if optim.reduction == "adasum" else "average"
            return OwnStep(trainable.model, collectives, data.keras_element,
                           GradientReduction(op, optim.compression == "fp16",
                                             bucket_bytes=optim.bucket_bytes))
        return StepMath(trainable.model, trainable.optimizer, collectives, trainable.objective,
                        StepOptions(optim.accumulation_steps, optim.reduction == "adasum",
                                    optim.compression == "fp16", data.train.normalised,
                                    optim.bucket_bytes))

    @staticmethod
    def _evaluation(step: TrainingStep, trainable: Trainable, data: DataBundle,
                    collectives: Collectives) -> tuple[Callable[[ShardSpec], dict[str, float]],
                                                       list]:
        """Exact validation over every rank's shard (``val_*`` names) for a shard spec, and the
        metric states the probe must build."""
        if isinstance(step, OwnStep):
            return (lambda spec: {"val_" + name: value for name, value in
                                  step.evaluate(data.val.dataset(spec)).items()}), []
        evaluation = Evaluation(trainable.model, collectives, trainable.objective)
        return (lambda spec: evaluation.run(data.val.dataset(spec))), [
            step.train_metrics, evaluation.metrics]

    def _probe(self, trainable: Trainable, batch: tuple, metric_states: list) -> None:
        """One real batch before training: hvdtrain's step builds its metrics and checks the
        outputs against the loss; a model's own step is built (as its first step would)."""
        model = trainable.model
        if trainable.own_step is None:
            probe(model, trainable.objective, batch, metric_states, self.model_label)
            # Keras' fit reads the model's own compiled metrics at every epoch end (hvdtrain's
            # exact values replace them): they must be built, and see no batch here.
            features, targets = batch[:2]
            build_compiled_metrics(model, targets, model(features, training=False))
            return
        if all(layer.built for layer in sublayers(model)) and model.weights:
            return
        try:
            model(batch[0], training=False)
        except Exception as error:  # noqa: BLE001 - whatever a user's call raises
            why = f"{type(error).__name__}: {first_sentence(str(error))}"
            raise UserError(f"model '{self.model_label}' is not built and calling it on a batch "
                            f"failed ({why}); build it (and its sub-models) before training"
                            ) from error

    # --- autotune (instead of restore, train and finish) ---------------------------------------

    def _autotune(self, run: Prepared) -> RunResult:
        """``--autotune``: time the run's step at other gradient settings on one real batch
        and report the fastest (``training.autotune_run``); no restore, no training, no model."""
        batch = next(iter(run.data.train.dataset(run.spec, 0, 1)))

        def step_for(bucket_mib: float) -> TrainingStep:
            optim = dataclasses.replace(self.config.optim, bucket_mib=bucket_mib)
            step = self._step(run.trainable, run.data, run.collectives, optim)
            self._probe(run.trainable, batch, [] if isinstance(step, OwnStep)
                        else [step.train_metrics])
            return step

        optim = self.config.optim
        with data_errors_named(run.data):
            autotune(Tuning(run.collectives, step_for, batch, optim.accumulation_steps,
                            optim.reduction == "adasum", optim.bucket_mib, run.run_dir),
                     logger.info)
        return RunResult(run.run_dir, {}, [], run.trainable.model, None)

    # --- restore -----------------------------------------------------------------------------

    def _restore(self, run: Prepared) -> StartingPoint:
        """Resume from the run directory's newest intact checkpoint, or from a user's
        ``BackupAndRestore``, then give every rank rank 0's weights and optimizer state."""
        backup = next((c for c in run.user_callbacks
                       if isinstance(c, keras.callbacks.BackupAndRestore)), None)
        resume, before_broadcast = _starting_point(
            self.config, run.state, run.collectives, run.run_dir, run.resuming, run.store,
            run.step, run.trainable, run.plateau, backup)
        return StartingPoint(resume, max(resume.epoch, self.config.train.initial_epoch),
                             before_broadcast)

    # --- train -------------------------------------------------------------------------------

    def _train(self, run: Prepared, start: StartingPoint) -> keras.callbacks.History | None:
        """The epochs from the starting point: Keras ``fit`` or the custom loop (or Horovod's
        elastic loop), with the run's callbacks in their fixed order."""
        config, world = self.config, run.collectives.world
        epochs, initial_epoch = config.train.epochs, start.initial_epoch
        logger.info(f"training {self.model_label} on {config.data.dataset}: "
                    f"{run.plan.describe(run.data.train)}")
        if config.train.elastic:
            trainable = run.trainable
            elastic_loop(ElasticRun(config, run.collectives, run.data, trainable.model,
                                    trainable.optimizer, trainable.schedule, trainable.rates,
                                    run.step, run.evaluate, run.store, run.state, run.run_dir,
                                    initial_epoch, run.user_callbacks, run.run_columns))
            return None
        if initial_epoch >= epochs:
            return None
        position = StepPosition()

        def validate_epoch() -> dict[str, float]:
            metrics = run.validate()
            run.validated = (position.epoch, weight_fingerprint(run.trainable.model), metrics)
            return metrics

        callbacks = standard_callbacks(RunHooks(
            collectives=run.collectives, step=run.step, rates=run.trainable.rates,
            checkpoints=CheckpointPlan(run.store, run.state, config.train.checkpoint_every_steps,
                                       start.resume),
            reporting=Reporting(run.run_dir, run.plan.global_batch(run.data.train)[0],
                                config.train.progress,
                                sys.stdout.isatty() and world.size == 1,
                                config.train.tensorboard, run.first_step),
            liveness=self.liveness, passes=run.plan.passes,
            evaluate=None if run.data.val is None else validate_epoch,
            validation_freq=self.validation_freq, plateau=run.plateau,
            user_callbacks=run.user_callbacks, run_columns=run.run_columns))
        distributed = (run.step.distributed() if isinstance(run.step, OwnStep)
                       else contextlib.nullcontext())
        with data_errors_named(run.data, world.rank), distributed:
            done = start.resume.step if start.resume.epoch == initial_epoch else 0
            try:
                return LOOPS[config.train.loop](
                    run.step, run.plan.stream(run.data.train, initial_epoch, done, epochs),
                    epochs, initial_epoch, run.plan.passes, [position, *callbacks], done)
            except tf.errors.OpError as error:
                if position.epoch is not None and not ended_by_another_rank(error):
                    error.add_note(f"hvdtrain: rank {world.rank} failed in epoch "
                                   f"{position.epoch + 1}, step {position.batch + 1}, on "
                                   f"{run.plan.describe_step(position.epoch, position.batch)}")
                raise

    # --- finish ------------------------------------------------------------------------------

    def _finish(self, run: Prepared, start: StartingPoint,
                history: keras.callbacks.History | None, started: float) -> RunResult:
        """Exact held-out metrics, a check that every rank ended with the same weights, and
        rank 0's final model, summary and curves."""
        trained = time.perf_counter() - started
        collectives = run.collectives
        world = collectives.world   # elastic: the world the job ended with
        model = run.trainable.model
        # The last validation during training, when the weights are still the ones it measured:
        # reading the validation data once more would show the user's metrics a pass one
        # process never makes. A callback that changed them (EarlyStopping restoring its best)
        # or no validation yet: measured now, on every rank if on any (it holds collectives).
        fingerprint = weight_fingerprint(model)
        epoch, measured, metrics = run.validated or (None, None, {})
        gathered = collectives.allgather_object((fingerprint, dataclasses.asdict(world),
                                                 measured != fingerprint))
        if any(stale for _, _, stale in gathered):
            epoch, metrics = None, run.validate()
        fingerprints = [each for each, _, _ in gathered]
        if world.is_chief:
            summary = RunSummary(metrics, world.size, len(set(fingerprints)) == 1, fingerprints,
                                 start.before_broadcast, trained, started - run.launched,
                                 run.first_step.seconds, run.first_step.unix_time,
                                 None if run.data.val is None else run.data.val.num_examples,
                                 [facts for _, facts, _ in gathered],
                                 None if epoch is None else epoch + 1)
            _write_outputs(run.run_dir, self._float32_copy(model, run.data), summary)
        return RunResult(run.run_dir, metrics, fingerprints, model, history,
                         list(run.run_columns.rows))

    def _float32_copy(self, model: keras.Model, data: DataBundle) -> keras.Model:
        """The trained model rebuilt under the float32 policy, for saving and inference."""
        if self.config.train.precision == "float32":
            return model
        keras.mixed_precision.set_global_policy("float32")
        copy = self.model_factory(data.input_shape, data.num_classes)
        copy.set_weights(model.get_weights())
        return copy


def train(config: Config, liveness: Liveness | None = None) -> RunResult:
    """Run the configured training on this rank (the CLI's entry)."""
    return Run(config, process_ends_with_run=True, liveness=liveness).execute()


def _save_model(run_dir: Path, model: keras.Model) -> Path:
    """The final model as ``model.keras``; a model Keras cannot serialise whole (a subclass
    without ``get_config``, such as a GAN) as its weights, ``model.weights.h5``, said in one
    line."""
    partial = run_dir / ".model.partial.keras"
    if not model.built and all(layer.built for layer in sublayers(model)):
        model.built = True     # a composite (a GAN) whose parts are built: it has trained
    with run_files(run_dir, "the final model", leftover=partial):
        try:
            model.save(partial)
        except (NotImplementedError, TypeError, ValueError) as error:
            partial.unlink(missing_ok=True)
            path = run_dir / "model.weights.h5"
            model.save_weights(path)
            why = first_sentence(str(error)) or "no config"
            logger.warning(f"note: Keras cannot save this model whole ({type(error).__name__}: "
                           f"{why}); saved its weights to {path} (give the class "
                           "get_config/from_config to save it whole)")
            return path
        partial.replace(run_dir / "model.keras")
    return run_dir / "model.keras"


def _write_outputs(run_dir: Path, model: keras.Model, summary: RunSummary) -> None:
    """Rank 0: save the final model, the summary and the curves, and report."""
    saved = _save_model(run_dir, model)
    fingerprints, metrics = summary.fingerprints, summary.metrics
    with run_files(run_dir, "summary.json"):
        atomic_write_text(run_dir / "summary.json",
                          json.dumps(dataclasses.asdict(summary), indent=2) + "\n")
    if (run_dir / "metrics.jsonl").exists():
        with run_files(run_dir, "curves.png"):
            plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    agreement = ("identical on all ranks" if summary.weights_identical else
                 "DIFFER across ranks: " + ", ".join(fingerprints))
    (logger.info if summary.weights_identical else logger.warning)(
        f"weights {agreement} (fingerprint {fingerprints[0]})")
    if summary.first_step_seconds is not None:
        logger.info(f"startup: the first training step ended {summary.first_step_seconds:.1f} s "
                    f"after rank 0's process started ({summary.setup_seconds:.1f} s of it in "
                    "setup: Horovod, data, model, restore)")
    if metrics:   # the compiled metrics first, then the losses
        names = sorted(metrics, key=lambda name: name.endswith("loss"))
        shown = ", ".join(f"{name[4:]}: {metrics[name]:.4f}" for name in names)
        when = ("" if summary.validation_epoch is None
                else f" (after epoch {summary.validation_epoch})")
        logger.info(f"held-out {shown} on {summary.validation_examples or 'the validation'} "
                    f"examples{when}; model saved to {saved}")
    else:
        logger.info(f"no validation data; model saved to {saved}")
