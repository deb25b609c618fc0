"""One training run, start to end, on every rank.

config -> world (Horovod or a world of one; devices) -> run directory -> data (sharded) -> model
and optimizer -> restore (resume) -> broadcast from rank 0 -> train (fit or custom loop, same
step and callbacks) -> final model, held-out accuracy, and a check that every rank ended with
the same weights.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.checkpoint import CheckpointStore, atomic_write_text
from hvdtrain.config import Config
from hvdtrain.data.pipeline import ShardSpec, array_dataset
from hvdtrain.data.sources import ArraySplits, load_source
from hvdtrain.errors import UserError
from hvdtrain.models import build_model
from hvdtrain.training.callbacks import Progress, standard_callbacks
from hvdtrain.training.loops import LOOPS
from hvdtrain.training.schedule import make_optimizer, make_schedule
from hvdtrain.training.step import StepMath
from hvdtrain.world import Collectives, World, init_collectives, place_devices


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


def _usable_run_dir(config: Config) -> Path:
    """Rank 0: the run directory, created and writable, consistent with --resume."""
    run_dir = Path(config.train.run_dir) if config.train.run_dir else default_run_dir(config)
    has_run = CheckpointStore(run_dir, 1).latest() is not None
    if config.train.resume and not has_run:
        raise UserError(f"--resume: no checkpoint in {run_dir}; drop --resume to start a new "
                        "run there")
    if not config.train.resume and has_run:
        raise UserError(f"{run_dir} already holds a run; pass --resume to continue it or choose "
                        "another --run-dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = run_dir / ".write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise UserError(f"run directory {run_dir} is not writable ({error.strerror}); choose "
                        "another --run-dir") from error
    return run_dir


def weight_fingerprint(model: keras.Model) -> str:
    """A short digest of every weight's bytes: equal on all ranks iff the weights are equal."""
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(np.ascontiguousarray(weight).tobytes())
    return digest.hexdigest()[:16]


def _tf_variables(variables: list) -> list[tf.Variable]:
    """The TensorFlow variables behind Keras 3 variables (what Horovod's broadcast assigns)."""
    return [getattr(v, "value", v) for v in variables]


def _make_evaluator(step: StepMath, dataset: tf.data.Dataset, collectives: Collectives):
    eval_step = tf.function(step.eval_step, jit_compile=False)

    def evaluate() -> dict[str, float]:
        step.eval_sums.reset()
        for features, labels, weights in dataset:
            eval_step(features, labels, weights)
        return step.eval_sums.global_means(collectives, prefix="val_")
    return evaluate


def _restore(config: Config, store: CheckpointStore, model: keras.Model,
             optimizer: keras.optimizers.Optimizer) -> int:
    """Rank 0: load the newest checkpoint into model and optimizer; return its epoch."""
    latest = store.latest()
    state = store.read_state(latest)
    if state.get("model") != config.model.model:
        raise UserError(f"{latest} was trained with model '{state.get('model')}', not "
                        f"'{config.model.model}'; resume with the same --model")
    store.restore(latest, model, optimizer)
    return int(state["epoch"])


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

    run_dir = Path(chief_decides(collectives, lambda: str(_usable_run_dir(config))))
    say(world, f"hvdtrain: {world.size} rank(s); rank 0 on {device}; run directory {run_dir}")
    say(world, "resolved config:\n" + config.to_yaml().rstrip())
    if world.is_chief:
        atomic_write_text(run_dir / "config.yaml", config.to_yaml())

    splits: ArraySplits = load_source(config.data, config.train.seed)
    batch = config.train.batch_size
    spec = ShardSpec(len(splits.x_train), world, batch, config.data.remainder, True,
                     config.train.seed)
    if spec.steps_per_epoch == 0:
        raise UserError(f"{len(splits.x_train)} training examples cannot fill one global batch of "
                        f"{spec.global_batch} ({world.size} ranks x {batch}); lower --batch-size "
                        "or use --remainder pad")
    val_spec = ShardSpec(len(splits.x_val), world, batch, "pad", False)

    model = build_model(config.model, splits.input_shape, splits.num_classes)
    schedule = make_schedule(config.optim, world.size, spec.steps_per_epoch)
    optimizer = make_optimizer(config.optim, schedule)
    optimizer.build(model.trainable_variables)
    store = CheckpointStore(run_dir, config.train.keep_checkpoints)
    initial_epoch = 0
    if config.train.resume:
        initial_epoch = chief_decides(collectives,
                                      lambda: _restore(config, store, model, optimizer))
        say(world, f"resuming after epoch {initial_epoch} from {store.latest()}")
    before_broadcast = collectives.allgather_object(weight_fingerprint(model))
    # One starting point for every rank: rank 0's weights and optimizer state.
    collectives.broadcast_variables(_tf_variables(model.variables + optimizer.variables))

    epochs = config.train.epochs
    dataset = array_dataset(splits.x_train, splits.y_train, spec, initial_epoch, epochs)
    val_dataset = array_dataset(splits.x_val, splits.y_val, val_spec)
    step = StepMath(model, optimizer, collectives)
    evaluate = _make_evaluator(step, val_dataset, collectives)
    state = {"model": config.model.model, "dataset": config.data.dataset,
             "input_shape": list(splits.input_shape), "num_classes": splits.num_classes,
             "world_size": world.size, "config": config.to_dict()}
    progress = Progress(epochs, spec.steps_per_epoch, spec.global_batch, config.train.progress,
                        interactive=sys.stdout.isatty() and world.size == 1)
    callbacks = standard_callbacks(world, step, collectives, evaluate, schedule, store, model,
                                   state, run_dir, progress)
    say(world, f"training {config.model.model} on {config.data.dataset}: "
               f"{len(splits.x_train)} examples, {spec.steps_per_epoch} steps/epoch, global "
               f"batch {spec.global_batch}, remainder policy '{config.data.remainder}'")
    started = time.perf_counter()
    if initial_epoch < epochs:
        LOOPS[config.train.loop](step, dataset, epochs, initial_epoch, spec.steps_per_epoch,
                                 callbacks)
    trained = time.perf_counter() - started

    metrics = evaluate()
    fingerprints = collectives.allgather_object(weight_fingerprint(model))
    if world.is_chief:
        summary = {"metrics": metrics, "world_size": world.size,
                   "weights_identical": len(set(fingerprints)) == 1,
                   "fingerprints": fingerprints,
                   "fingerprints_before_broadcast": before_broadcast,
                   "train_seconds": trained, "setup_seconds": started - launched,
                   "validation_examples": len(splits.x_val)}
        _finish(run_dir, model, summary)
    return RunResult(run_dir, metrics, fingerprints)


def _finish(run_dir: Path, model: keras.Model, summary: dict[str, Any]) -> None:
    """Rank 0: save the final model and the summary, and report."""
    partial = run_dir / ".model.partial.keras"
    model.save(partial)
    partial.replace(run_dir / "model.keras")
    fingerprints, metrics = summary["fingerprints"], summary["metrics"]
    consistent = summary["weights_identical"]
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    agreement = ("identical on all ranks" if consistent else
                 "DIFFER across ranks: " + ", ".join(fingerprints))
    print(f"weights {agreement} (fingerprint {fingerprints[0]})", flush=True)
    print(f"held-out accuracy: {metrics['val_accuracy']:.4f} on "
          f"{summary['validation_examples']} examples "
          f"(loss {metrics['val_loss']:.4f}); model saved to {run_dir / 'model.keras'}",
          flush=True)
