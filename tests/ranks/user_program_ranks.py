"""Run every program of ``user_programs`` one after the other, in one job:

    horovodrun -np 2 python user_program_ranks.py hvdtrain OUT_DIR BATCH   # hvdtrain.fit
    python user_program_ranks.py keras OUT_DIR BATCH                         # plain model.fit

``hvdtrain`` runs each program through ``hvdtrain.fit`` with ``BATCH`` per rank (no rate
scaling or warmup, so the math is one process's with the global batch); ``keras`` runs the same
program through plain ``model.fit`` with ``BATCH`` (the test passes twice the per-rank batch).
Every rank writes ``OUT_DIR/<mode>-<rank>.json`` (per program: history, step count, final
weights' file, what the program asks to record) and the final weights as ``.npz``. Running
them all in one job, each ``fit`` after the last in the same processes, also proves that a
second ``fit`` starts clean.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from user_programs import CALLBACKS, PROGRAMS, Program

# hvdtrain.fit's gradient bucket size: the test makes it small enough (1,049 bytes) that every
# program's gradients travel in several allreduces, its own train_step's included.
BUCKET_MIB = float(os.environ.get("USER_PROGRAMS_BUCKET_MIB", "4"))


def plain_keras_fit(program: Program, batch: int, directory: Path) -> dict[str, Any]:
    fit = dict(program.fit)
    callbacks = _callbacks(fit, directory)
    x = fit["x"]
    for key in ("x", "validation_data"):     # Keras takes datasets batched
        if isinstance(fit.get(key), tf.data.Dataset) and not _batched(fit[key]):
            fit[key] = fit[key].batch(batch)
    history = program.model.fit(batch_size=None if isinstance(x, tf.data.Dataset) else batch,
                                callbacks=callbacks, verbose=0, **fit)
    return {"history": history.history}


def _callbacks(fit: dict[str, Any], directory: Path) -> list:
    name = fit.pop("callbacks", None)
    return CALLBACKS[name](str(directory)) if name else []


def _batched(dataset: tf.data.Dataset) -> bool:
    from hvdtrain.keras_internals import dataset_is_batched

    return dataset_is_batched(dataset)


def hvdtrain_fit(program: Program, batch: int, directory: Path) -> dict[str, Any]:
    import hvdtrain

    fit = dict(program.fit)
    callbacks = _callbacks(fit, directory)
    x, y = fit.pop("x"), fit.pop("y", None)
    said = io.StringIO()     # what hvdtrain says on rank 0, kept for the record and the log
    try:
        with contextlib.redirect_stdout(said):
            result = hvdtrain.fit(program.model, x, y, batch_size=batch, callbacks=callbacks,
                                  run_dir=str(directory / "run"), lr_scaling="none",
                                  warmup_epochs=0, progress=False, tensorboard=False,
                                  stall_timeout=0, bucket_mib=BUCKET_MIB, **fit)
    finally:
        sys.stdout.write(said.getvalue())
        sys.stdout.flush()
    return {"history": result.history.history, "fingerprints": result.fingerprints,
            "metrics": result.metrics, "said": said.getvalue().splitlines()}


def main() -> None:
    mode, out, batch = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else list(PROGRAMS)
    if mode == "hvdtrain":
        import hvdtrain

        # Before the programs build their models (the TensorFlow backend needs it), with the
        # thread pools TensorFlow gives the one-process reference (every core): a convolution
        # sums in another order with fewer threads.
        hvdtrain.init(threads=os.cpu_count())
    records = {}
    for name in only:
        program = PROGRAMS[name](batch, rank) if name == "preprocessing" else PROGRAMS[name](batch)
        directory = out / f"{mode}-{name}"
        directory.mkdir(parents=True, exist_ok=True)
        run = hvdtrain_fit if mode == "hvdtrain" else plain_keras_fit
        record = run(program, batch, directory)
        record["history"] = {k: [float(v) for v in values]
                             for k, values in record["history"].items()}
        if program.steps_counter is not None:
            record["steps"] = int(program.steps_counter.numpy())
        notes = dict(program.notes)
        if "counts" in notes:
            notes["counts"] = notes["counts"].numpy().tolist()
        if "lookups" in notes:
            notes["lookups"] = [[str(token) for token in layer.get_vocabulary()]
                                for layer in notes["lookups"]]
        record["notes"] = notes
        weights = out / f"{mode}-{name}-{rank}.npz"
        np.savez(weights, *program.model.get_weights())
        record["weights"] = str(weights)
        records[name] = record
    (out / f"{mode}-{rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main()
