"""One training run on every rank, in phases: setup (world, run directory, data, model and
step, probed on a real batch: ``prepared``), restore (``checkpoints.restore``), train (Keras
``fit``, the custom loop or the elastic loop, with the run's callbacks), finish (exact held-out
metrics, weights compared across ranks, rank 0's files: ``closing``). The CLI and
``hvdtrain.fit`` share it. What a run changes in the process is put back when it ends
(``process_state``), and a run that fails on one rank leaves the collectives so no peer waits
for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import Any, Callable, Iterator, Sequence

import keras
import tensorflow as tf

from hvdtrain import streams
from hvdtrain.checkpoints.store import CheckpointStore
from hvdtrain.checkpoints.state import CheckpointState
from hvdtrain.collectives import (Collectives, ended_by_another_rank, init_collectives,
                                  peer_unreachable, place_devices, raised_here)
from hvdtrain.config import Config, DataConfig
from hvdtrain.data.contract import DataBundle
from hvdtrain.data.datasets import python_draws
from hvdtrain.data.load import load_source
from hvdtrain.data.pipeline import real_rows_only
from hvdtrain.errors import PeerFailed, UserError
from hvdtrain.log import for_run, logger
from hvdtrain.models import build_model, check_input_shape
from hvdtrain.plugins import load_callbacks
from hvdtrain.autotune.trials import Tuning, autotune
from hvdtrain.training.loops.run_callbacks import Reporting, CallbackContext, StepPosition
from hvdtrain.training.loops.checkpointing import CheckpointPlan
from hvdtrain.training.checks import (check_backend, check_callbacks, check_data, check_world,
                                      data_errors_named)
from hvdtrain.training.data_plan import plan_data
from hvdtrain.training.loops.elastic import ElasticRun
from hvdtrain.training.loops.epoch_end import CallbackGroups, standard_callbacks
from hvdtrain.liveness.watch import Liveness, liveness_for
from hvdtrain.training.loops.driver import LOOPS, Training, loop_name
from hvdtrain.training.closing import (RunResult, float32_copy, rank_ends, run_summary,
                                       write_outputs)
from hvdtrain.training.memory import held_memory
from hvdtrain.training.prepared import Prepared, StartingPoint
from hvdtrain.training.process_state import run_environment, seeded_per_rank, share_random_state
from hvdtrain.checkpoints.restore import open_run_dir, starting_point, weight_fingerprint
from hvdtrain.training.step.schedule import PlateauDecay
from hvdtrain.training.step.core import TrainingStep
from hvdtrain.training.step.held import RunEnd
from hvdtrain.training.step.for_run import made_step, step_for_run
from hvdtrain.training.step.sync_batch_norm import synchronized_batch_norm
from hvdtrain.training.step.trainable import own_step_reason, prepare, probe_trainable
from hvdtrain.optimizers.zero import saved_from_pieces
from hvdtrain.tracking import check_tracking, start_tracking, warn_about_autologging


ModelFactory = Callable[[Any, "int | None"], keras.Model]
DataFactory = Callable[[DataConfig, int], DataBundle]


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
            return self._tracked(prepared)
        except BaseException as error:
            if peer_unreachable(error):
                self.liveness.peer_unreachable(error)
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

    def _tracked(self, run: Prepared) -> RunResult:
        """Restore, then train and finish followed by rank 0's tracker (if the job is tracked:
        it starts once the run directory is as the resume left it, and ends its MLflow run as
        finished, stopped or failed)."""
        start = self._restore(run)
        world = run.collectives.world
        if world.is_chief:
            warn_about_autologging(sys.modules)
            run.tracker = start_tracking(self.config, run.run_dir, world.size, world.cross_size,
                                         run.collectives.backend, run.device, run.run_columns,
                                         os.environ)
        try:
            started = time.perf_counter()
            with synchronized_batch_norm(run.trainable.model, run.collectives,
                                         self.config.train.sync_batch_norm):
                history = self._train(run, start)
            result = self._finish(run, start, history, started)
        except BaseException as error:
            if run.tracker is not None:
                run.tracker.close(error)
            raise
        if run.tracker is not None:
            run.tracker.close(None)
        return result

    # --- setup -------------------------------------------------------------------------------

    def _setup(self, collectives: Collectives, device: str, launched: float) -> Prepared:
        """Seeds, the run directory, the data and its shard plan, the model with the step that
        trains it (probed on one real batch), and the callbacks (``device``: where this rank
        was placed)."""
        config, world = self.config, collectives.world
        check_backend(config, collectives)
        check_world(config, world)
        check_tracking(config, os.environ)
        if not config.train.elastic:   # a rank joining an elastic job meets no collective
            share_random_state(config.train.seed, collectives.allgather_object)
        run_dir, resuming = open_run_dir(config, collectives)
        if world.is_chief:
            streams.log_to(run_dir)
        logger.info(f"{world.size} rank(s) on {world.cross_size} node(s); rank {world.rank} on "
                    f"{world.host}, {device}; run directory {run_dir}")
        logger.info(f"backend: {collectives.backend} ({collectives.chosen})")
        logger.info("resolved config:\n" + config.to_yaml().rstrip())

        data = self.data_factory(config.data, config.train.seed)
        with seeded_per_rank(config.train.seed, world.rank):
            model = self._model(data)
        own_step = own_step_reason(model, data)
        check_data(config, data, self.validation_freq)
        plan = plan_data(config, data, collectives, own_step)
        for note in plan.notes:
            logger.info(note)
        optim = config.optim
        trainable = prepare(config, model, data, world,
                            plan.updates_per_epoch(optim.accumulation_steps), own_step)
        with data_errors_named(data):
            first = next(iter(data.train.dataset(plan.spec, 0, 1)))
            probe_trainable(trainable, first, self.model_label, not optim.zero_stage,
                            data.sample_weights)
        plan = dataclasses.replace(plan, first_rows=int(tf.shape(tf.nest.flatten(first[0])[0])[0]))
        step = step_for_run(config, trainable, data, collectives, plan.global_batch(data.train)[0])
        evaluate_dataset = step.validation()
        plateau = (PlateauDecay(trainable.schedule, optim.lr_decay_factor, optim.plateau_patience)
                   if optim.lr_schedule == "plateau" else None)
        state = CheckpointState(
            model=self.model_label, dataset=config.data.dataset, input_shape=data.input_shape,
            num_classes=data.num_classes, examples=data.train.num_examples,
            optimizer_classes={name: type(optimizer).__name__
                               for name, optimizer in step.optimizers.items()},
            world_size=world.size, config=config.to_dict())
        # The user's callbacks: from the Python API and from ``--callbacks module:fn``.
        user_callbacks = [*self.extra_callbacks, *load_callbacks(config.train.callbacks)]
        check_callbacks(config, user_callbacks)
        return Prepared(
            collectives=collectives, run_dir=run_dir, resuming=resuming, data=data,
            trainable=trainable, step=step, plan=plan,
            evaluate=lambda spec: evaluate_dataset(real_rows_only(data.val.dataset(spec), spec)),
            plateau=plateau, user_callbacks=user_callbacks,
            store=CheckpointStore(run_dir, config.train.keep_checkpoints), state=state,
            launched=launched, device=device)

    def _model(self, data: DataBundle) -> keras.Model:
        model = self.model_factory(data.input_shape, data.num_classes)
        if not isinstance(model, keras.Model):
            raise UserError(f"'{self.model_label}' gave {type(model).__name__}, not a "
                            "keras.Model")
        check_input_shape(model, self.model_label, data.input_shape)
        return model

    # --- autotune (instead of restore, train and finish) ---------------------------------------

    def _autotune(self, run: Prepared) -> RunResult:
        """``--autotune``: time the run's step at other gradient settings on one real batch
        and report the fastest (``autotune.trials``); no restore, no training, no model."""
        batch = next(iter(run.data.train.dataset(run.spec, 0, 1)))

        def step_for(bucket_mib: float) -> TrainingStep:
            optim = dataclasses.replace(self.config.optim, bucket_mib=bucket_mib)
            return made_step(run.trainable, run.data, run.collectives,
                             run.plan.global_batch(run.data.train)[0], optim)

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
        resume, before_broadcast = starting_point(
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
        position = StepPosition()

        def validate_epoch() -> dict[str, float]:
            metrics = run.validate()
            run.validated = (position.epoch, self._fingerprint(run), metrics)
            return metrics

        def callbacks() -> CallbackGroups:
            groups = standard_callbacks(CallbackContext(
                collectives=run.collectives, step=run.step, rates=run.trainable.rates,
                checkpoints=CheckpointPlan(run.store, run.state,
                                           config.train.checkpoint_every_steps, start.resume),
                reporting=Reporting(run.run_dir, run.plan.global_batch(run.data.train)[0],
                                    config.train.progress,
                                    sys.stdout.isatty() and world.size == 1,
                                    config.train.tensorboard, run.first_step,
                                    None if run.tracker is None else run.tracker.callback(
                                        lambda: float(run.step.global_loss.numpy()))),
                liveness=self.liveness, passes=run.plan.passes,
                evaluate=None if run.data.val is None else validate_epoch,
                validation_freq=self.validation_freq, plateau=run.plateau,
                user_callbacks=run.user_callbacks, run_columns=run.run_columns))
            draws = python_draws(run.data.train, run.plan.spec, run.plan.passes)
            groups.before[:0] = [position, *draws]
            return groups

        @contextlib.contextmanager
        def around() -> Iterator[None]:
            with data_errors_named(run.data, world.rank), \
                    run.step.training(self._run_end()):
                try:
                    yield
                except tf.errors.OpError as error:
                    if position.epoch is not None and not ended_by_another_rank(error):
                        error.add_note(
                            f"hvdtrain: rank {world.rank} failed in epoch {position.epoch + 1}, "
                            f"step {position.batch + 1}, on "
                            f"{run.plan.describe_step(position.epoch, position.batch)}")
                    raise
                run.memory = held_memory(config.optim.zero_stage,
                                         list(run.step.optimizers.values()),
                                         run.step.gradient_bytes())

        trainable = run.trainable
        done = start.resume.step if start.resume.epoch == initial_epoch else 0
        return LOOPS[loop_name(config.train)](Training(
            step=run.step, epochs=epochs, initial_epoch=initial_epoch, done_steps=done,
            passes=run.plan.passes, callbacks=callbacks, around=around,
            batches=lambda: run.plan.stream(run.data.train, initial_epoch, done, epochs),
            elastic=lambda: ElasticRun(
                config=config, collectives=run.collectives, data=run.data, model=trainable.model,
                optimizer=trainable.optimizer, schedule=trainable.schedule, rates=trainable.rates,
                first_step=run.step, evaluate=run.evaluate, store=run.store, state=run.state,
                run_dir=run.run_dir, initial_epoch=initial_epoch,
                user_callbacks=run.user_callbacks, run_columns=run.run_columns)))

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
        epoch, measured, metrics = run.validated or (None, None, {})
        ends = rank_ends(collectives, self._fingerprint(run), measured, run.memory)
        memory = run.step.layer_memory
        if any(end.stale for end in ends):
            memory.whole_again()   # stage 3's pieces: validation computes with the whole model
            epoch, metrics = None, run.validate()
        # What the CLI's run left in pieces (a sharded optimizer's state, stage 3's weights) is
        # gathered one variable (or layer) at a time as rank 0 saves it.
        with saved_from_pieces(list(run.step.optimizers.values())) as streams, \
                memory.saved_whole(model, streams):
            if world.is_chief:
                summary = run_summary(
                    ends, metrics=metrics, validation_epoch=epoch,
                    validation_examples=None if run.data.val is None else run.data.val.num_examples,
                    before_broadcast=start.before_broadcast, train_seconds=trained,
                    setup_seconds=started - run.launched, first_step=run.first_step,
                    backend=collectives.backend, device=run.device)
                final = float32_copy(model, self.config.train.precision,
                                     lambda: self.model_factory(run.data.input_shape,
                                                                run.data.num_classes))
                write_outputs(run.run_dir, final, summary,
                              weight_bytes=memory.whole_bytes(final.weights))
        return RunResult(run.run_dir, metrics, [end.fingerprint for end in ends], model, history,
                         list(run.run_columns.rows))

    def _run_end(self) -> RunEnd:
        """What may stay in pieces after the run: only what rank 0's final save gathers, when
        the process ends with the run (the CLI); the weights only when the model is saved
        as it trained (float32; a mixed-precision model is copied whole to float32)."""
        ends_with_run = self.process_ends_with_run
        return RunEnd(optimizer_in_pieces=ends_with_run,
                      weights_in_pieces=ends_with_run and self.config.train.precision == "float32")

    @staticmethod
    def _fingerprint(run: Prepared) -> str:
        """The weights' fingerprint (a collective where stage 3 holds them in pieces)."""
        model = run.trainable.model
        return weight_fingerprint(run.step.layer_memory.whole_weights(model.weights))


def train(config: Config, liveness: Liveness | None = None) -> RunResult:
    """Run the configured training on this rank (the CLI's entry)."""
    return Run(config, process_ends_with_run=True, liveness=liveness).execute()
