"""One training run, start to end, on every rank.

config -> world (Horovod or a world of one; devices) -> run directory -> data (sharded) -> model
and optimizer -> restore (resume) -> broadcast from rank 0 -> train (fit or custom loop, same
step and callbacks) -> final model, held-out accuracy, and a check that every rank ended with
the same weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.checkpoint import CheckpointStore, atomic_write_text, lock_run_dir
from hvdtrain.config import Config
from hvdtrain.data.files import LABEL_RANGE_MESSAGE, FileSplit
from hvdtrain.data.pipeline import ShardSpec
from hvdtrain.data.sources import DataBundle, load_source
from hvdtrain.errors import UserError
from hvdtrain.models import build_model, check_input_shape
from hvdtrain.plots import plot_curves
from hvdtrain.training.elastic import ElasticRun, elastic_loop
from hvdtrain.training.callbacks import (FirstStepClock, MetricsFiles, PlateauDecay, Progress,
                                         ResumePoint, RunHooks, standard_callbacks)
from hvdtrain.training.loops import LOOPS
from hvdtrain.training.schedule import WarmupScaledRate, make_optimizer, make_schedule
from hvdtrain.training.step import Evaluation, StepMath, StepOptions
from hvdtrain.world import (Collectives, World, init_collectives, place_devices,
                            tf_variables)


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    metrics: dict[str, float]
    fingerprints: list[str]


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


def _restore(config: Config, store: CheckpointStore, model: keras.Model,
             optimizer: keras.optimizers.Optimizer) -> dict[str, Any]:
    """Rank 0: load the newest intact checkpoint into model and optimizer; return its state."""
    latest = store.newest_intact(lambda line: print(f"hvdtrain: {line}", flush=True))
    state = store.read_state(latest)
    if state.get("model") != config.model.model:
        raise UserError(f"{latest} was trained with model '{state.get('model')}', not "
                        f"'{config.model.model}'; resume with the same --model")
    store.restore(latest, model, optimizer)
    return {"epoch": int(state["epoch"]), "plateau": state.get("plateau"),
            "metrics": state.get("metrics", {}), "name": latest.name,
            "resume": ResumePoint(int(state["epoch"]), int(state.get("step", 0)),
                                  tuple(state.get("epoch_state", ())))}


@dataclass
class Trainable:
    """The model, its optimizer and the schedule that drives the optimizer's rate."""

    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    schedule: WarmupScaledRate


def build_trainable(config: Config, data: DataBundle, world: World,
                    updates_per_epoch: int) -> Trainable:
    """Model under the configured precision policy, optimizer (loss-scaled for float16), built."""
    keras.mixed_precision.set_global_policy(config.train.precision)
    model = build_model(config.model, data.input_shape, data.num_classes)
    schedule = make_schedule(config.optim, world.size, updates_per_epoch, config.train.epochs)
    optimizer = make_optimizer(config.optim, schedule)
    if config.train.precision == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(model.trainable_variables)
    return Trainable(model, optimizer, schedule)


def float32_copy(config: Config, model: keras.Model, data: DataBundle) -> keras.Model:
    """The trained model rebuilt under the float32 policy, for saving and inference."""
    if config.train.precision == "float32":
        return model
    keras.mixed_precision.set_global_policy("float32")
    copy = build_model(config.model, data.input_shape, data.num_classes)
    copy.set_weights(model.get_weights())
    return copy


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
        raise UserError("a TFRecord file is corrupt or truncated "
                        f"({str(error).splitlines()[0][:160]}); regenerate it with "
                        "'hvdtrain convert'") from error
    except tf.errors.InvalidArgumentError as error:
        if LABEL_RANGE_MESSAGE not in str(error):
            raise
        raise UserError(f"a label lies outside [0, {data.num_classes - 1}] for "
                        f"{data.num_classes} classes; fix the labels or set --num-classes") \
            from error


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


