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
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)

    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    import tensorflow as tf

    from hvdtrain.bench.benchmark import DEFAULT_SHAPES, build_benchmark_model, time_steps

    hvd.init()
    shape, classes = DEFAULT_SHAPES[args.model], 1000 if args.model == "resnet50" else 10
    model = build_benchmark_model(args.model, shape, classes)
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

    rng = np.random.default_rng(hvd.rank())
    batch = (tf.constant(rng.standard_normal((args.batch_size, *shape), dtype=np.float32)),
             tf.constant(rng.integers(0, classes, args.batch_size)))
    times = time_steps(step, batch, args.warmup_steps, args.steps, args.repeats)
    medians = hvd.allgather_object(statistics.median(times))
    if hvd.rank() == 0 and args.output:
        args.output.write_text(json.dumps({
            "step_seconds_median": max(medians), "world_size": hvd.size(),
            "examples_per_second_total": args.batch_size * hvd.size() / max(medians),
        }) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
