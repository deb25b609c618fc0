"""Elastic training: ranks may leave and join while the job runs (Horovod elastic, Gloo).

The weights, optimizer state, epoch and examples already trained in it are committed every
``--commit-every`` steps and at each epoch end; after a change the survivors restore the commit,
a joining rank receives it from rank 0, the new world shards the rest of the epoch's seeded
permutation, and the rate follows the number of ranks. A joining rank starts from the top, so
nothing before the elastic loop may talk to other ranks. Rank 0 records every epoch segment in
``elastic.jsonl``. Launching and limits: launch/README.md, "Elastic jobs".

Each world trains over the custom loop's epoch driver (``epochs``: the batches, the callbacks'
sequence, the epoch end); what is elastic is here: the commits and the offset between the
driver's batches and epochs, each world's step, rate and callbacks, and what one world hands
the next (``Continuity``).
"""

from __future__ import annotations

import dataclasses

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf

from hvdtrain.checkpoints.store import CheckpointStore
from hvdtrain.checkpoints.state import CheckpointState
from hvdtrain.collectives import Collectives, World, tf_variables
from hvdtrain.config import Config
from hvdtrain.data.contract import DataBundle
from hvdtrain.data.pipeline import ShardSpec, real_rows_only
from hvdtrain.log import logger
from hvdtrain.training.loops.run_callbacks import Reporting, CallbackContext
from hvdtrain.training.loops.checkpointing import CheckpointPlan
from hvdtrain.training.loops.epoch_end import RunCallbacks, standard_callbacks
from hvdtrain.training.loops.epochs import Epoch, train_epochs
from hvdtrain.training.loops.run_columns import RunColumnsLog
from hvdtrain.training.step.schedule import RateControl, WarmupScaledRate, world_scale
from hvdtrain.training.step.core import StepMath
from hvdtrain.artifacts import run_files


@dataclass(kw_only=True)
class ElasticRun:
    """Everything the elastic loop needs; built once per process, before the loop."""

    config: Config
    collectives: Collectives
    data: DataBundle
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    schedule: WarmupScaledRate
    rates: RateControl
    first_step: StepMath   # the loss share and options every world's step keeps
    evaluate: Callable[[ShardSpec], dict[str, float]]
    store: CheckpointStore
    state: CheckpointState   # what the run trains; each checkpoint adds where it stands
    run_dir: Path
    initial_epoch: int
    user_callbacks: list[keras.callbacks.Callback]
    run_columns: RunColumnsLog   # kept across worlds; its rows carry each epoch's world size


def _log_segment(run_dir: Path, epoch: int, offset: int, world_size: int, lr: float) -> None:
    with run_files(run_dir, "elastic.jsonl"), open(run_dir / "elastic.jsonl", "a") as handle:
        handle.write(json.dumps({"epoch": epoch + 1, "offset": offset,
                                 "world_size": world_size, "lr": lr}) + "\n")
    logger.info(f"elastic: epoch {epoch + 1} continues at example {offset} on {world_size} "
                f"rank(s), learning rate {lr:.5g}")


@dataclass
class Continuity:
    """What one world hands the next: whether training has begun (the user's callbacks see one
    train begin), and the last world's step, whose callback stop vote not yet delivered
    carries over (a world change must not lose a stop; signals are not stop requests in an
    elastic job, launch/README.md)."""

    began: bool = False
    step: StepMath | None = None

    def next_world(self, step: StepMath) -> None:
        if self.step is not None:
            step.votes.carry_callback_stop(self.step.votes)
        self.step = step


def elastic_loop(run: ElasticRun) -> None:
    """Train epochs ``[initial_epoch, epochs)`` through Horovod's elastic retry loop."""
    config, collectives, data = run.config, run.collectives, run.data
    state = collectives.elastic_state(
        tf_variables(run.model.weights + run.optimizer.variables), epoch=run.initial_epoch,
        offset=0)
    optim = config.optim
    continuity = Continuity()

    @collectives.elastic_run
    def train(state: Any) -> None:
        """One world's segment of the training: hvdtrain's callbacks are this world's (their
        train begin frames it), each epoch's steps reach them in Keras' ``params``; the user's
        callbacks see one training (``Continuity``)."""
        world = collectives.refresh_world()
        run.schedule.set_world_scale(world_scale(optim, world.size))
        step = StepMath(run.model, run.optimizer, collectives, run.first_step.share,
                        dataclasses.replace(run.first_step.options, global_batch=world.size
                                            * config.train.batch_size))   # this world
        continuity.next_world(step)
        train_step = tf.function(step.keras_step, jit_compile=False)
        val_spec = ShardSpec(data.val.num_examples, world, config.train.batch_size, "pad",
                             False)
        epochs = config.train.epochs
        hooks = RunCallbacks(standard_callbacks(CallbackContext(
            collectives=collectives, step=step, rates=run.rates,
            checkpoints=CheckpointPlan(run.store, run.state),
            reporting=Reporting(run.run_dir, world.size * config.train.batch_size,
                                config.train.progress, tensorboard=config.train.tensorboard),
            evaluate=lambda: run.evaluate(val_spec), user_callbacks=run.user_callbacks,
            run_columns=run.run_columns, world_size_column=True)), run.model, epochs, None)
        run.model.stop_training = False
        hooks.begin_training(again=continuity.began)
        continuity.began = True
        train_epochs(hooks, train_step, run.model, _from_commit(run, state, world, hooks))
        hooks.on_train_end()

    train(state)


def _from_commit(run: ElasticRun, state: Any, world: World,
                 hooks: RunCallbacks) -> Iterator[Epoch]:
    """One world's epochs from the committed epoch and offset: the rest of that epoch's
    permutation on this world's shards, then whole epochs; each epoch's steps reach the
    callbacks in Keras' ``params``. Once an epoch has ended (not after a stop), the next
    begins at its first example and the state is committed."""
    config = run.config
    epochs = config.train.epochs
    remainder = "pad" if config.data.remainder == "auto" else config.data.remainder
    while state.epoch < epochs:
        spec = ShardSpec(run.data.train.num_examples, world, config.train.batch_size,
                         remainder, config.data.shuffle, config.train.seed, 1, state.offset)
        hooks.set_params({"epochs": epochs, "steps": spec.steps_per_epoch, "verbose": 0})
        if world.is_chief:
            lr = float(run.schedule(int(run.optimizer.iterations.numpy())))
            _log_segment(run.run_dir, state.epoch, state.offset, world.size, lr)
        yield Epoch(state.epoch, _committed_batches(run, state, spec))
        state.epoch += 1
        state.offset = 0
        state.commit()


def _committed_batches(run: ElasticRun, state: Any, spec: ShardSpec) -> Iterator[tuple[int, Any]]:
    """An epoch's batches from the committed offset: once a step has trained, the offset moves
    past its examples, and every ``commit_every`` steps the state is committed (not after a
    stop)."""
    remaining = spec.remaining
    for index, batch in enumerate(real_rows_only(run.data.train.dataset(
            spec, state.epoch, state.epoch + 1), spec)):
        yield index, batch
        state.offset += min(spec.global_batch, remaining - index * spec.global_batch)
        if (index + 1) % run.config.train.commit_every == 0:
            state.commit()
