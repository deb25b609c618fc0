"""Single-process checks of how the ranks agree (``fake_collectives``: one process plays rank 0
or rank 1 of 2, the test scripts what the other rank sends): rank 0 decides and every rank
takes its answer or its error; a checkpoint written (or not) by rank 0 and the stop requests
of every rank reach every rank; a resumed run starts every rank at rank 0's point with its own
generator state; ranks that count their own batches pad to the most or drop to the fewest; a
stop request on any rank is summed into every rank's step.

Where rank 0's run can script rank 1's, it does: what rank 0 sent is what rank 1 receives."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from fake_collectives import Broadcast, Gather, ScriptedCollectives, Sum, Variables
from hvdtrain.checkpoints.store import Checkpoint, CheckpointStore, rank_local_variables
from hvdtrain.checkpoints.state import CheckpointState
from hvdtrain.collectives import World, chief_decides
from hvdtrain.config import Config, OptimConfig
from hvdtrain.data.contract import ArraySplit
from hvdtrain.data.pipeline import ShardSpec
from hvdtrain.data.user import PipelineSplit
from hvdtrain.errors import CheckpointWriteFailed, StoppedBySignal, UserError
from hvdtrain.training.loops.run_callbacks import Reporting, CallbackContext
from hvdtrain.training.loops.checkpointing import Checkpointing, CheckpointPlan, ResumePoint
from hvdtrain.training.data_plan import agreed_pass_steps
from hvdtrain.liveness.watch import Liveness
from hvdtrain.training.step.objective import LossShare, build_for_training
from hvdtrain.training.step.own import OwnStep
from hvdtrain.checkpoints.restore import starting_point
from hvdtrain.training.step.schedule import RateControl, make_schedule
from hvdtrain.training.step.core import StepMath, StepOptions
from hvdtrain.training.step.trainable import Trainable

# --- rank 0 decides ----------------------------------------------------------------------------


def test_rank_0_decides_and_broadcasts_its_answer():
    chief = ScriptedCollectives(0, 2, [Broadcast()])
    assert chief_decides(chief, lambda: ("runs/a", True)) == ("runs/a", True)
    assert chief.values("broadcast_object") == [(("runs/a", True), "")]
    assert not chief.unused()


def test_rank_1_takes_rank_0s_answer_without_deciding():
    chief = ScriptedCollectives(0, 2, [Broadcast()])
    chief_decides(chief, lambda: ("runs/a", True))
    other = ScriptedCollectives(1, 2, [Broadcast(*chief.values("broadcast_object"))])
    assert chief_decides(other, lambda: pytest.fail("rank 1 decided")) == ("runs/a", True)
    assert other.values("broadcast_object") == [(None, "")]


def test_a_user_error_on_rank_0_stops_rank_1_with_the_same_line():
    message = "--resume: no checkpoint in runs/a; drop --resume to start a new run there"

    def refuse() -> None:
        raise UserError(message)

    chief = ScriptedCollectives(0, 2, [Broadcast()])
    with pytest.raises(UserError) as on_chief:
        chief_decides(chief, refuse)
    other = ScriptedCollectives(1, 2, [Broadcast(*chief.values("broadcast_object"))])
    with pytest.raises(UserError) as on_other:
        chief_decides(other, lambda: pytest.fail("rank 1 decided"))
    assert str(on_chief.value) == str(on_other.value) == message


def test_an_unexpected_error_on_rank_0_is_not_passed_off_as_a_users_mistake():
    """A bug is not broadcast: it ends rank 0, whose exit ends the others' collectives."""
    chief = ScriptedCollectives(0, 2, [Broadcast()])
    with pytest.raises(ZeroDivisionError):
        chief_decides(chief, lambda: 1 / 0)
    assert chief.sent == []


# --- a model, its step and the checkpoint callback, on one rank of two -------------------------


def _model(dropout: bool = False) -> keras.Model:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)),
                              *([keras.layers.Dropout(0.5, seed=7)] if dropout else []),
                              keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1))
    model.optimizer.build(model.trainable_variables)
    return model


