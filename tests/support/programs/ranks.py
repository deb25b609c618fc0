"""Run every program of ``programs.sets`` that runs in a mode, one after the other, in one job:

    mpirun -np 2 python -m programs.ranks OUT_DIR hvdtrain         # hvdtrain.fit
    mpirun -np 2 python -m programs.ranks OUT_DIR dropin           # the Horovod way
    mpirun -np 2 python -m programs.ranks OUT_DIR hvdtrain,dropin  # one mode, then the other
    python -m programs.ranks OUT_DIR keras                         # one process, the reference
    ... OUT_DIR MODES NAME,NAME                                    # those programs only

Each program's code uses its ``Spec.batch`` per rank on 2 ranks and ``WORLD`` times it in one
process. ``hvdtrain`` calls ``hvdtrain.fit`` with no rate scaling or warmup (so the math is one
process's with the global batch) and the program's ``Spec.options``; ``dropin`` calls
``model.fit`` after ``hvd.init()`` with ``BroadcastGlobalVariablesCallback(0)`` and
``MetricAverageCallback()`` first. Every rank writes ``OUT_DIR/<mode>-<rank>.json`` again after
each program (so a job that fails or hangs part-way still leaves what it did), with, per
program: every ``fit``'s history, steps per epoch (counted by a callback), what it printed and
warned, the example counters, the notes, the error if it raised; final weights go to ``.npz``
files. A program that raises is recorded and the next one runs. Running them all in the same
processes, each ``fit`` after the last, also shows that a later ``fit`` starts clean.
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

from programs.harness import WORLD, Context, Outcome, Spec
from programs.sets import ALL


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


def _hvdtrain_fit(spec: Spec, directory: Path, record: dict, model: keras.Model, x: Any, y: Any,
                  callbacks: list, **kwargs: Any) -> dict:
    import hvdtrain

    result = hvdtrain.fit(model, x, y, callbacks=callbacks, run_dir=str(directory),
                          lr_scaling="none", warmup_epochs=0, progress=False, tensorboard=False,
                          stall_timeout=0, **spec.options, **kwargs)
    record["fingerprints"] = list(result.fingerprints)
    return result.history.history


def _keras_fit(mode: str, model: keras.Model, x: Any, y: Any, callbacks: list,
               **kwargs: Any) -> dict:
    batch_size = kwargs.get("batch_size")
    x = _keras_form(x, batch_size)
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        kwargs.pop("batch_size", None)
    if isinstance(kwargs.get("validation_data"), tf.data.Dataset):
        kwargs["validation_data"] = _keras_form(kwargs["validation_data"], batch_size)
    if mode == "dropin":
        import hvdtrain.keras as hvd

        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvd.callbacks.MetricAverageCallback(), *callbacks]
    return model.fit(x, y, callbacks=callbacks, verbose=0, **kwargs).history


def fit_in_mode(mode: str, spec: Spec, directory: Path, fits: list[dict], model: keras.Model,
                x: Any, y: Any, **kwargs: Any) -> dict:
    """``ctx.fit``: one ``fit`` in ``mode``, recorded in ``fits``."""
    steps = EpochSteps()
    callbacks = [*kwargs.pop("callbacks", []), steps]
    record: dict[str, Any] = {}
    fits.append(record)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if mode == "hvdtrain":
                    history = _hvdtrain_fit(spec, directory / f"run-{len(fits)}", record, model,
                                            x, y, callbacks, **kwargs)
                else:
                    history = _keras_fit(mode, model, x, y, callbacks, **kwargs)
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


def joined(modes: list[str]) -> tuple[int, int]:
    """Join the job as ``modes`` do (hvdtrain's first: it places the devices): (rank, size)."""
    rank, size = 0, 1
    if "hvdtrain" in modes:
        import hvdtrain

        # Before the programs build anything (the TensorFlow backend needs it), with the thread
        # pools TensorFlow gives the one-process reference (every core): a convolution sums in
        # another order with fewer threads.
        world = hvdtrain.init(threads=os.cpu_count())
        rank, size = world.rank, world.size
    if "dropin" in modes:
        import hvdtrain.keras as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    return rank, size


def run_program(mode: str, name: str, out: Path, rank: int, size: int) -> dict[str, Any]:
    """Run one program in ``mode``; its record (the error, if it raised)."""
    spec = ALL[name]
    fits: list[dict] = []
    prefix = f"{mode}-{name}"
    batch = spec.batch * (WORLD if size == 1 else 1)
    ctx = Context(mode, rank, size, batch, partial(fit_in_mode, mode, spec, out / prefix, fits),
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
    return record


def main() -> None:
    out, modes = Path(sys.argv[1]), sys.argv[2].split(",")
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else list(ALL)
    rank, size = joined(modes)
    assert size in (1, WORLD), size
    for mode in modes:
        records: dict[str, Any] = {}
        for name in only:
            if mode not in ALL[name].modes:
                continue
            records[name] = record = run_program(mode, name, out, rank, size)
            print(f"[{mode} rank {rank}] {name}: {record['seconds']} s"
                  + (f", {record['error']}" if record["error"] else ""), file=sys.stderr,
                  flush=True)
            path = out / f"{mode}-{rank}.json"
            path.with_suffix(".tmp").write_text(json.dumps(records))
            path.with_suffix(".tmp").replace(path)


if __name__ == "__main__":
    main()
