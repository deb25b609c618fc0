"""The floor: the least a user must write for Horovod data parallelism with Keras 3.

One grouped allreduce (average) of the gradients inside a ``tf.function``, the optimizer's
apply, nothing else: no loss weighting, metrics, callbacks or checks. Timed with the same
synthetic batch and the same timing loop as ``hvdtrain benchmark``.
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

    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    from hvdtrain.bench.benchmark import synthetic_problem, time_steps

    hvd.init()
    model, batch = synthetic_problem(args, hvd.rank())
    optimizer = keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9)
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables([v.value for v in model.weights + optimizer.variables], 0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply(grads, model.trainable_variables)
        return {"loss": loss}

    timing = time_steps(step, batch, args.warmup_steps, args.steps, args.repeats)
    medians = hvd.allgather_object(statistics.median(timing.seconds))
    if hvd.rank() == 0 and args.output:
        args.output.write_text(json.dumps({
            "step_seconds_median": max(medians), "world_size": hvd.size(),
            "examples_per_second_total": args.batch_size * hvd.size() / max(medians),
            "host_cpu_busy": timing.host_cpu_busy}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