def _plan(config: Config, data: DataBundle, world: World) -> tuple[ShardSpec, int, ShardSpec]:
    """(training shard spec, steps per epoch, validation shard spec), or a one-line error."""
    batch, optim = config.train.batch_size, config.optim
    spec = ShardSpec(data.train.num_examples, world, batch, config.data.remainder, True,
                     config.train.seed, optim.accumulation_steps)
    steps = data.train.steps_per_epoch(spec)
    if steps == 0:
        raise UserError(f"{data.train.num_examples} training examples cannot fill one update of "
                        f"{spec.update_batch} per rank group ({world.size} ranks x {batch} x "
                        f"{optim.accumulation_steps} accumulation steps); lower --batch-size "
                        "or use --remainder pad")
    if data.train.num_examples < world.size:
        raise UserError(f"{world.size} ranks but only {data.train.num_examples} training "
                        "examples: every rank needs at least one; launch fewer ranks")
    if isinstance(data.train, FileSplit):
        say(world, f"sharding {len(data.train.files)} file(s) across {world.size} rank(s) by "
                   f"{data.train.mode(world.size)}")
    return spec, steps, ShardSpec(data.val.num_examples, world, batch, "pad", False)


def _starting_point(config: Config, collectives: Collectives, run_dir: Path, resuming: bool,
                    store: CheckpointStore, trainable: Trainable,
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
            restored = _restore(config, store, model, optimizer)
            initial_epoch = restored["epoch"]
            MetricsFiles(run_dir).resume_at(initial_epoch, restored["metrics"])
    elif resuming:
        restored = chief_decides(collectives, lambda: _restore(config, store, model, optimizer))
        initial_epoch, start = restored["epoch"], restored["resume"]
        if plateau is not None and restored["plateau"]:
            plateau.load(restored["plateau"])
        if world.is_chief:
            MetricsFiles(run_dir).resume_at(initial_epoch, restored["metrics"])
        where = f", step {start.step}" if start.step else ""
        say(world, f"resuming after epoch {initial_epoch}{where} from "
                   f"{store.directory / restored['name']}")
    if world.is_chief:   # only now: a rejected run must not overwrite a run's config
        atomic_write_text(run_dir / "config.yaml", config.to_yaml())
    if config.train.elastic:   # the elastic state broadcasts on every (re)start instead
        return ResumePoint(initial_epoch), []
    before_broadcast = collectives.allgather_object(weight_fingerprint(model))
    # One starting point for every rank: rank 0's weights and optimizer state (not the dropout
    # seeds: those stay rank-local so ranks drop different units).
    collectives.broadcast_variables(tf_variables(model.weights + optimizer.variables))
    return start, before_broadcast


def train(config: Config) -> RunResult:
    """Run the configured training on this rank; return the final exact metrics."""
    launched = time.perf_counter()
    collectives = init_collectives()
    world = collectives.world
    device = place_devices(world, config.train.threads)
    if config.train.deterministic:
        tf.config.experimental.enable_op_determinism()
    # Ranks start from different seeds on purpose: the broadcast below must make them agree.
    keras.utils.set_random_seed(config.train.seed + world.rank)
    run_dir, resuming = _open_run_dir(config, collectives)
    say(world, f"hvdtrain: {world.size} rank(s); rank 0 on {device}; run directory {run_dir}")
    say(world, "resolved config:\n" + config.to_yaml().rstrip())

    data = load_source(config.data, config.train.seed)
    spec, steps, val_spec = _plan(config, data, world)
    optim = config.optim
    trainable = build_trainable(config, data, world, steps // optim.accumulation_steps)
    model = trainable.model
    check_input_shape(model, config.model.model, data.input_shape)
    plateau = (PlateauDecay(trainable.schedule, optim.lr_decay_factor, optim.plateau_patience)
               if optim.lr_schedule == "plateau" else None)
    store = CheckpointStore(run_dir, config.train.keep_checkpoints)
    start, before_broadcast = _starting_point(config, collectives, run_dir, resuming, store,
                                              trainable, plateau)
    initial_epoch = start.epoch

    epochs = config.train.epochs
    val_dataset = data.val.dataset(val_spec)
    evaluation = Evaluation(model, collectives)
    state = {"model": config.model.model, "dataset": config.data.dataset,
             "input_shape": list(data.input_shape), "num_classes": data.num_classes,
             "world_size": world.size, "config": config.to_dict()}
    say(world, f"training {config.model.model} on {config.data.dataset}: "
               f"{data.train.num_examples} examples, {steps} steps/epoch, global "
               f"batch {spec.global_batch}, remainder policy '{config.data.remainder}'")
    started = time.perf_counter()
    first_step = FirstStepClock()
    if config.train.elastic:
        elastic_loop(ElasticRun(config, collectives, data, model, trainable.optimizer,
                                trainable.schedule, evaluation, store, state, run_dir,
                                initial_epoch))
        world = collectives.world   # the world the job ended with: validate on its shards
        val_dataset = data.val.dataset(ShardSpec(data.val.num_examples, world,
                                                 config.train.batch_size, "pad", False))
    elif initial_epoch < epochs:
        step = StepMath(model, trainable.optimizer, collectives, StepOptions(
            optim.accumulation_steps, optim.reduction == "adasum", optim.compression == "fp16"))
        progress = Progress(epochs, steps, spec.global_batch, config.train.progress,
                            interactive=sys.stdout.isatty() and world.size == 1)
        callbacks = standard_callbacks(RunHooks(
            world, collectives, step, lambda: evaluation.run(val_dataset), trainable.schedule,
            store, state, run_dir, progress, plateau, config.train.tensorboard, first_step,
            config.train.checkpoint_every_steps, start))
        with data_errors_named(data):
            LOOPS[config.train.loop](step, data.train.dataset(spec, initial_epoch, epochs),
                                     epochs, initial_epoch, steps, callbacks, start.step)
    trained = time.perf_counter() - started

    metrics = evaluation.run(val_dataset)
    fingerprints = collectives.allgather_object(weight_fingerprint(model))
    if world.is_chief:
        summary = {"metrics": metrics, "world_size": world.size,
                   "weights_identical": len(set(fingerprints)) == 1,
                   "fingerprints": fingerprints,
                   "fingerprints_before_broadcast": before_broadcast,
                   "train_seconds": trained, "setup_seconds": started - launched,
                   "first_step_seconds": first_step.seconds,
                   "first_step_unix_time": first_step.unix_time,
                   "validation_examples": data.val.num_examples}
        _finish(run_dir, float32_copy(config, model, data), summary)
    return RunResult(run_dir, metrics, fingerprints)


def _finish(run_dir: Path, model: keras.Model, summary: dict[str, Any]) -> None:
    """Rank 0: save the final model, the summary and the curves, and report."""
    partial = run_dir / ".model.partial.keras"
    model.save(partial)
    partial.replace(run_dir / "model.keras")
    fingerprints, metrics = summary["fingerprints"], summary["metrics"]
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    if (run_dir / "metrics.jsonl").exists():
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    agreement = ("identical on all ranks" if summary["weights_identical"] else
                 "DIFFER across ranks: " + ", ".join(fingerprints))
    print(f"weights {agreement} (fingerprint {fingerprints[0]})", flush=True)
    if summary["first_step_seconds"] is not None:
        print(f"startup: the first training step ended {summary['first_step_seconds']:.1f} s "
              f"after rank 0's process started ({summary['setup_seconds']:.1f} s of it in "
              "setup: Horovod, data, model, restore)", flush=True)
    print(f"held-out accuracy: {metrics['val_accuracy']:.4f} on "
          f"{summary['validation_examples']} examples "
          f"(loss {metrics['val_loss']:.4f}); model saved to {run_dir / 'model.keras'}",
          flush=True)
