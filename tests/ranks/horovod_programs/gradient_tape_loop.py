"""Handwritten digits with a training loop of one's own (``tf.GradientTape``), written the way a
Horovod TensorFlow user writes it, importing hvdtrain's drop-in where Horovod's module would be.

The Horovod idioms it exercises: ``hvd.DistributedGradientTape`` around the tape, so its
gradients come back combined over the ranks; rank 0's variables broadcast right after the first
step (the optimizer has no variables before it); a metric averaged over the ranks with
``hvd.allreduce``; a ``tf.train.Checkpoint`` written by rank 0 only. The data are
scikit-learn's bundled 8x8 digits, so nothing is downloaded.

    horovodrun -np 2 python tests/ranks/horovod_programs/gradient_tape_loop.py --out-dir /tmp/run
"""

from __future__ import annotations

import argparse
import os
import sys

import keras
import tensorflow as tf
from sklearn.datasets import load_digits

import hvdtrain.tensorflow as hvd   # a Horovod program: import horovod.tensorflow as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_report import use_one_gpu_per_process, write_rank_report  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="steps, the same on every rank")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per rank per step")
    parser.add_argument("--lr", type=float, default=0.002,
                        help="learning rate of one rank; the program uses lr * ranks")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--out-dir", default=".", help="the checkpoint and the rank reports")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send the gradients as float16")
    return parser.parse_args()


def this_ranks_batches(batch_size: int) -> tf.data.Dataset:
    """Endless shuffled batches of this rank's slice of the digits (rows rank, rank + size,
    ...), as 64 pixels in [0, 1]."""
    digits = load_digits()
    pixels = (digits.data / 16.0).astype("float32")[hvd.rank()::hvd.size()]
    labels = digits.target.astype("int64")[hvd.rank()::hvd.size()]
    return (tf.data.Dataset.from_tensor_slices((pixels, labels))
            .shuffle(len(pixels), seed=hvd.rank()).repeat().batch(batch_size))


class DigitClassifier:
    """A small network, its optimizer and one distributed training step."""

    def __init__(self, lr: float, compression) -> None:
        self.model = keras.Sequential([keras.Input((64,)),
                                       keras.layers.Dense(64, activation="relu"),
                                       keras.layers.Dense(10)])
        self.optimizer = keras.optimizers.Adam(lr)
        self.compression = compression
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(self, pixels: tf.Tensor, labels: tf.Tensor,
             first: bool) -> tuple[tf.Tensor, tf.Tensor]:
        """One update on every rank from the ranks' combined gradients; returns this rank's
        loss and accuracy on its batch. ``first`` is a Python bool: the first call traces a
        version that also broadcasts, every later call another that does not."""
        with tf.GradientTape() as tape:
            logits = self.model(pixels, training=True)
            loss = self.loss_fn(labels, logits)
        tape = hvd.DistributedGradientTape(tape, compression=self.compression)
        variables = self.model.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        if first:
            # Ranks began from different random weights; from now on they are rank 0's, and so
            # is the optimizer's state, which exists only once a step has built it.
            hvd.broadcast_variables(self.model.variables, root_rank=0)
            hvd.broadcast_variables(self.optimizer.variables, root_rank=0)
        hits = tf.cast(tf.equal(tf.argmax(logits, axis=1), labels), tf.float32)
        return loss, tf.reduce_mean(hits)


def main() -> None:
    args = parse_args()
    hvd.init()
    use_one_gpu_per_process(hvd.local_rank())
    keras.utils.set_random_seed(99 + hvd.rank())   # differs on purpose: the broadcast fixes it
    chief = hvd.rank() == 0

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    classifier = DigitClassifier(args.lr * hvd.size(), compression)
    checkpoint = tf.train.Checkpoint(model=classifier.model, optimizer=classifier.optimizer)

    logged = []
    for step, (pixels, labels) in enumerate(this_ranks_batches(args.batch_size).take(args.steps)):
        loss, accuracy = classifier.step(pixels, labels, step == 0)
        if step % args.log_every == 0 or step == args.steps - 1:
            # Each rank saw other examples: report the mean over ranks, the same on all.
            mean_loss, mean_accuracy = (float(hvd.allreduce(value, op=hvd.Average))
                                        for value in (loss, accuracy))
            logged.append({"step": step, "loss": mean_loss, "accuracy": mean_accuracy})
            if chief:
                print(f"step {step:4d}  loss {mean_loss:.4f}  accuracy {mean_accuracy:.3f}")

    if chief:   # the ranks hold the same variables: one copy is enough
        checkpoint.save(os.path.join(args.out_dir, "checkpoints", "digits"))
    write_rank_report(args.out_dir, hvd.rank(), classifier.model.trainable_variables,
                      {"logged": logged})


if __name__ == "__main__":
    main()
