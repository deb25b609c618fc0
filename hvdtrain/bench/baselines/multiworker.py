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

from hvdtrain.bench.benchmark import add_timing_arguments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser)
    args = parser.parse_args(argv)

    import keras
    import tensorflow as tf

    from hvdtrain.bench.benchmark import synthetic_problem, time_steps

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    task = strategy.cluster_resolver.task_id
    global_batch = args.batch_size * workers
    with strategy.scope():
        model, batch = synthetic_problem(args, task)
        optimizer = keras.optimizers.SGD(0.05 * workers, momentum=0.9)
        optimizer.build(model.trainable_variables)

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

    timing = time_steps(step, batch, args.warmup_steps, args.steps, args.repeats)
    median = statistics.median(timing.seconds)
    if task == 0 and args.output:
        args.output.write_text(json.dumps({
            "step_seconds_median": median, "world_size": workers,
            "examples_per_second_total": global_batch / median,
            "host_cpu_busy": timing.host_cpu_busy}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
