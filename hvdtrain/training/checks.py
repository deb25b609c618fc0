"""The refusals that depend on the world or the data, in one place (those that depend on the
config's values alone are ``config.validate``'s): each a ``UserError`` with one line naming
the problem and the fix, reached alike on every rank."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Sequence

import keras
import tensorflow as tf

from hvdtrain.collectives import Collectives, World
from hvdtrain.config import Config
from hvdtrain.data.contract import ArraySplit, DataBundle
from hvdtrain.data.equal_steps import count_changed_line
from hvdtrain.data.files import LABEL_RANGE_MESSAGE, corrupt_record_message
from hvdtrain.errors import UserError


def check_backend(config: Config, collectives: Collectives) -> None:
    """What the backend auto chose cannot do (a backend asked for by name is checked with the
    config)."""
    if collectives.backend != "tensorflow":
        return
    if config.train.elastic or config.optim.reduction == "adasum":
        what = "--elastic" if config.train.elastic else "--reduction adasum"
        raise UserError(f"{what} needs the Horovod backend, and {collectives.chosen}; install "
                        "Horovod (launch/setup.sh) or drop the option")


def check_elastic(collectives: Collectives) -> None:
    """Elastic training needs Horovod's elastic launcher (what --elastic needs of the config
    alone, ``config.validate`` checks)."""
    if not hasattr(collectives, "elastic_run") or os.environ.get("HOROVOD_ELASTIC") != "1":
        raise UserError("--elastic needs Horovod's elastic launcher: horovodrun --min-np N "
                        "--max-np M --host-discovery-script SCRIPT ... python -m hvdtrain "
                        "--elastic")


@contextlib.contextmanager
def data_errors_named(data: DataBundle, rank: int = 0) -> Iterator[None]:
    """Turn TensorFlow's errors about the data mid-run (a corrupt record, a label out of range,
    a pass of another length than counted) into one line naming the problem. Read from the
    message: an error raised inside a generator reaches here as another kind."""
    try:
        yield
    except tf.errors.OpError as error:
        message = str(error)
        changed = count_changed_line(message, rank)
        if changed is not None:
            raise UserError(changed) from error
        if isinstance(error, tf.errors.DataLossError) or "DataLossError" in message:
            raise UserError(corrupt_record_message((data.train, data.val), message)) from error
        if LABEL_RANGE_MESSAGE in message:
            classes = data.num_classes or 0
            raise UserError(f"a label lies outside [0, {classes - 1}] for {classes} classes; "
                            "fix the labels or set --num-classes") from error
        raise


def check_world(config: Config, world: World) -> None:
    """What the config asks of the number of ranks."""
    if config.optim.reduction == "adasum" and world.size & (world.size - 1):
        raise UserError(f"--reduction adasum needs a power-of-two number of ranks, not "
                        f"{world.size}; launch 2, 4, 8... ranks or use --reduction mean")


def check_data(config: Config, data: DataBundle, validation_freq: int | list[int]) -> None:
    """What the config asks of the data: an elastic job re-shards arrays at an offset into
    their epoch; the plateau schedule watches every epoch's val_loss."""
    if config.train.elastic and not isinstance(data.train, ArraySplit):
        raise UserError("--elastic supports in-memory datasets (arrays); a pipeline cannot "
                        "be re-sharded at an offset into its epoch")
    if config.optim.lr_schedule == "plateau" and (data.val is None or validation_freq != 1):
        raise UserError("--lr-schedule plateau watches val_loss after every epoch; give "
                        "validation data (every epoch) or choose another schedule")


def check_callbacks(config: Config, callbacks: Sequence[keras.callbacks.Callback]) -> None:
    """A user's callback that saves the optimizer from rank 0 alone would save 1/N of a
    sharded optimizer's state (rank 0's pieces)."""
    if not config.optim.zero_stage:
        return
    for callback in callbacks:
        if isinstance(callback, (keras.callbacks.BackupAndRestore,
                                 keras.callbacks.ModelCheckpoint)):
            raise UserError(f"{type(callback).__name__} saves rank 0's optimizer state, which "
                            "--zero-stage cuts into pieces across the ranks; use hvdtrain's "
                            "checkpoints (--run-dir, --resume auto) or --zero-stage 0")
