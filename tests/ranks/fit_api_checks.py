"""What a notebook or script does with ``hvdtrain.fit`` beyond one clean run, on every rank of
one job (``horovodrun -np 2 python -m fit_api_checks OUT_DIR``):

1. a user's callback raises on rank 1 only: rank 1 gets its own error, rank 0 a
   ``PeerFailed`` at once (not a wait in a collective), and a second ``fit`` in the same
   processes trains normally, with ``verbose=2`` and Keras callbacks that print
   (``EarlyStopping``, ``ReduceLROnPlateau`` with ``verbose=1``): Keras' console on rank 0
   alone;
2. ``BackupAndRestore``: a run interrupted after epoch 2 (a callback raises on every rank),
   run again with the same callback, continues at epoch 3 and ends with the weights of an
   uninterrupted run;
3. a ``hvdtrain.Pipeline`` written as the README shows (shuffle with the shard's seed, then
   take this rank's part): every example is trained once per epoch, on one rank;
4. synchronized batch normalisation: a layer with ``synchronized=True`` and a plain one, under
   ``sync_batch_norm=True``, on 2 ranks x 16 end where Keras' own ``fit`` of 1 x 32 ends in
   this process (plain layers: 0.1 apart), each layer left as it was.

Rank 0 writes what every rank saw to ``OUT_DIR/checks.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import keras
import numpy as np

import hvdtrain
from hvdtrain.collectives import init_collectives

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
OPTIONS = {"batch_size": 16, "progress": False, "tensorboard": False, "lr_scaling": "none",
           "warmup_epochs": 0, "shuffle": False}


def data():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images / 16.0).astype(np.float32)[..., None], bunch.target.astype(np.int64)


def model() -> keras.Model:
    keras.utils.set_random_seed(3)
    built = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    built.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return built


class FailAt(keras.callbacks.Callback):
    """Raises at the end of an epoch, on the ranks named."""

    def __init__(self, epoch: int, ranks: tuple[int, ...], message: str) -> None:
        super().__init__()
        self.epoch, self.ranks, self.message = epoch, ranks, message

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.epoch and RANK in self.ranks:
            raise RuntimeError(self.message)


def failure_then_another_fit(out: Path, x, y) -> dict:
    started = time.monotonic()
    try:
        hvdtrain.fit(model(), x, y, epochs=3, run_dir=str(out / "fails"),
                     callbacks=[FailAt(1, (1,), "the user's callback failed on rank 1")],
                     **OPTIONS)
        failure = None
    except Exception as error:  # noqa: BLE001 - what the user's script catches
        failure = f"{type(error).__name__}: {error}"
    failed_after = time.monotonic() - started
    # Each stops or lowers the rate after epoch 2, saying so once (rank 0).
    saying = [keras.callbacks.EarlyStopping("loss", min_delta=10, patience=0, verbose=1),
              keras.callbacks.ReduceLROnPlateau("loss", min_delta=10, patience=0, verbose=1)]
    again = hvdtrain.fit(model(), x, y, epochs=2, run_dir=str(out / "again"), verbose=2,
                         callbacks=saying, **OPTIONS)
    return {"failure": failure, "failed_after_s": failed_after,
            "again": again.metrics, "again_fingerprints": again.fingerprints,
            "again_history": again.history.history}


def backup_and_restore(out: Path, x, y) -> dict:
    backup = str(out / "backup")
    try:
        hvdtrain.fit(model(), x, y, epochs=4, run_dir=str(out / "interrupted"),
                     callbacks=[keras.callbacks.BackupAndRestore(backup),
                                FailAt(2, (0, 1), "interrupted")], **OPTIONS)
        interrupted = None
    except Exception as error:  # noqa: BLE001
        interrupted = str(error)
    resumed_model = model()
    resumed = hvdtrain.fit(resumed_model, x, y, epochs=4, run_dir=str(out / "resumed"),
                           callbacks=[keras.callbacks.BackupAndRestore(backup)], **OPTIONS)
    straight_model = model()
    hvdtrain.fit(straight_model, x, y, epochs=4, run_dir=str(out / "straight"), **OPTIONS)
    difference = max(float(np.abs(a - b).max()) for a, b in
                     zip(resumed_model.get_weights(), straight_model.get_weights()))
    return {"interrupted": interrupted, "resumed_epochs": len(resumed.history.history["loss"]),
            "difference": difference, "backup_left": os.path.exists(backup)}


def pipeline_shards(out: Path, x, y) -> dict:
    """Counts, per example id (from 1), how often this rank's training trained on it: through
    a compiled metric on an output that echoes the id (``programs.harness.SeenIds``), which sees
    real rows only (a rank that runs short is filled with real rows at weight zero)."""
    import tensorflow as tf

    from programs.harness import SeenIds, echoed, example_id_input

    n = len(x)
    ids = np.arange(1, n + 1, dtype=np.int64)

    def train(shard: hvdtrain.Shard) -> tf.data.Dataset:
        rows = tf.data.Dataset.from_tensor_slices(((x, ids), {"digit": y, "ids": ids}))
        rows = rows.shuffle(n, seed=shard.seed + shard.epoch)
        return rows.shard(shard.size, shard.rank).batch(shard.batch_size)

    counts = tf.Variable(tf.zeros([n + 1], tf.int64), trainable=False)
    image, example_id = keras.Input((8, 8, 1)), example_id_input()
    digit = keras.layers.Dense(10, activation="softmax", name="digit")(
        keras.layers.Flatten()(image))
    counted = keras.Model([image, example_id], {"digit": digit, "ids": echoed(example_id)})
    counted.compile(optimizer="sgd", loss={"digit": "sparse_categorical_crossentropy"},
                    metrics={"ids": [SeenIds(counts)]})
    hvdtrain.fit(counted, hvdtrain.Pipeline(train=train), epochs=2,
                 run_dir=str(out / "pipeline"), **OPTIONS)
    return {"counts": counts.numpy().tolist()}


def batch_norm_model(synchronized: bool) -> keras.Model:
    """Dense layers (no bias: batch normalisation removes it, and Adam would magnify its
    rounding-noise gradient) normalised by batch statistics: the first layer's ``synchronized``
    as given, the second's False."""
    keras.utils.set_random_seed(3)
    built = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(16, use_bias=False),
                              keras.layers.BatchNormalization(synchronized=synchronized),
                              keras.layers.Activation("relu"),
                              keras.layers.Dense(16, use_bias=False),
                              keras.layers.BatchNormalization(),
                              keras.layers.Activation("relu"),
                              keras.layers.Dense(10, activation="softmax")])
    built.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return built


