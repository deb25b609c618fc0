"""One training run, start to end, on every rank: the ``Run`` object the CLI and the Python API
(``hvdtrain.fit``) share.

config -> world (Horovod or a world of one; devices) -> run directory -> data (sharded) -> model,
its objective and the optimizer -> a probe batch (metrics built, output kind checked) -> restore
(resume) -> broadcast from rank 0 -> train (fit or custom loop, same step and callbacks) -> final
model, exact held-out metrics, and a check that every rank ended with the same weights.

Global state a run changes (Keras' precision policy, the umask) is restored when it ends, so a
second run in the same process (a notebook, a test) starts clean.
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
from hvdtrain.checkpoint import CheckpointStore, atomic_write_text, lock_run_dir
from hvdtrain.config import Config, DataConfig
from hvdtrain.data.files import LABEL_RANGE_MESSAGE, FileSplit, corrupt_record_message
from hvdtrain.data.pipeline import ShardSpec
from hvdtrain.data.sources import ArraySplit, DataBundle, Split, load_source
from hvdtrain.errors import UserError
from hvdtrain.models import build_model, check_input_shape
from hvdtrain.plugins import load_callable
from hvdtrain.plots import plot_curves
from hvdtrain.training.elastic import ElasticRun, elastic_loop
from hvdtrain.training.callbacks import (FirstStepClock, MetricsFiles, PlateauDecay, Progress,
                                         ResumePoint, RunHooks, standard_callbacks)
from hvdtrain.training.loops import LOOPS
from hvdtrain.training.schedule import WarmupScaledRate, make_optimizer, make_schedule
from hvdtrain.training.objective import Objective, probe
from hvdtrain.training.step import Evaluation, StepMath, StepOptions
from hvdtrain.training.watchdog import stopped_after, watchdog_for
from hvdtrain.world import Collectives, World, init_collectives, place_devices
from hvdtrain.writes import run_files


def say(world: World, message: str) -> None:
    """Print on rank 0 only."""
    if world.is_chief:
        print(message, flush=True)


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
        raise UserError(error)
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


def _restore(model_label: str, store: CheckpointStore, model: keras.Model,
             optimizer: keras.optimizers.Optimizer) -> dict[str, Any]:
    """Rank 0: load the newest intact checkpoint into model and optimizer; return its state."""
    latest = store.newest_intact(lambda line: print(f"hvdtrain: {line}", flush=True))
    state = store.read_state(latest)
    if state.get("model") != model_label:
        raise UserError(f"{latest} was trained with model '{state.get('model')}', not "
                        f"'{model_label}'; resume with the same --model")
    store.restore(latest, model, optimizer)
    return {"epoch": int(state["epoch"]), "plateau": state.get("plateau"),
            "metrics": state.get("metrics", {}), "name": latest.name,
            "resume": ResumePoint(int(state["epoch"]), int(state.get("step", 0)),
                                  tuple(state.get("epoch_state", ())))}


ModelFactory = Callable[[Any, "int | None"], keras.Model]
DataFactory = Callable[[DataConfig, int], DataBundle]


@dataclass
class Trainable:
    """The model, its objective, its optimizer and the schedule that drives the rate."""

    model: keras.Model
    objective: Objective
    optimizer: keras.optimizers.Optimizer
    schedule: WarmupScaledRate


def make_optimizer_for(config: Config, model: keras.Model, world: World,
                       updates_per_epoch: int) -> tuple[keras.optimizers.Optimizer,
                                                        WarmupScaledRate]:
    """The configured optimizer at the scaled, warmed-up rate (loss-scaled for float16), built."""
    schedule = make_schedule(config.optim, world.size, updates_per_epoch, config.train.epochs)
    optimizer = make_optimizer(config.optim, schedule)
    if config.train.precision == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(model.trainable_variables)
    return optimizer, schedule


def check_elastic(config: Config, collectives: Collectives) -> None:
    """Elastic training needs Horovod's elastic launcher, a fixed run directory and in-memory
    data (the offset into the epoch's permutation is what makes a resized epoch exact)."""
    if not hasattr(collectives, "elastic_run") or os.environ.get("HOROVOD_ELASTIC") != "1":
        raise UserError("--elastic needs Horovod's elastic launcher: horovodrun --min-np N "
                        "--max-np M --host-discovery-script SCRIPT ... python -m hvdtrain "
                        "--elastic")
    if not config.train.run_dir:
        raise UserError("--elastic needs --run-dir: ranks that join later must find the run")
    if config.data.dataset in ("tfrecord", "csv") or config.optim.accumulation_steps != 1:
        raise UserError("--elastic supports in-memory datasets without --accumulation-steps")
    if config.optim.lr_schedule == "plateau":
        raise UserError("--elastic does not support --lr-schedule plateau (its state would not "
                        "reach joining ranks); use constant, cosine or step")


@contextlib.contextmanager
def data_errors_named(data: DataBundle):
    """Turn TensorFlow's errors about bad records mid-run into one line naming the problem."""
    try:
        yield
    except tf.errors.DataLossError as error:
        raise UserError(corrupt_record_message((data.train, data.val), str(error))) from error
    except tf.errors.InvalidArgumentError as error:
        if LABEL_RANGE_MESSAGE not in str(error):
            raise
        classes = data.num_classes or 0
        raise UserError(f"a label lies outside [0, {classes - 1}] for {classes} classes; fix "
                        "the labels or set --num-classes") from error


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
    check_elastic(config, collectives)
    # No collective before the elastic loop (a joining rank starts here): rank 0 alone
    # checks the run directory.
    if world.is_chief:
        return _usable_run_dir(config)
    return Path(config.train.run_dir), config.train.resume != "never"


def _plan(config: Config, data: DataBundle,
          collectives: Collectives) -> tuple[ShardSpec, int, ShardSpec | None]:
    """(training shard spec, steps per epoch, validation shard spec), or a one-line error.

    Built-in sources and arrays give every rank the same steps by construction; for a user's
    pipeline every rank reports its own count and all take the largest. Only then is there a
    collective here: an elastic rank joining a running job starts here and must meet none."""
    world = collectives.world
    batch, optim = config.train.batch_size, config.optim
    if not data.train.normalised and optim.accumulation_steps > 1:
        raise UserError("--accumulation-steps needs in-memory or file data (the weights of an "
                        "update must be known before its first micro-step); raise the pipeline's "
                        "batch size instead")
    examples = data.train.num_examples
    spec = ShardSpec(examples or 0, world, batch, config.data.remainder, True,
                     config.train.seed, optim.accumulation_steps)
    steps = _agreed_steps(data.train, spec, collectives)
    spec = dataclasses.replace(spec, agreed_steps=steps)
    if steps == 0:
        raise UserError(f"{examples} training examples cannot fill one update of "
                        f"{spec.update_batch} per rank group ({world.size} ranks x {batch} x "
                        f"{optim.accumulation_steps} accumulation steps); lower --batch-size "
                        "or use --remainder pad")
    if examples is not None and examples < world.size:
        raise UserError(f"{world.size} ranks but only {examples} training "
                        "examples: every rank needs at least one; launch fewer ranks")
    if isinstance(data.train, FileSplit):
        say(world, f"sharding {len(data.train.files)} file(s) across {world.size} rank(s) by "
                   f"{data.train.mode(world.size)}")
    if data.val is None:
        return spec, steps, None
    val_spec = ShardSpec(data.val.num_examples or 0, world, batch, "pad", False)
    val_steps = _agreed_steps(data.val, val_spec, collectives)
    return spec, steps, dataclasses.replace(val_spec, agreed_steps=val_steps)


def _agreed_steps(split: Split, spec: ShardSpec, collectives: Collectives) -> int:
    """The split's steps per epoch, the most any rank counts where ranks count their own."""
    steps = split.steps_per_epoch(spec)
    return steps if split.normalised else max(collectives.allgather_object(steps))


def _starting_point(config: Config, model_label: str, collectives: Collectives, run_dir: Path,
                    resuming: bool, store: CheckpointStore, trainable: Trainable,
                    plateau: PlateauDecay | None) -> tuple[ResumePoint, list[str]]:
    """Restore when resuming, then give every rank rank 0's weights and optimizer state.

    Returns where to start and each rank's weight fingerprint before the broadcast.
    """
    world, model, optimizer = collectives.world, trainable.model, trainable.optimizer
    initial_epoch = 0
    start = ResumePoint()
    if resuming and config.train.elastic:
        # Rank 0 restores; the elastic state carries weights and epoch to the others.
        if world.is_chief:
            restored = _restore(model_label, store, model, optimizer)
            initial_epoch = restored["epoch"]
            with run_files(run_dir, "the metrics files"):
                MetricsFiles(run_dir).resume_at(initial_epoch, restored["metrics"])
    elif resuming:
        restored = chief_decides(collectives,
                                 lambda: _restore(model_label, store, model, optimizer))
        initial_epoch, start = restored["epoch"], restored["resume"]
        if plateau is not None and restored["plateau"]:
            plateau.load(restored["plateau"])
        if world.is_chief:
            with run_files(run_dir, "the metrics files"):
                MetricsFiles(run_dir).resume_at(initial_epoch, restored["metrics"])
        where = f", step {start.step}" if start.step else ""
        say(world, f"resuming after epoch {initial_epoch}{where} from "
                   f"{store.directory / restored['name']}")
    if world.is_chief:   # only now: a rejected run must not overwrite a run's config
        with run_files(run_dir, "config.yaml"):
            atomic_write_text(run_dir / "config.yaml", config.to_yaml())
    if config.train.elastic:   # the elastic state broadcasts on every (re)start instead
        return ResumePoint(initial_epoch), []
    before_broadcast = collectives.allgather_object(weight_fingerprint(model))
    # One starting point for every rank: rank 0's weights and optimizer state (not the dropout
    # seeds: those stay rank-local so ranks drop different units).
    collectives.broadcast_variables(model.weights + optimizer.variables)
    return start, before_broadcast


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


@dataclass(frozen=True)
class RunResult:
    """What ``Run.execute`` (and ``hvdtrain.fit``) returns on every rank."""

    run_dir: Path
    metrics: dict[str, float]
    fingerprints: list[str]
    model: keras.Model


@contextlib.contextmanager
def run_environment(precision: str):
    """Set the process-wide state a run needs (Keras' precision policy; a private umask, so run
    directories and checkpoints stay the user's on a shared cluster) and restore it after."""
    policy = keras.mixed_precision.global_policy()
    umask = os.umask(0o077)
    keras.mixed_precision.set_global_policy(precision)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(policy)
        os.umask(umask)


class Run:
    """One training run on this rank. The CLI builds it from a config; ``hvdtrain.fit`` also
    hands it the user's model factory, data and callbacks."""

    def __init__(self, config: Config, model_factory: ModelFactory | None = None,
                 data_factory: DataFactory | None = None,
                 callbacks: Sequence[keras.callbacks.Callback] = (),
                 model_label: str | None = None) -> None:
        self.config = config
        self.model_factory = model_factory or (
            lambda shape, classes: build_model(config.model, shape, classes))
        self.data_factory = data_factory or load_source
        self.extra_callbacks = list(callbacks)
        self.model_label = model_label or config.model.model

    def execute(self) -> RunResult:
        """Train on this rank; return the final exact metrics (every rank gets them)."""
        with run_environment(self.config.train.precision):
            return self._train()

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

    def _trainable(self, data: DataBundle, world: World, updates_per_epoch: int) -> Trainable:
        model = self.model_factory(data.input_shape, data.num_classes)
        if not isinstance(model, keras.Model):
            raise UserError(f"'{self.model_label}' gave {type(model).__name__}, not a "
                            "keras.Model")
        check_input_shape(model, self.model_label, data.input_shape)
        objective = Objective.for_model(model)
        optimizer, schedule = make_optimizer_for(self.config, model, world, updates_per_epoch)
        compiled = objective.compiled.optimizer
        if compiled is not None and world.is_chief:
            name = compiled if isinstance(compiled, str) else type(compiled).__name__
            print(f"note: the model was compiled with optimizer {name}; hvdtrain trains with "
                  f"--optimizer {self.config.optim.optimizer} at the scaled, warmed-up rate",
                  flush=True)
        return Trainable(model, objective, optimizer, schedule)

    def _float32_copy(self, model: keras.Model, data: DataBundle) -> keras.Model:
        """The trained model rebuilt under the float32 policy, for saving and inference."""
        if self.config.train.precision == "float32":
            return model
        keras.mixed_precision.set_global_policy("float32")
        copy = self.model_factory(data.input_shape, data.num_classes)
        copy.set_weights(model.get_weights())
        return copy

    def _train(self) -> RunResult:
        config = self.config
        launched = time.perf_counter()
        collectives = init_collectives()
        world = collectives.world
        device = place_devices(world, config.train.threads)
        if config.train.deterministic:
            tf.config.experimental.enable_op_determinism()
        # Ranks start from different seeds on purpose: the broadcast below must make them agree.
        keras.utils.set_random_seed(config.train.seed + world.rank)
        run_dir, resuming = _open_run_dir(config, collectives)
        if world.is_chief:
            output.log_to(run_dir)
        say(world, f"hvdtrain: {world.size} rank(s) on {world.cross_size} node(s); rank 0 on "
                   f"{world.host}, {device}; run directory {run_dir}")
        say(world, "resolved config:\n" + config.to_yaml().rstrip())

        data = self.data_factory(config.data, config.train.seed)
        spec, steps, val_spec = _plan(config, data, collectives)
        optim = config.optim
        trainable = self._trainable(data, world, steps // optim.accumulation_steps)
        model = trainable.model
        if config.train.elastic and not isinstance(data.train, ArraySplit):
            raise UserError("--elastic supports in-memory datasets (arrays); a pipeline cannot "
                            "be re-sharded at an offset into its epoch")
        evaluation = Evaluation(model, collectives, trainable.objective)
        step = StepMath(model, trainable.optimizer, collectives, trainable.objective,
                        StepOptions(optim.accumulation_steps, optim.reduction == "adasum",
                                    optim.compression == "fp16", data.train.normalised))
        with data_errors_named(data):
            probe(model, trainable.objective, next(iter(data.train.dataset(spec, 0, 1))),
                  [step.train_metrics, evaluation.metrics], self.model_label)
        plateau = (PlateauDecay(trainable.schedule, optim.lr_decay_factor, optim.plateau_patience)
                   if optim.lr_schedule == "plateau" else None)
        if plateau is not None and data.val is None:
            raise UserError("--lr-schedule plateau watches val_loss; give the pipeline a "
                            "validation factory or choose another schedule")
        user_callbacks = self._callbacks()
        store = CheckpointStore(run_dir, config.train.keep_checkpoints)
        start, before_broadcast = _starting_point(
            config, self.model_label, collectives, run_dir, resuming, store, trainable, plateau)
        initial_epoch = start.epoch

        epochs = config.train.epochs
        validate = None if data.val is None else (lambda: evaluation.run(
            data.val.dataset(val_spec)))
        state = {"model": self.model_label, "dataset": config.data.dataset,
                 "input_shape": data.input_shape, "num_classes": data.num_classes,
                 "world_size": world.size, "config": config.to_dict()}
        say(world, f"training {self.model_label} on {config.data.dataset}: "
                   f"{data.train.num_examples or 'pipeline'} examples, {steps} steps/epoch, "
                   f"global batch {spec.global_batch}, remainder policy "
                   f"'{config.data.remainder}'")
        started = time.perf_counter()
        first_step = FirstStepClock()
        if config.train.elastic:
            elastic_loop(ElasticRun(config, collectives, data, model, trainable.optimizer,
                                    trainable.schedule, step, evaluation, store, state, run_dir,
                                    initial_epoch))
            world = collectives.world   # the world the job ended with: validate on its shards
            val_spec = ShardSpec(data.val.num_examples, world, config.train.batch_size, "pad",
                                 False)
        elif initial_epoch < epochs:
            watchdog = watchdog_for(world, config.train.stall_timeout)
            progress = Progress(epochs, steps, spec.global_batch, config.train.progress,
                                interactive=sys.stdout.isatty() and world.size == 1)
            callbacks = standard_callbacks(RunHooks(
                world, collectives, step, validate, trainable.schedule, store, state, run_dir,
                progress, plateau, config.train.tensorboard, first_step, watchdog,
                user_callbacks, config.train.checkpoint_every_steps, start))
            with data_errors_named(data), stopped_after(watchdog):
                LOOPS[config.train.loop](step, data.train.dataset(spec, initial_epoch, epochs),
                                         epochs, initial_epoch, steps, callbacks, start.step)
        trained = time.perf_counter() - started

        metrics = {} if data.val is None else evaluation.run(data.val.dataset(val_spec))
        gathered = collectives.allgather_object((weight_fingerprint(model),
                                                 dataclasses.asdict(world)))
        fingerprints = [fingerprint for fingerprint, _ in gathered]
        if world.is_chief:
            summary = RunSummary(metrics, world.size, len(set(fingerprints)) == 1, fingerprints,
                                 before_broadcast, trained, started - launched,
                                 first_step.seconds, first_step.unix_time,
                                 None if data.val is None else data.val.num_examples,
                                 [facts for _, facts in gathered])
            _finish(run_dir, self._float32_copy(model, data), summary)
        return RunResult(run_dir, metrics, fingerprints, model)


def train(config: Config) -> RunResult:
    """Run the configured training on this rank (the CLI's entry)."""
    return Run(config).execute()


def _finish(run_dir: Path, model: keras.Model, summary: RunSummary) -> None:
    """Rank 0: save the final model, the summary and the curves, and report."""
    compiled_optimizer = getattr(model, "optimizer", None)
    if compiled_optimizer is not None and not compiled_optimizer.built:
        # The optimizer a user compiled with is saved with the model; built (untrained, since
        # hvdtrain trained with its own), it loads back without Keras' mismatch warning.
        compiled_optimizer.build(model.trainable_variables)
    partial = run_dir / ".model.partial.keras"
    with run_files(run_dir, "the final model", leftover=partial):
        model.save(partial)
        partial.replace(run_dir / "model.keras")
    fingerprints, metrics = summary.fingerprints, summary.metrics
    with run_files(run_dir, "summary.json"):
        atomic_write_text(run_dir / "summary.json",
                          json.dumps(dataclasses.asdict(summary), indent=2) + "\n")
    if (run_dir / "metrics.jsonl").exists():
        with run_files(run_dir, "curves.png"):
            plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    agreement = ("identical on all ranks" if summary.weights_identical else
                 "DIFFER across ranks: " + ", ".join(fingerprints))
    print(f"weights {agreement} (fingerprint {fingerprints[0]})", flush=True)
    if summary.first_step_seconds is not None:
        print(f"startup: the first training step ended {summary.first_step_seconds:.1f} s "
              f"after rank 0's process started ({summary.setup_seconds:.1f} s of it in "
              "setup: Horovod, data, model, restore)", flush=True)
    if metrics:   # the compiled metrics first, then the losses
        names = sorted(metrics, key=lambda name: name.endswith("loss"))
        shown = ", ".join(f"{name[4:]}: {metrics[name]:.4f}" for name in names)
        print(f"held-out {shown} on {summary.validation_examples or 'the validation'} "
              f"examples; model saved to {run_dir / 'model.keras'}", flush=True)
    else:
        print(f"no validation data; model saved to {run_dir / 'model.keras'}", flush=True)