def _step(collectives: ScriptedCollectives, model: keras.Model,
          options: StepOptions = StepOptions()) -> StepMath:
    return StepMath(model, model.optimizer, collectives, LossShare(), options)


def _checkpointing(collectives: ScriptedCollectives, step: StepMath, run_dir: Path,
                   resume: ResumePoint = ResumePoint(),
                   stop_reason: str | None = None) -> Checkpointing:
    """The run's checkpoint and stop agreement for 4 steps an epoch (no periodic checkpoint);
    ``stop_reason``: this rank's liveness monitor holds that stop request."""
    schedule = make_schedule(OptimConfig(), collectives.size, 4, 2)
    liveness = Liveness()
    liveness.stop_reason = stop_reason
    hooks = CallbackContext(collectives=collectives, step=step, rates=RateControl(schedule, {}),
                            checkpoints=CheckpointPlan(CheckpointStore(run_dir, 2),
                                                       CheckpointState(model="dense"),
                                                       resume=resume),
                            reporting=Reporting(run_dir, 8, show_progress=False),
                            liveness=liveness)
    callback = Checkpointing(hooks.step, hooks.collectives, hooks.checkpoints,
                             lambda: {"rates": {}}, hooks.run_columns,
                             hooks.liveness, hooks.passes)
    callback.set_model(step.model)
    callback.set_params({"epochs": 2, "steps": 4, "verbose": 0})
    return callback


def _batch(rows: int = 4) -> tuple:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 3)).astype(np.float32)
    y = rng.standard_normal((rows, 1)).astype(np.float32)
    return x, y, tf.ones(rows), tf.fill([rows], 1.0 / (2 * rows))


def _peer_votes(stop: float, callback_stop: float = 0.0):
    """The other rank's share of one step's reduction: no gradient, no loss, no rows (a filler
    batch), its two votes (the step sends gradients, then its weighted loss, its share of the
    global batch, stop vote and callback stop vote)."""
    return lambda sent: [*(tf.zeros_like(t) for t in sent[:-4]), 0.0, 0.0, stop, callback_stop]


# --- checkpoint agreement ----------------------------------------------------------------------


def test_rank_0_saves_every_ranks_generator_state_and_gives_every_rank_the_checkpoints_name(
        tmp_path):
    model = _model(dropout=True)
    mine = [v.numpy() for v in rank_local_variables(model)]
    theirs = [value + 1 for value in mine]
    # Each rank's state reaches rank 0 by a broadcast of its own (rank 0's, then rank 1's).
    chief = ScriptedCollectives(0, 2, [Broadcast(), Broadcast(theirs),
                                       Gather({1: ("", None, False)})])
    callback = _checkpointing(chief, _step(chief, model), tmp_path)
    callback.on_epoch_begin(0)
    callback.end_epoch(0, {"loss": 0.5})
    written = CheckpointStore(tmp_path, 2).latest()
    assert written.name == "epoch-0001"
    saved = written.rank_states()
    for rank, expected in enumerate((mine, theirs)):
        for value, want in zip(saved[rank], expected):
            np.testing.assert_array_equal(value, want)
    assert chief.values("allgather_object") == [("epoch-0001", None, False)]
    assert not model.stop_training and not callback.stop_message and not chief.unused()


def test_rank_1_gets_rank_0s_failed_checkpoint_write_as_its_own_error(tmp_path):
    """Rank 0's write fails (its checkpoints folder cannot be made): it tells every rank
    before it raises, and rank 1 raises the same line; only rank 0 touches the disk."""
    chief_dir, other_dir = tmp_path / "rank0", tmp_path / "rank1"
    chief_dir.mkdir()
    other_dir.mkdir()
    (chief_dir / "checkpoints").write_text("a file where the checkpoints should go")
    chief = ScriptedCollectives(0, 2, [Gather({1: ("", None, False)})])
    callback = _checkpointing(chief, _step(chief, _model()), chief_dir)
    callback.on_epoch_begin(0)
    with pytest.raises(CheckpointWriteFailed) as on_chief:
        callback.end_epoch(0, {"loss": 0.5})
    (told,) = chief.values("allgather_object")
    assert told[0] == f"error: {on_chief.value}"
    other = ScriptedCollectives(1, 2, [Gather({0: told})])
    callback = _checkpointing(other, _step(other, _model()), other_dir)
    callback.on_epoch_begin(0)
    with pytest.raises(CheckpointWriteFailed) as on_other:
        callback.end_epoch(0, {"loss": 0.5})
    assert str(on_other.value) == str(on_chief.value)
    assert "could not write checkpoint epoch-0001" in str(on_other.value)
    assert other.values("allgather_object") == [("", None, False)]
    assert list(other_dir.iterdir()) == []