def synchronized_batch_norm(out: Path, x, y) -> dict:
    """Max abs weight difference of 2 ranks x 16 under ``sync_batch_norm=True`` (a layer with
    ``synchronized=True`` and a plain one) from Keras' own ``fit`` of 1 x 32 (321 examples:
    the last global batch is one row, so one rank's last step is a filler that must count in
    no statistics); whether both layers were left as they were."""
    x, y = x[:321], y[:321]
    reference = batch_norm_model(True)
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    ours = batch_norm_model(True)
    hvdtrain.fit(ours, x, y, epochs=2, run_dir=str(out / "batch-norm"), sync_batch_norm=True,
                 **OPTIONS)
    return {"difference": max(float(np.abs(a - b).max())
                              for a, b in zip(reference.get_weights(), ours.get_weights())),
            "left_as_they_were": [ours.layers[i].synchronized for i in (2, 5)] == [True, False]}


def main() -> None:
    out = Path(sys.argv[1])
    x, y = data()
    results = {"failure": failure_then_another_fit(out, x, y),
               "backup": backup_and_restore(out, x, y),
               "pipeline": pipeline_shards(out, x, y),
               "batch_norm": synchronized_batch_norm(out, x, y)}
    everyone = init_collectives().allgather_object(results)
    if RANK == 0:
        (out / "checks.json").write_text(json.dumps(everyone))


if __name__ == "__main__":
    main()


def failing_on_rank_1() -> list[keras.callbacks.Callback]:
    """``--callbacks fit_api_checks:failing_on_rank_1``: the user's callback fails on rank 1."""
    return [FailAt(1, (1,), "the user's callback failed on rank 1")]
