"""Handwritten digits with ``model.fit`` on every rank, written the way a Horovod Keras user
writes it, importing hvdtrain's drop-in where Horovod's module would be.

What it exercises, in the order a Horovod user meets it: ``hvd.init``, one GPU per local rank
(when there are GPUs), each rank training on its own part of the data, the learning rate scaled
by the number of ranks and warmed up to that value, ``hvd.DistributedOptimizer``, the
broadcast of rank 0's initial state, metrics averaged over the ranks, checkpoints and progress
bars on rank 0 only. The data are scikit-learn's bundled 8x8 digits, so nothing is downloaded.

    horovodrun -np 2 python tests/ranks/horovod_programs/keras_fit_callbacks.py --out-dir /tmp/run
"""

from __future__ import annotations

import argparse
import os
import sys

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import hvdtrain.keras as hvd   # a Horovod program: import horovod.tensorflow.keras as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_report import use_one_gpu_per_process, write_rank_report  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="examples per rank per step")
    parser.add_argument("--lr", type=float, default=0.001,
                        help="learning rate of one rank; the program uses lr * ranks")
    parser.add_argument("--warmup-epochs", type=int, default=3)
    parser.add_argument("--out-dir", default=".", help="checkpoints and the rank reports")
    return parser.parse_args()


def digits_split() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The digits as 8x8x1 images in [0, 1]; the last 297 are held out for the final score.
    Every rank loads the same arrays in the same order, so its share below is disjoint."""
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., np.newaxis]
    labels = digits.target.astype("int64")
    return (images[:1500], labels[:1500]), (images[1500:], labels[1500:])


def rank_share(images: np.ndarray, labels: np.ndarray, batch_size: int) -> tf.data.Dataset:
    """This rank's every size-th example, shuffled and repeated: ``fit`` takes a fixed number
    of steps per epoch, the same on every rank, so no rank waits for another at the end."""
    share = tf.data.Dataset.from_tensor_slices((images, labels)).shard(hvd.size(), hvd.rank())
    return share.shuffle(1024, seed=hvd.rank()).repeat().batch(batch_size)


def build_model() -> keras.Model:
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def main() -> None:
    args = parse_args()
    hvd.init()
    use_one_gpu_per_process(hvd.local_rank())
    keras.utils.set_random_seed(1234 + hvd.rank())   # differs on purpose: the broadcast fixes it
    chief = hvd.rank() == 0

    (train_x, train_y), (test_x, test_y) = digits_split()
    steps_per_epoch = len(train_x) // (args.batch_size * hvd.size())

    # More ranks, larger global batch: scale the rate with it (warmed up to by the callback).
    scaled_lr = args.lr * hvd.size()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr))
    model = build_model()
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    callbacks: list[keras.callbacks.Callback] = [
        # Rank 0's initial weights (and optimizer state) on every rank before the first step.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # The logged loss and accuracy are each rank's own until averaged here.
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr,
                                                 warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
    ]
    if chief:   # one writer: the other ranks hold the same weights
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(args.out_dir, "checkpoint-{epoch}.keras")))

    history = model.fit(rank_share(train_x, train_y, args.batch_size),
                        steps_per_epoch=steps_per_epoch, epochs=args.epochs,
                        callbacks=callbacks, verbose=1 if chief else 0)

    _, held_out_accuracy = model.evaluate(test_x, test_y, verbose=0)
    if chief:
        print(f"held-out accuracy {held_out_accuracy:.3f} on {len(test_x)} digits")
    write_rank_report(args.out_dir, hvd.rank(), model.trainable_variables, {
        "history": {key: [float(value) for value in values]
                    for key, values in history.history.items()},
        "held_out_accuracy": float(held_out_accuracy),
        "steps_per_epoch": steps_per_epoch,
    })


if __name__ == "__main__":
    main()
