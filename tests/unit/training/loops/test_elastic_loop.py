"""The elastic loop across a world change, in one process: Horovod's retry loop and its
elastic state scripted (a commit that reports new hosts, as ``HostsUpdatedInterrupt`` does),
everything else hvdtrain's own. What one world hands the next: the user's callbacks see one
training, and a stop a callback asked for is not lost with the world."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import keras
import numpy as np

from hvdtrain.checkpoints.store import CheckpointStore
from hvdtrain.checkpoints.state import CheckpointState
from hvdtrain.collectives import LocalCollectives, World
from hvdtrain.config import Config, DataConfig, OptimConfig, TrainConfig
from hvdtrain.data.contract import ArraySplit, DataBundle
from hvdtrain.data.equal_steps import Passes
from hvdtrain.data.pipeline import ShardSpec
from hvdtrain.training.loops.driver import LOOPS, Training
from hvdtrain.training.loops.elastic import ElasticRun
from hvdtrain.training.step.objective import build_for_training
from hvdtrain.training.loops.run_columns import RunColumnsLog
from hvdtrain.training.step.schedule import RateControl, make_schedule
from hvdtrain.training.step.core import Evaluation, StepMath

EXAMPLES, BATCH, EPOCHS = 16, 4, 2        # 4 steps an epoch


class WorldChanged(Exception):
    """What a commit raises when the hosts changed (Horovod: ``HostsUpdatedInterrupt``)."""


class ScriptedState:
    """Horovod's elastic state for ``epoch`` and ``offset``: ``commit`` saves them, then
    reports a world change at the commits numbered in ``changes``; ``restore`` goes back."""

    def __init__(self, changes: set[int], **attributes: Any) -> None:
        self.changes, self.commits = changes, 0
        self.__dict__.update(attributes)
        self.saved = dict(attributes)

    def commit(self) -> None:
        self.commits += 1
        self.saved = {"epoch": self.epoch, "offset": self.offset}
        if self.commits in self.changes:
            raise WorldChanged()

    def restore(self) -> None:
        self.__dict__.update(self.saved)


class ScriptedElastic(LocalCollectives):
    """A world of one whose elastic retry loop reruns the training after a world change."""

    def __init__(self, changes: set[int]) -> None:
        super().__init__()
        self.changes = changes
        self.worlds = 0

    def elastic_state(self, variables: list, **attributes: Any) -> ScriptedState:
        return ScriptedState(self.changes, **attributes)

    def elastic_run(self, function: Callable[[Any], None]) -> Callable[[Any], None]:
        def retried(state: ScriptedState) -> None:
            while True:
                try:
                    return function(state)
                except WorldChanged:
                    state.restore()

        return retried

    def refresh_world(self) -> World:
        self.worlds += 1
        return self.world


class Hooks(keras.callbacks.Callback):
    """Counts train begins and ends; sets ``stop_training`` after the batch ``stop_after``
    (in epoch 0) once."""

    def __init__(self, stop_after: int | None = None) -> None:
        super().__init__()
        self.begins = self.ends = 0
        self.batches: list[tuple[int, int]] = []
        self.epoch = 0
        self.stop_after = stop_after

    def on_train_begin(self, logs=None):
        self.begins += 1

    def on_train_end(self, logs=None):
        self.ends += 1

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((self.epoch, batch))
        if batch == self.stop_after and self.epoch == 0:
            self.stop_after = None
            self.model.stop_training = True


def train_elastic(tmp_path: Path, changes: set[int], user: Hooks) -> ScriptedElastic:
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    data = DataBundle(ArraySplit(rng.standard_normal((EXAMPLES, 3)).astype(np.float32),
                                 rng.standard_normal((EXAMPLES, 1)).astype(np.float32)),
                      ArraySplit(np.ones((4, 3), np.float32), np.ones((4, 1), np.float32)),
                      None)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1))
    collectives = ScriptedElastic(changes)
    config = Config(train=TrainConfig(epochs=EPOCHS, batch_size=BATCH, commit_every=1,
                                      progress=False),
                    data=DataConfig(shuffle=False), optim=OptimConfig(warmup_epochs=0))
    schedule = make_schedule(config.optim, 1, EXAMPLES // BATCH, EPOCHS, 0.1)
    build_for_training(model, next(iter(data.train.dataset(
        ShardSpec(EXAMPLES, collectives.world, BATCH), 0, 1))), "dense")
    step = StepMath(model, model.optimizer, collectives)
    evaluation = Evaluation(model, collectives)

    def evaluate(spec: ShardSpec) -> dict[str, float]:
        return evaluation.run(data.val.dataset(spec))

    elastic = ElasticRun(
        config=config, collectives=collectives, data=data, model=model,
        optimizer=model.optimizer, schedule=schedule,
        rates=RateControl(schedule, {"optimizer": (model.optimizer, 0.1)}), first_step=step,
        evaluate=evaluate, store=CheckpointStore(tmp_path, 2),
        state=CheckpointState(model="dense"), run_dir=tmp_path, initial_epoch=0,
        user_callbacks=[user], run_columns=RunColumnsLog())
    LOOPS["elastic"](Training(step=step, epochs=EPOCHS, initial_epoch=0, done_steps=0,
                              passes=Passes(EXAMPLES // BATCH, None, 0), batches=_fixed_world,
                              callbacks=_fixed_world, around=_fixed_world,
                              elastic=lambda: elastic))
    return collectives


def _fixed_world() -> Any:
    raise AssertionError("the elastic loop makes each world's batches and callbacks itself")


def test_the_users_callbacks_see_one_training_across_worlds(tmp_path):
    user = Hooks()
    collectives = train_elastic(tmp_path, {2}, user)
    assert collectives.worlds == 2
    assert (user.begins, user.ends) == (1, 1)
    # The second world goes on after the last commit: epoch 0's third step, no step twice.
    assert user.batches == [(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3)]


def test_a_callbacks_stop_asked_for_just_before_a_world_change_is_not_lost(tmp_path):
    """The stop becomes a vote for the next step, which the next world's first step carries."""
    user = Hooks(stop_after=0)
    collectives = train_elastic(tmp_path, {1}, user)
    assert collectives.worlds == 2
    assert user.batches == [(0, 0), (0, 0)]
    assert (user.begins, user.ends) == (1, 1)
