"""What a run leaves when it ends: on every rank the ``RunResult`` (what ``hvdtrain.fit``
returns), after the ranks tell each other how they end (``rank_ends``); on rank 0 the final model
(whole, or its weights when Keras cannot serialise it), ``summary.json`` (``RunSummary``),
``curves.png``, and the closing lines."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import keras

from hvdtrain.checkpoints.store import atomic_write_text
from hvdtrain.collectives import Collectives, variable_bytes
from hvdtrain.errors import first_sentence
from hvdtrain.keras_internals import automatic_names_kept, sublayers
from hvdtrain.log import logger
from hvdtrain.plots import plot_curves
from hvdtrain.training.loops.run_callbacks import FirstStepClock
from hvdtrain.training.loops.run_columns import RunColumns
from hvdtrain.training.memory import HeldMemory
from hvdtrain.optimizers.zero import saved_state_bytes
from hvdtrain.artifacts import run_files


@dataclass(frozen=True)
class RunResult:
    """What ``Run.execute`` (and ``hvdtrain.fit``) returns on every rank: the run directory,
    the exact final metrics, every rank's weight fingerprint, the trained model, Keras'
    ``History`` of the epochs' logs (``history.history["val_loss"]``...: the keys one plain
    ``model.fit`` has) and, for the same epochs, the run's own columns (``run_columns``: the
    learning rates and throughput that ``metrics.jsonl`` adds to the logs)."""

    run_dir: Path
    metrics: dict[str, float]
    fingerprints: list[str]
    model: keras.Model
    history: keras.callbacks.History | None = None
    run_columns: list[RunColumns] = dataclasses.field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """What a finished run reports; rank 0 writes it as ``summary.json``."""

    metrics: dict[str, float]
    world_size: int
    weights_identical: bool
    fingerprints: list[str]
    fingerprints_before_broadcast: list[str]
    train_seconds: float
    setup_seconds: float
    first_step_seconds: float | None
    first_step_unix_time: float | None
    validation_examples: int | None
    ranks: list[dict[str, Any]]   # every rank's World: host, local and cross rank and size
    # The epoch (from 1) after which ``metrics`` were measured (None: after training).
    validation_epoch: int | None = None
    # Every rank's ``HeldMemory`` as the loop ended (None for a rank of an elastic run).
    memory: list[dict[str, Any] | None] = dataclasses.field(default_factory=list)
    # The collectives ("horovod" or "tensorflow") and rank 0's device, in place_devices' words.
    backend: str = ""
    device: str = ""


@dataclass(frozen=True, kw_only=True)
class RankEnd:
    """How one rank ends the run: its weights' fingerprint, its ``World`` (as a dict), whether
    its last validation measured other weights than these (``stale``), and what it held for
    training (``HeldMemory`` as a dict; None for an elastic run)."""

    fingerprint: str
    world: dict[str, Any]
    stale: bool
    memory: dict[str, Any] | None


def rank_ends(collectives: Collectives, fingerprint: str, validated: str | None,
              memory: HeldMemory | None) -> list[RankEnd]:
    """Every rank's ``RankEnd`` (one collective); ``validated``: the fingerprint of the weights
    this rank's last validation measured (None: none yet)."""
    held = None if memory is None else dataclasses.asdict(memory)
    gathered = collectives.allgather_object((fingerprint,
                                             dataclasses.asdict(collectives.world),
                                             validated != fingerprint, held))
    return [RankEnd(fingerprint=each, world=world, stale=stale, memory=memory)
            for each, world, stale, memory in gathered]


def run_summary(ends: Sequence[RankEnd], *, metrics: dict[str, float],
                validation_epoch: int | None, validation_examples: int | None,
                before_broadcast: list[str], train_seconds: float, setup_seconds: float,
                first_step: FirstStepClock, backend: str, device: str) -> RunSummary:
    """The ``RunSummary`` of a run whose ranks ended as ``ends`` (the world, fingerprints,
    whether the ranks' weights agree, what each held); ``validation_epoch``: from 0, None when
    measured after training."""
    fingerprints = [end.fingerprint for end in ends]
    return RunSummary(metrics=metrics, world_size=len(ends),
                      weights_identical=len(set(fingerprints)) == 1, fingerprints=fingerprints,
                      fingerprints_before_broadcast=before_broadcast, train_seconds=train_seconds,
                      setup_seconds=setup_seconds, first_step_seconds=first_step.seconds,
                      first_step_unix_time=first_step.unix_time,
                      validation_examples=validation_examples, ranks=[end.world for end in ends],
                      validation_epoch=None if validation_epoch is None else validation_epoch + 1,
                      memory=[end.memory for end in ends], backend=backend, device=device)


# The members of a .keras archive, in the order Keras writes them; then the assets folder.
KERAS_ARCHIVE_MEMBERS = ("metadata.json", "config.json", "model.weights.h5")
# Room asked for beyond twice the variables' bytes (HDF5's metadata, the JSON files).
SAVE_MARGIN_BYTES = 2 ** 20


