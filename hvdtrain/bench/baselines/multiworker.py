"""TensorFlow's own data parallelism: ``MultiWorkerMirroredStrategy``, the custom-loop recipe
from TensorFlow's guide (``strategy.run`` of a step that averages the loss over the global
batch; the optimizer all-reduces the gradients). One process per worker, each told its place by
``TF_CONFIG``; ``hvdtrain.bench.compare`` starts them on localhost. Timed with the same
synthetic batch shape and the same timing loop as ``hvdtrain benchmark``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, help="written by worker 0")
    args = parser.parse_args(argv)

    import keras
    import numpy as np
    import tensorflow as tf

    from hvdtrain.bench.benchmark import DEFAULT_SHAPES, build_benchmark_model, time_steps

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    shape, classes = DEFAULT_SHAPES[args.model], 1000 if args.model == "resnet50" else 10
    global_batch = args.batch_size * workers
    with strategy.scope():
        model = build_benchmark_model(args.model, shape, classes)
        optimizer = keras.optimizers.SGD(0.05 * workers, momentum=0.9)
        optimizer.build(model.trainable_variables)
    task = strategy.cluster_resolver.task_id
    rng = np.random.default_rng(task)
    batch = (tf.constant(rng.standard_normal((args.batch_size, *shape), dtype=np.float32)),
             tf.constant(rng.integers(0, classes, args.batch_size)))

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    @tf.function
    def step(x, y):
        losses = strategy.run(replica_step, args=(x, y))
        return {"loss": strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)}

    times = time_steps(step, batch, args.warmup_steps, args.steps, args.repeats)
    median = statistics.median(times)
    if task == 0 and args.output:
        args.output.write_text(json.dumps({
            "step_seconds_median": median, "world_size": workers,
            "examples_per_second_total": global_batch / median}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