def test_a_stop_requested_on_rank_1_ends_rank_0_after_the_epochs_checkpoint(tmp_path):
    chief = ScriptedCollectives(0, 2, [Gather({1: ("", "SIGTERM", False)})])
    callback = _checkpointing(chief, _step(chief, _model()), tmp_path)
    callback.on_epoch_begin(0)
    callback.end_epoch(0, {"loss": 0.5})
    assert (tmp_path / "checkpoints" / "epoch-0001").is_dir()
    assert callback.liveness.stop_checkpoint_began   # its peers may leave first now
    with pytest.raises(StoppedBySignal, match=r"^stopped by SIGTERM on rank 1 after epoch 1; "
                                              r"checkpoint epoch-0001 written"):
        callback.on_epoch_begin(1)


def test_rank_1_sends_its_own_stop_request_and_stops_with_rank_0s_checkpoint(tmp_path):
    other = ScriptedCollectives(1, 2, [Gather({0: ("epoch-0001", None, False)})])
    callback = _checkpointing(other, _step(other, _model()), tmp_path, stop_reason="SIGUSR1")
    callback.on_epoch_begin(0)
    callback.end_epoch(0, {"loss": 0.5})
    assert other.values("allgather_object") == [("", "SIGUSR1", False)]
    assert callback.liveness.stop_checkpoint_began
    assert callback.stop_message.startswith("stopped by SIGUSR1 on rank 1 after epoch 1; "
                                            "checkpoint epoch-0001 written")
    assert not (tmp_path / "checkpoints").exists()


def test_a_callback_on_rank_0_that_stops_training_stops_rank_1_at_the_same_epoch(tmp_path):
    other = ScriptedCollectives(1, 2, [Gather({0: ("epoch-0001", None, True)})])
    callback = _checkpointing(other, _step(other, _model()), tmp_path)
    callback.on_epoch_begin(0)
    callback.end_epoch(0, {"loss": 0.5})
    assert callback.model.stop_training
    assert not callback.stop_message                # a callback's stop, not a stop request
    assert not callback.liveness.stop_checkpoint_began   # the peers are still judged


# --- the stop vote -----------------------------------------------------------------------------


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
def test_the_other_ranks_stop_vote_reaches_this_rank_in_the_steps_own_reduction(compression):
    """Rank 1 casts no vote, rank 0 does: the sum reaches rank 1 with the step's update, in
    the gradients' reduction (or, with compressed gradients, in the loss's own allreduce)."""
    compressed = compression != "none"
    if compressed:
        script = [Sum([[0.0, 0.0, 1.0, 0.0]]),
                  Sum([lambda sent: [tf.zeros_like(t) for t in sent]])]
    else:
        script = [Sum([_peer_votes(stop=1.0)])]
    other = ScriptedCollectives(1, 2, script)
    step = _step(other, _model(), StepOptions(compression=compression))
    step.train_step(*_batch())
    assert step.votes.stop_agreed() and not step.votes.stop_requested()
    sent = other.values("allreduce_sum" if compressed else "reduce_gradients")[0]
    assert [float(v) for v in sent[-2:]] == [0.0, 0.0]          # this rank's two votes
    assert other.calls() == (["allreduce_sum", "reduce_gradients"] if compressed
                             else ["reduce_gradients"])


