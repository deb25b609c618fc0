"""Checkpoints during training and the ranks' agreement to stop: rank 0 writes at each epoch's
end, every ``--checkpoint-every-steps`` steps and where the ranks agreed to stop; every rank
learns rank 0's outcome and every rank's stop request, so a failed write or a stop ends all
ranks alike and none is left waiting in a collective."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.checkpoints.store import CheckpointStore, rank_local_variables
from hvdtrain.checkpoints.state import CheckpointState
from hvdtrain.collectives import Collectives, gathered_at_chief, summed_across_ranks
from hvdtrain.data.equal_steps import Passes
from hvdtrain.errors import CheckpointWriteFailed, StoppedBySignal
from hvdtrain.liveness.watch import Liveness
from hvdtrain.training.loops.run_columns import RunColumnsLog, epoch_row
from hvdtrain.training.step.core import TrainingStep
from hvdtrain.optimizers.zero import consolidated_state


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run starts: after ``epoch`` whole epochs and ``step`` steps of the next
    (0: at its start), with that epoch's metric state summed over the ranks (rank 0 holds it,
    the others start from zero: the sums are only ever reduced by adding)."""

    epoch: int = 0
    step: int = 0
    epoch_state: tuple = ()


@dataclass(frozen=True)
class CheckpointPlan:
    """Where the run checkpoints, how often within an epoch (0: at epoch ends only), what every
    checkpoint records besides its position, and where a resumed run starts."""

    store: CheckpointStore
    state: CheckpointState
    every_steps: int = 0
    resume: ResumePoint = ResumePoint()


