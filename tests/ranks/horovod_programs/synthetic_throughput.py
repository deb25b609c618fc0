"""Training throughput on random images, measured on every rank, written the way a Horovod
user writes a synthetic benchmark, importing hvdtrain's drop-in where Horovod's module would be.

Every rank trains the same model on one fixed batch of random images (no input pipeline in the
measurement), first a few untimed warm-up batches, then ``--num-iters`` timed rounds of
``--num-batches-per-iter`` batches each. Rank 0 prints each round's rate; at the end each
rank's mean rate and the job's total, the sum of the ranks' measured rates (an allreduce), not
one rank's rate times the number of ranks. The flags are the ones Horovod's users know;
``--use-adasum`` is passed to the drop-in, which refuses it on TensorFlow's collectives.

    horovodrun -np 2 python tests/ranks/horovod_programs/synthetic_throughput.py \
        --model convnet --image-size 32 --batch-size 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import keras
import tensorflow as tf

import hvdtrain.tensorflow as hvd   # a Horovod program: import horovod.tensorflow as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_report import write_rank_report  # noqa: E402

CLASSES = 1000


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ResNet50",
                        help="'convnet' (three small convolutions, cheap on a CPU) or the name "
                             "of a keras.applications model, e.g. ResNet50, MobileNetV2")
    parser.add_argument("--image-size", type=int, default=224, help="height and width")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per batch")
    parser.add_argument("--num-warmup-batches", type=int, default=10,
                        help="untimed batches first (tracing, allocation)")
    parser.add_argument("--num-batches-per-iter", type=int, default=10,
                        help="batches in one timed round")
    parser.add_argument("--num-iters", type=int, default=10, help="timed rounds")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send the gradients as float16")
    parser.add_argument("--use-adasum", action="store_true",
                        help="combine the gradients with Adasum (Horovod backend only)")
    parser.add_argument("--no-cuda", action="store_true", help="run on the CPU even with GPUs")
    parser.add_argument("--out-dir", default=".", help="where the rank reports go")
    return parser.parse_args()


def choose_device(no_cuda: bool) -> str:
    """This process's GPU (by local rank), or the CPU when asked or when there is none."""
    gpus = [] if no_cuda else tf.config.list_physical_devices("GPU")
    if not gpus:
        tf.config.set_visible_devices([], "GPU")
        return "CPU"
    tf.config.experimental.set_memory_growth(gpus[hvd.local_rank()], True)
    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    return "GPU"


def make_model(name: str, image_size: int) -> keras.Model:
    shape = (image_size, image_size, 3)
    if name == "convnet":
        return keras.Sequential([
            keras.Input(shape),
            keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
            keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(CLASSES),
        ])
    application = getattr(keras.applications, name, None)
    if application is None:
        raise SystemExit(f"--model: no keras.applications.{name}; try convnet or ResNet50")
    return application(weights=None, input_shape=shape, classes=CLASSES)


def main() -> None:
    args = parse_args()
    hvd.init()
    device = choose_device(args.no_cuda)
    keras.utils.set_random_seed(7 + hvd.rank())   # differs on purpose: the broadcast fixes it

    model = make_model(args.model, args.image_size)
    # Adasum adapts the step to how the ranks' gradients agree, so its users keep the one-rank
    # rate; an average needs the rate scaled with the global batch.
    lr_scale = 1 if args.use_adasum else hvd.size()
    optimizer = keras.optimizers.SGD(0.01 * lr_scale)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    op = hvd.Adasum if args.use_adasum else hvd.Average

    images = tf.random.uniform((args.batch_size, args.image_size, args.image_size, 3))
    labels = tf.random.uniform((args.batch_size,), maxval=CLASSES, dtype=tf.int64)

    @tf.function
    def train_batch(first: bool) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression, op=op)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        if first:   # after the step that built the optimizer's variables: rank 0's everywhere
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    first_loss = float(train_batch(True))
    for _ in range(args.num_warmup_batches):
        train_batch(False)

    chief = hvd.rank() == 0
    if chief:
        print(f"model {args.model}, {args.image_size}x{args.image_size} images, batch "
              f"{args.batch_size} per rank, {hvd.size()} ranks on {device}")
    rates = []
    for round_number in range(args.num_iters):
        started = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            loss = train_batch(False)
        float(loss)   # wait for the last step to finish before stopping the clock
        rates.append(args.batch_size * args.num_batches_per_iter
                     / (time.perf_counter() - started))
        if chief:
            print(f"round {round_number}: {rates[-1]:.1f} img/sec on rank 0")

    mean_rate = statistics.fmean(rates)
    spread = statistics.stdev(rates) if len(rates) > 1 else 0.0
    total = float(hvd.allreduce(tf.constant(mean_rate), op=hvd.Sum))
    print(f"rank {hvd.rank()}: {mean_rate:.1f} +- {spread:.1f} img/sec per {device}")
    if chief:
        print(f"total: {total:.1f} img/sec on {hvd.size()} {device}(s)")
    write_rank_report(args.out_dir, hvd.rank(), model.trainable_variables, {
        "img_per_sec": rates, "total_img_per_sec": total,
        # Losses of the fixed batch before the first and the last update: one batch, learnt.
        "first_loss": first_loss, "last_loss": float(loss),
    })


if __name__ == "__main__":
    main()