def test_a_stop_request_on_this_rank_becomes_its_vote_and_stops_every_rank_mid_epoch(
        tmp_path):
    """Rank 1 is asked to stop: its vote rides in the next step, the sum stops both ranks
    after that step, rank 0 checkpoints there and rank 1 names itself as the reason."""
    model = _model()
    other = ScriptedCollectives(1, 2, [
        Sum([_peer_votes(stop=0.0)]),
        Sum([lambda sent: sent]),                 # the epoch's metric sums so far
        Gather({0: ("epoch-0000-step-000001", None, False)})])
    step = _step(other, model)
    callback = _checkpointing(other, step, tmp_path, stop_reason="SIGTERM")
    callback.on_epoch_begin(0)
    callback.on_train_batch_begin(0)
    step.train_step(*_batch())
    assert float(other.values("reduce_gradients")[0][-2]) == 1.0
    with pytest.raises(StoppedBySignal, match=r"^stopped by SIGTERM on rank 1 at epoch 1, "
                                              r"step 1 of 4; checkpoint "
                                              r"epoch-0000-step-000001 written"):
        callback.on_train_batch_end(0)
    assert not other.unused()
    assert callback.liveness.stop_checkpoint_began


def test_rank_0_checkpoints_the_summed_epoch_state_where_rank_1_asked_to_stop(tmp_path):
    model = _model()
    chief = ScriptedCollectives(0, 2, [
        Sum([_peer_votes(stop=1.0)]),
        Sum([lambda sent: [tf.ones_like(t) for t in sent]]),
        Gather({1: ("", "SIGTERM", False)})])
    step = _step(chief, model)
    callback = _checkpointing(chief, step, tmp_path)
    callback.on_epoch_begin(0)
    callback.on_train_batch_begin(0)
    step.train_step(*_batch())
    mine = [np.asarray(v.numpy()) for v in step.epoch_state_variables]
    assert mine
    with pytest.raises(StoppedBySignal, match="stopped by SIGTERM on rank 1 at epoch 1, step 1"):
        callback.on_train_batch_end(0)
    state = Checkpoint(tmp_path / "checkpoints" / "epoch-0000-step-000001").read_state()
    assert (state.epoch, state.step) == (0, 1)
    for saved, local in zip(state.epoch_state, mine):
        np.testing.assert_allclose(saved, local + 1, rtol=1e-6)


def test_a_batch_callbacks_stop_on_one_rank_is_a_vote_that_stops_both_after_the_next_step(
        tmp_path):
    model = _model()
    other = ScriptedCollectives(1, 2, [Sum([_peer_votes(stop=0.0)])] * 2)
    step = _step(other, model)
    callback = _checkpointing(other, step, tmp_path)
    callback.on_epoch_begin(0)
    step.train_step(*_batch())
    model.stop_training = True                    # a user's batch hook on this rank
    callback.on_train_batch_end(0)
    assert not model.stop_training and step.votes.callback_stop_requested()
    step.train_step(*_batch())
    assert float(other.values("reduce_gradients")[1][-1]) == 1.0
    callback.on_train_batch_end(1)
    assert model.stop_training
    assert not step.votes.callback_stop_requested() and not step.votes.callback_stop_agreed()


def test_a_peers_callback_stop_stops_this_rank_after_the_same_step(tmp_path):
    model = _model()
    other = ScriptedCollectives(1, 2, [Sum([_peer_votes(stop=0.0, callback_stop=1.0)])])
    step = _step(other, model)
    callback = _checkpointing(other, step, tmp_path)
    callback.on_epoch_begin(0)
    step.train_step(*_batch())
    callback.on_train_batch_end(0)
    assert model.stop_training


def test_a_models_own_step_sums_the_votes_with_its_logs():
    """A model's own step: the logs are averaged across ranks and the votes ride along."""
    model = _model()

    def rank_0(sent: list) -> list:          # logs three times this rank's, a stop vote
        return [*(3 * value for value in sent[:-2]), 1.0, 0.0]

    other = ScriptedCollectives(1, 2, [Sum([rank_0])])
    step = OwnStep(model, other, lambda x, y, sample_weight: (x, y, sample_weight))
    logs = step.keras_step(_batch())
    *mine, vote, callback_vote = other.values("allreduce_sum")[0]
    assert "loss" in logs and len(mine) == len(logs)
    for name, local in zip(logs, mine):
        assert float(logs[name]) == pytest.approx(2 * float(local), rel=1e-6)  # (a + 3a) / 2
    assert float(step.global_loss.numpy()) == pytest.approx(float(logs["loss"]))
    assert (float(vote), float(callback_vote)) == (0.0, 0.0)
    assert step.votes.stop_agreed() and not step.votes.callback_stop_agreed()