class Checkpointing(keras.callbacks.Callback):
    """Every rank: checkpoint (rank 0 writes) at each epoch end, every ``every_steps`` steps,
    and at the step where the ranks agreed to stop; then stop every rank if they agreed.

    After each write the ranks exchange rank 0's outcome and their stop requests, so a failed
    write or a stop ends every rank alike and no rank is left waiting in a collective. A stop
    agreed at an epoch's last step, or asked for during validation, takes effect after the
    epoch's callbacks, with the epoch-end checkpoint (a request in the last epoch lets the run
    finish: saving the final model takes no longer than stopping).

    A callback that sets ``model.stop_training`` from a batch hook, on any rank, stops every
    rank after the next step: the flag becomes a vote that rides in that step's allreduce. At
    an epoch end the ranks agree in the exchange above (any rank's flag stops all).
    """

    def __init__(self, step: TrainingStep, collectives: Collectives, plan: CheckpointPlan,
                 live_state: Callable[[], dict[str, Any]],
                 columns: RunColumnsLog, liveness: Liveness | None = None,
                 passes: Passes | None = None) -> None:
        """``live_state``: the rate factors and plateau state a checkpoint saves; ``passes``:
        how many steps each epoch has (None: Keras' ``params["steps"]``)."""
        super().__init__()
        self.step = step
        self.collectives = collectives
        self.plan = plan
        self.liveness = liveness
        self.columns = columns
        self.live_state = live_state
        self.passes = passes
        self.stop_message = ""
        self.epoch = 0
        self.epoch_steps = 0

    def _stop_reason(self) -> str | None:
        return None if self.liveness is None else self.liveness.stop_reason

    def _stop_checkpoint(self, stops: bool) -> None:
        """Tell the liveness monitor, where every rank stops after this checkpoint, before the
        last collective that every rank must enter (``Liveness.stop_checkpoint_begins``)."""
        if stops and self.liveness is not None:
            self.liveness.stop_checkpoint_begins()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self.stop_message:   # agreed at the previous epoch's end
            raise StoppedBySignal(self.stop_message)
        self.epoch = epoch
        self.epoch_steps = (self.params["steps"] if self.passes is None
                            else self.passes.epoch_steps(epoch))
        resume = self.plan.resume
        if resume.step and epoch == resume.epoch and self.collectives.world.is_chief:
            for variable, value in zip(self.step.epoch_state_variables, resume.epoch_state):
                variable.assign(tf.cast(np.asarray(value), variable.dtype))

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._stop_reason() is not None:
            self.step.votes.request_stop()

    def _callback_stop(self) -> None:
        """A batch hook's ``stop_training`` becomes a vote; the ranks' summed votes, delivered
        by the step, stop every rank at once."""
        votes = self.step.votes
        if self.model.stop_training:
            self.model.stop_training = False
            votes.request_callback_stop()
        if votes.callback_stop_agreed():
            self.model.stop_training = True
            votes.callback_stop_delivered()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._callback_stop()
        done, steps, every = batch + 1, self.epoch_steps, self.plan.every_steps
        if done == steps:   # the epoch end checkpoints (and stops, if agreed)
            return
        stop = self.step.votes.stop_agreed()
        if not stop and not (every and done % every == 0):
            return
        # The epoch's metric sums so far, over all ranks: rank 0 keeps them in the checkpoint.
        sums = summed_across_ranks(self.collectives, self.step.epoch_state_variables)
        name, reasons, _ = self._save({"epoch": self.epoch, "step": done,
                                       "epoch_state": tuple(np.asarray(s).tolist()
                                                            for s in sums)}, agreed_stop=stop)
        if stop:
            raise StoppedBySignal(f"stopped by {reasons} at epoch {self.epoch + 1}, step "
                                  f"{done} of {steps}; checkpoint {name} written; "
                                  "continue with the same command and --resume auto")

    def end_epoch(self, epoch: int, logs: dict) -> None:
        """The epoch's checkpoint, then every rank stops if any asked (``end_epoch``)."""
        name, reasons, stop_training = self._save({
            "epoch": epoch + 1, "metrics": epoch_row(epoch, logs, self.columns)},
            any_request_stops=True)
        self.model.stop_training = stop_training
        if reasons:
            self.stop_message = (f"stopped by {reasons} after epoch {epoch + 1}; checkpoint "
                                 f"{name} written; continue with the same command and "
                                 "--resume auto")

    def _save(self, position: dict[str, Any], *, agreed_stop: bool = False,
              any_request_stops: bool = False) -> tuple[str, str, bool]:
        """Rank 0 writes; every rank gets the checkpoint's name (or rank 0's write error,
        raised everywhere), the stop requests of all ranks ("" when none) and whether any
        rank's callbacks asked to stop training. ``agreed_stop``: every rank stops after this
        checkpoint (a stop the steps agreed); ``any_request_stops``: any rank's stop request
        stops them all after it (an epoch's end)."""
        model = self.step.model
        local = [v.numpy() for v in rank_local_variables(model)]
        if self.step.powersgd is not None:   # saved after the random-generator states
            local += self.step.powersgd.rank_values()
        rank_states = gathered_at_chief(self.collectives, local) if local else None
        whole = consolidated_state(self.step.optimizers, model)
        outcome = ""
        if self.collectives.world.is_chief:
            try:
                outcome = self.plan.store.save(model, self.step.optimizers, replace(
                    self.plan.state, **self.live_state(), **position,
                    sharded=whole and whole.record), rank_states, whole and whole.arrays,
                    whole and whole.weights).name
            except CheckpointWriteFailed as error:
                outcome = f"error: {error}"
        wants_stop = bool(model.stop_training or self.step.votes.callback_stop_requested())
        request = self._stop_reason()
        self._stop_checkpoint(agreed_stop or (any_request_stops and request is not None))
        shared = self.collectives.allgather_object((outcome, request, wants_stop))
        name = shared[0][0]
        if name.startswith("error: "):
            raise CheckpointWriteFailed(name[len("error: "):])
        reasons = ", ".join(f"{reason} on rank {rank}"
                            for rank, (_, reason, _) in enumerate(shared) if reason)
        self._stop_checkpoint(any_request_stops and bool(reasons))   # a request only others had
        return name, reasons, any(stop for _, _, stop in shared)
