"""The end of an epoch, in code (``training/loops/epoch_end.py``): every part in its place, for any
loop that fires ``RunCallbacks.on_epoch_end`` (one process; the parts are recorders)."""

from __future__ import annotations

import keras

from hvdtrain.collectives import LocalCollectives
from hvdtrain.training.loops.epoch_end import CallbackGroups, EpochEnd, RunCallbacks

calls: list[tuple[str, dict]] = []


class Recorder(keras.callbacks.Callback):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def on_epoch_end(self, epoch, logs=None):
        calls.append((self.name, dict(logs)))


class Part:
    """A stand-in for the step, the liveness hooks and the checkpointing: notes each call."""

    def epoch_results(self, logs):
        calls.append(("metrics", dict(logs)))
        return {"loss": 0.5, "accuracy": 0.25}

    def epoch_end_begins(self, epoch):
        calls.append(("liveness", {}))

    def end_epoch(self, epoch, logs):
        calls.append(("checkpoint", dict(logs)))


def test_the_epoch_end_runs_its_parts_in_order_on_one_logs_dict():
    calls.clear()
    part = Part()

    def evaluate() -> dict[str, float]:
        calls.append(("validation", {}))
        return {"val_loss": 0.75, "val_accuracy": 0.5}

    end = EpochEnd(part, LocalCollectives(), part, part, evaluate, validation_freq=2)
    groups = CallbackGroups([Recorder("before")], [Recorder("own")], [Recorder("user")],
                            [Recorder("after")], end)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    hooks = RunCallbacks(groups, model, epochs=2, steps=1, last=[Recorder("history")])
    hooks.on_epoch_end(0, {"loss": 9.0, "accuracy": 1.0})   # no validation after epoch 1
    hooks.on_epoch_end(1, {"loss": 9.0, "accuracy": 1.0})   # (validation_freq=2)
    names = [name for name, _ in calls]
    one_epoch = ["liveness", "before", "metrics", "own", "user", "checkpoint", "after", "history"]
    assert names == one_epoch + one_epoch[:3] + ["validation"] + one_epoch[3:]
    assert dict(calls)["before"] == {"loss": 9.0, "accuracy": 1.0}   # the rank's own
    exact = {"accuracy": 0.25, "loss": 0.5, "val_accuracy": 0.5, "val_loss": 0.75}
    after_metrics = [logs for name, logs in calls[-5:] if name != "liveness"]
    assert after_metrics == [exact] * 5
    # In Keras' order (its CallbackList sorts an epoch's logs by name), whatever order the
    # step and the validation gave them in.
    assert all(list(logs) == list(exact) for logs in after_metrics)