# --- where a resumed run starts ----------------------------------------------------------------


def test_only_rank_0_restores_the_epoch_state_of_a_resumed_epoch(tmp_path):
    """The epoch's metric sums so far live on rank 0 alone (sums are only ever added)."""
    for rank in (0, 1):
        collectives = ScriptedCollectives(rank, 2, [])
        step = _step(collectives, _model())
        build_for_training(step.model, _batch(), "dense")
        saved = tuple(np.full(v.shape, 2.0 + i).tolist()
                      for i, v in enumerate(step.epoch_state_variables))
        callback = _checkpointing(collectives, step, tmp_path, ResumePoint(1, 3, saved))
        callback.on_epoch_begin(1)
        for variable, value in zip(step.epoch_state_variables, saved):
            np.testing.assert_array_equal(variable.numpy(), value if rank == 0 else
                                          np.zeros_like(value))


def _resumable(rank: int, run_dir: Path) -> tuple[Config, CheckpointState, CheckpointStore,
                                                  StepMath, Trainable, ScriptedCollectives]:
    """What ``starting_point`` receives on ``rank``; its collectives scripted later."""
    collectives = ScriptedCollectives(rank, 2, [])
    config = Config()
    model = _model(dropout=True)
    step = _step(collectives, model)
    schedule = make_schedule(config.optim, 2, 4, config.train.epochs, 0.1)
    trainable = Trainable(model, None, model.optimizer, schedule,
                          RateControl(schedule, {"optimizer": (model.optimizer, 0.1)}),
                          LossShare())
    run = CheckpointState(model="dense", dataset="digits", input_shape=[3], num_classes=None,
                          examples=16, optimizer_classes={"optimizer": "SGD"}, world_size=2,
                          config=config.to_dict())
    return config, run, CheckpointStore(run_dir, 2), step, trainable, collectives


def test_a_resumed_run_starts_every_rank_at_rank_0s_point_with_its_own_generator_state(
        tmp_path):
    """Rank 0 reads the checkpoint and broadcasts where to start; rank 1 (whose run directory
    is empty) takes it, its own saved generator state and the rate factors, then rank 0's
    weights."""
    chief_dir, other_dir = tmp_path / "rank0", tmp_path / "rank1"
    other_dir.mkdir()
    config, run, store, step, trainable, chief = _resumable(0, chief_dir)
    model = step.model
    generators = [[v.numpy() + 11 * (rank + 1) for v in rank_local_variables(model)]
                  for rank in range(2)]
    trained = [w + 1 for w in model.get_weights()]
    model.set_weights(trained)
    store.save(model, step.optimizers, replace(run, epoch=2, step=3, epoch_state=([1.0, 2.0],),
                                               rates={"optimizer": 0.5}), generators)
    model.set_weights([w * 0 for w in trained])           # restore must bring them back

    chief.script = [Broadcast(), Gather({1: "fingerprint-1"}), Variables()]
    start, before = starting_point(config, run, chief, chief_dir, True, store, step,
                                   trainable, None, None)
    expected = ResumePoint(2, 3, ([1.0, 2.0],))
    assert start == expected and not chief.unused()
    (decided,) = chief.values("broadcast_object")
    (fingerprint,) = chief.values("allgather_object")
    assert before == [fingerprint, "fingerprint-1"]
    chief_model = model

    config, run, store, step, trainable, other = _resumable(1, other_dir)
    other.script = [Broadcast(decided), Gather({0: fingerprint}),
                    Variables(*chief.values("broadcast_variables"))]
    start, before = starting_point(config, run, other, other_dir, True, store, step,
                                   trainable, None, None)
    assert start == expected and not other.unused()
    assert before == [fingerprint, other.values("allgather_object")[0]]
    for rank, model in enumerate((chief_model, step.model)):
        for variable, value in zip(rank_local_variables(model), generators[rank]):
            np.testing.assert_array_equal(variable.numpy(), value)
    for mine, chiefs in zip(step.model.get_weights(), trained):
        np.testing.assert_allclose(mine, chiefs)
    assert trainable.rates.factors == {"optimizer": 0.5}
    assert list(other_dir.iterdir()) == []           # rank 0 alone reads and writes files