def save_model(run_dir: Path, model: keras.Model, weight_bytes: int | None = None) -> Path:
    """The final model as ``model.keras``; a model Keras cannot serialise whole (a subclass
    without ``get_config``, such as a GAN) as its weights, ``model.weights.h5``, said in one
    line. Keras would build the archive in memory whenever the host (not the job's memory
    limit) has room, holding the weights and optimizer state twice more; here it writes them
    unzipped, straight to disk, and the archive is made from those files. An HDF5 write that
    fails for want of space can crash the process, so the room is checked first
    (``weight_bytes``: the weights' whole size where the model holds pieces, ZeRO stage 3)."""
    partial = run_dir / ".model.partial.keras"
    unpacked = run_dir / ".model.partial"
    if not model.built and all(layer.built for layer in sublayers(model)):
        model.built = True     # a composite (a GAN) whose parts are built: it has trained
    with run_files(run_dir, "the final model", leftover=partial):
        shutil.rmtree(unpacked, ignore_errors=True)
        optimizer = getattr(model, "optimizer", None)
        stored = (variable_bytes(model.weights) if weight_bytes is None else weight_bytes) + (
            saved_state_bytes(optimizer) if optimizer is not None and optimizer.built else 0)
        if shutil.disk_usage(run_dir).free < 2 * stored + SAVE_MARGIN_BYTES:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run_dir))
        try:
            # An absolute path: Keras puts a relative folder's assets under a temporary folder.
            model.save(unpacked.resolve(), zipped=False)
        except (NotImplementedError, TypeError, ValueError) as error:
            partial.unlink(missing_ok=True)
            path = run_dir / "model.weights.h5"
            model.save_weights(path)
            why = first_sentence(str(error)) or "no config"
            logger.warning(f"note: Keras cannot save this model whole ({type(error).__name__}: "
                           f"{why}); saved its weights to {path} (give the class "
                           "get_config/from_config to save it whole)")
            return path
        else:
            archive_saved_model(unpacked, partial)
        finally:
            shutil.rmtree(unpacked, ignore_errors=True)
        partial.replace(run_dir / "model.keras")
    return run_dir / "model.keras"


def archive_saved_model(unpacked: Path, archive: Path) -> None:
    """A ``.keras`` archive from the folder ``model.save(zipped=False)`` wrote: the members
    Keras' own archive has, stored uncompressed as Keras stores them."""
    with zipfile.ZipFile(archive, "w") as zipped:
        for name in KERAS_ARCHIVE_MEMBERS:
            zipped.write(unpacked / name, name)
        for asset in sorted((unpacked / "assets").rglob("*")):
            if asset.is_file():
                zipped.write(asset, asset.relative_to(unpacked).as_posix())


def write_outputs(run_dir: Path, model: keras.Model, summary: RunSummary,
                  weight_bytes: int | None = None) -> None:
    """Rank 0: save the final model (of ``weight_bytes`` whole, if given), the summary and the
    curves, and report."""
    saved = save_model(run_dir, model, weight_bytes)
    fingerprints, metrics = summary.fingerprints, summary.metrics
    with run_files(run_dir, "summary.json"):
        atomic_write_text(run_dir / "summary.json",
                          json.dumps(dataclasses.asdict(summary), indent=2) + "\n")
    if (run_dir / "metrics.jsonl").exists():
        with run_files(run_dir, "curves.png"):
            plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    agreement = ("identical on all ranks" if summary.weights_identical else
                 "DIFFER across ranks: " + ", ".join(fingerprints))
    (logger.info if summary.weights_identical else logger.warning)(
        f"weights {agreement} (fingerprint {fingerprints[0]})")
    if summary.first_step_seconds is not None:
        logger.info(f"startup: the first training step ended {summary.first_step_seconds:.1f} s "
                    f"after rank 0's process started ({summary.setup_seconds:.1f} s of it in "
                    "setup: Horovod, data, model, restore)")
    if metrics:   # the compiled metrics first, then the losses
        names = sorted(metrics, key=lambda name: name.endswith("loss"))
        shown = ", ".join(f"{name[4:]}: {metrics[name]:.4f}" for name in names)
        when = ("" if summary.validation_epoch is None
                else f" (after epoch {summary.validation_epoch})")
        logger.info(f"held-out {shown} on {summary.validation_examples or 'the validation'} "
                    f"examples{when}; model saved to {saved}")
    else:
        logger.info(f"no validation data; model saved to {saved}")


def float32_copy(model: keras.Model, precision: str,
                 rebuild: Callable[[], keras.Model]) -> keras.Model:
    """The trained model rebuilt (``rebuild``) under the float32 policy, for saving and
    inference; the model itself when it trained in float32. Rank 0 alone rebuilds, so Keras'
    automatic names are kept as they were: a next run in this process names its layers, and so
    its collectives, as the other ranks do."""
    if precision == "float32":
        return model
    keras.mixed_precision.set_global_policy("float32")
    with automatic_names_kept():
        copy = rebuild()
    copy.set_weights(model.get_weights())
    return copy
