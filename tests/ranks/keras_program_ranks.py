"""Run every program of ``keras_programs`` one after the other, in one job:

    horovodrun -np 2 python -m keras_program_ranks hvdtrain OUT_DIR BATCH   # hvdtrain.fit
    horovodrun -np 2 python -m keras_program_ranks dropin OUT_DIR BATCH     # the Horovod way
    python -m keras_program_ranks keras OUT_DIR BATCH                         # one process

``BATCH`` is the batch the program's code uses in this process: per rank on 2 ranks, the
global batch (twice the per-rank one) in one process. ``hvdtrain`` calls ``hvdtrain.fit`` with no
rate scaling or warmup, so the math is one process's with the global batch; ``dropin`` calls
``model.fit`` after ``hvd.init()`` with ``BroadcastGlobalVariablesCallback(0)`` and
``MetricAverageCallback()`` first. Every rank writes ``OUT_DIR/<mode>-<rank>.json`` again after
each program (so a job that fails or hangs part-way still leaves what it did), with, per
program: every ``fit``'s history, steps per epoch (counted by a callback), what it printed and
warned, the example counters, the notes, the error if it raised; final weights go to ``.npz``
files. A program that raises is recorded and the next one runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_examples import PROGRAMS
from keras_programs import Context, Outcome


class EpochSteps(keras.callbacks.Callback):
    """The batches Keras' callbacks saw in each epoch (the user's step count) and the keys of
    the batch logs they were given."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[int] = []
        self.batch_keys: set[str] = set()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.counts.append(0)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.counts[-1] += 1
        self.batch_keys.update(logs or {})


def _keras_form(value: Any, batch_size: int | None) -> Any:
    """What a Keras user hands ``model.fit`` for what hvdtrain takes: a dataset function
    called, an unbatched dataset batched."""
    from hvdtrain.keras_internals import dataset_is_batched

    if callable(value) and not isinstance(value, (tf.data.Dataset, keras.utils.PyDataset)):
        value = value()
    if isinstance(value, tf.data.Dataset) and not dataset_is_batched(value):
        value = value.batch(batch_size)
    return value


def fit_in_mode(mode: str, directory: Path, fits: list[dict], model: keras.Model, x: Any,
                y: Any, **kwargs: Any) -> dict:
    callbacks = list(kwargs.pop("callbacks", []))
    steps = EpochSteps()
    record: dict[str, Any] = {}
    fits.append(record)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if mode == "hvdtrain":
                    import hvdtrain

                    result = hvdtrain.fit(
                        model, x, y, callbacks=callbacks + [steps],
                        run_dir=str(directory / f"run-{len(fits)}"), lr_scaling="none",
                        warmup_epochs=0, progress=False, tensorboard=False, stall_timeout=0,
                        **kwargs)
                    history = result.history.history
                    record["fingerprints"] = list(result.fingerprints)
                else:
                    batch_size = kwargs.get("batch_size")
                    x = _keras_form(x, batch_size)
                    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
                        kwargs.pop("batch_size", None)
                    if isinstance(kwargs.get("validation_data"), tf.data.Dataset):
                        kwargs["validation_data"] = _keras_form(kwargs["validation_data"],
                                                                batch_size)
                    if mode == "dropin":
                        import hvdtrain.keras as hvd

                        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                     hvd.callbacks.MetricAverageCallback(), *callbacks]
                    history = model.fit(x, y, callbacks=callbacks + [steps], verbose=0,
                                        **kwargs).history
            finally:
                record["warnings"] = [str(w.message) for w in caught]
    finally:
        record["said"] = said.getvalue().splitlines()
        record["epoch_steps"] = steps.counts
        record["batch_keys"] = sorted(steps.batch_keys)
        sys.stdout.write(said.getvalue())
        sys.stdout.flush()
    record["history"] = {key: [float(v) for v in values] for key, values in history.items()}
    return history


def _counts(variable: tf.Variable) -> dict[str, list[int]]:
    values = variable.numpy()
    seen = np.flatnonzero(values)
    return {"ids": seen.tolist(), "times": values[seen].tolist()}


def _record(outcome: Outcome, out: Path, prefix: str, rank: int) -> dict[str, Any]:
    weights = {}
    for name, model in outcome.models.items():
        path = out / f"{prefix}-{name}-{rank}.npz"
        np.savez(path, *model.get_weights())
        weights[name] = str(path)
    return {"weights": weights,
            "counts": {name: _counts(v) for name, v in outcome.counts.items()},
            "own_steps": None if outcome.own_steps is None else int(outcome.own_steps.numpy()),
            "notes": outcome.notes}


def main() -> None:
    mode, out, batch = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else list(PROGRAMS)
    rank, size = 0, 1
    if mode == "hvdtrain":
        import hvdtrain

        # Before the programs build anything (the TensorFlow backend needs it), with the thread
        # pools TensorFlow gives the one-process reference (every core).
        world = hvdtrain.init(threads=os.cpu_count())
        rank, size = world.rank, world.size
    elif mode == "dropin":
        import hvdtrain.keras as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    records: dict[str, Any] = {}
    for name in only:
        spec = PROGRAMS[name]
        if mode not in spec.modes:
            continue
        fits: list[dict] = []
        prefix = f"{mode}-{name}"
        ctx = Context(mode, rank, size, batch, partial(fit_in_mode, mode, out / prefix, fits),
                      out / prefix)
        ctx.directory.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        record: dict[str, Any] = {"error": None}
        try:
            record.update(_record(spec.build(ctx), out, prefix, rank))
        except Exception as error:
            traceback.print_exc()
            lines = str(error).strip().splitlines()
            record["error"] = f"{type(error).__name__}: {lines[0] if lines else ''}"
        record["fits"] = fits
        record["seconds"] = round(time.perf_counter() - started, 2)
        records[name] = record
        print(f"[{mode} rank {rank}] {name}: {record['seconds']} s"
              + (f", {record['error']}" if record["error"] else ""), file=sys.stderr,
              flush=True)
        path = out / f"{mode}-{rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(records))
        path.with_suffix(".tmp").replace(path)


if __name__ == "__main__":
    main()