# --- padding a user's pipeline -----------------------------------------------------------------


def _pipeline(batches_on_this_rank: int) -> PipelineSplit:
    """A user's per-rank pipeline that yields this many batches of 2 on this rank."""
    x = np.arange(2 * batches_on_this_rank * 3, dtype=np.float32).reshape(-1, 3)
    y = np.zeros(len(x), np.int64)
    return PipelineSplit(lambda shard: tf.data.Dataset.from_tensor_slices((x, y)).batch(2),
                         None)


@pytest.mark.parametrize("remainder, agreed", [("pad", 5), ("drop", 3)])
def test_ranks_that_count_their_own_batches_agree_on_the_most_or_the_fewest(remainder, agreed):
    other = ScriptedCollectives(1, 2, [Gather({0: 5})])
    spec = ShardSpec(0, other.world, 2, remainder)
    assert agreed_pass_steps(_pipeline(3), spec, other) == (agreed, [5, 3])
    assert other.values("allgather_object") == [3]


def test_a_rank_with_fewer_batches_fills_them_with_a_real_batch_at_weight_zero():
    """The filler is rank 0's first batch of the data (the same real examples on every rank),
    never zeros: every input the model sees is one the user gave."""
    world = World(1, 2)
    split = _pipeline(3)
    spec = ShardSpec(0, world, 2, "pad", agreed_steps=5)
    batches = list(split.dataset(spec))
    assert [float(tf.reduce_sum(batch[3])) for batch in batches] == [2.0, 2.0, 2.0, 0.0, 0.0]
    first = batches[0][0].numpy()
    assert first.any()
    for filler in batches[3:]:
        np.testing.assert_array_equal(filler[0].numpy(), first)


def test_sources_that_plan_every_ranks_steps_need_no_agreement():
    """In-memory arrays: every rank computes the same count; no collective (an elastic rank
    that joins meets none here)."""
    lonely = ScriptedCollectives(1, 2, [])
    split = ArraySplit(np.zeros((101, 3), np.float32), np.zeros(101, np.int64))
    spec = ShardSpec(101, lonely.world, 8, "pad")
    assert agreed_pass_steps(split, spec, lonely) == (spec.steps_per_epoch, [7, 7])
    assert spec.steps_per_epoch == 7
    assert lonely.sent == []


@pytest.mark.parametrize(
    "examples, size, batch, remainder, accumulation, offset, updates, steps", [
        (1438, 2, 16, "pad", 1, 0, 45, 45),     # a short last global batch of 30
        (1438, 2, 16, "drop", 1, 0, 44, 44),
        (1438, 2, 16, "pad", 2, 0, 23, 46),     # whole accumulation groups only
        (1438, 2, 16, "drop", 2, 0, 22, 44),
        (101, 3, 5, "pad", 1, 30, 5, 5),        # an elastic epoch resumed at example 30
        (5, 2, 4, "drop", 1, 0, 0, 0),          # fewer examples than one global batch
    ])
def test_shard_spec_counts_updates_and_steps(examples, size, batch, remainder, accumulation,
                                             offset, updates, steps):
    spec = ShardSpec(examples, World(0, size), batch, remainder,
                     accumulation_steps=accumulation, offset=offset)
    assert (spec.global_batch, spec.update_batch) == (size * batch, size * batch * accumulation)
    assert (spec.updates_per_epoch, spec.steps_per_epoch) == (updates, steps)


def test_agreed_steps_override_the_count_from_examples():
    spec = ShardSpec(0, World(0, 2), 16, "pad", agreed_steps=63)
    assert spec.steps_per_epoch == 63 and spec.updates_per_epoch == 0
