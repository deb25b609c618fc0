"""Where float16 on the wire spends its time: per float32 gradient size, the exchange in
float32, the exchange with fp16 compression, each piece of the latter alone, and the exchange
with bf16 compression (on Horovod: bfloat16 gathered, then summed in float32).

Run under a launcher with the MPI controller: ``launch/mpirun.sh -np 2 --command "python -m
hvdtrain.bench.fp16 --output fp16.json"``. Each path (``float32``, ``fp16``, the float16
allreduce alone, the casts alone, with XLA, float16 gathered then summed in float32, and
``bf16``) is a
``tf.function`` timed on every rank, the paths taking turns call by call; the median is
reported. The casts are local, so their times say what compression costs on any link, the
allreduce's what it costs on this one.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

PATHS = ("float32", "fp16", "float16_allreduce", "cast_down", "cast_up", "xla_cast_down",
         "xla_cast_up", "fp16_xla", "fp16_allgather", "bf16")
REDUCTIONS = ("float32", "fp16", "float16_allreduce", "fp16_xla", "fp16_allgather", "bf16")


@functools.cache
def xla_cast(dtype: Any) -> Callable[[Any], Any]:
    """A Cast to ``dtype`` that XLA compiles for this CPU (one compilation per shape)."""
    import tensorflow as tf

    return tf.function(lambda tensor: tf.cast(tensor, dtype), jit_compile=True)


def path_functions(collectives: Any) -> dict[str, tuple[Callable[[Any], Any], bool]]:
    """Each path's ``tf.function`` and whether it takes the float16 copy of the input."""
    import tensorflow as tf

    from hvdtrain.collectives import GradientReduction
    from hvdtrain.collectives.horovod_backend import horovod_tensorflow

    def reduce(tensor: Any, compression: str = "none") -> Any:
        return collectives.reduce_gradients([tensor], GradientReduction(
            compression=compression))[0]

    def fp16_xla(tensor: Any) -> Any:
        return xla_cast(tf.float32)(reduce(xla_cast(tf.float16)(tensor)))

    def fp16_allgather(tensor: Any) -> Any:
        gathered = horovod_tensorflow().allgather(tf.cast(tensor, tf.float16)[tf.newaxis])
        return tf.reduce_sum(tf.cast(gathered, tf.float32), axis=0)

    return {
        "float32": (tf.function(reduce), False),
        "fp16": (tf.function(lambda t: reduce(t, "fp16")), False),
        "float16_allreduce": (tf.function(reduce), True),
        "cast_down": (tf.function(lambda t: tf.cast(t, tf.float16)), False),
        "cast_up": (tf.function(lambda t: tf.cast(t, tf.float32)), True),
        "xla_cast_down": (tf.function(xla_cast(tf.float16)), False),
        "xla_cast_up": (tf.function(xla_cast(tf.float32)), True),
        "fp16_xla": (tf.function(fp16_xla), False),
        "fp16_allgather": (tf.function(fp16_allgather), False),
        "bf16": (tf.function(lambda t: reduce(t, "bf16")), False),
    }


def sweep(sizes: list[int], repeats: int, paths: tuple[str, ...] = PATHS) -> list[dict]:
    """Median seconds of every path at every size in bytes of float32, on this rank (rank 0
    returns them), the paths taking turns call by call after one warm-up call each. Each
    size's input holds multiples of 1/4 in [-2, 2), which a float16 (or bfloat16) sum of a few
    ranks keeps exact: every reduction path must return the float32 sum exactly, or the sweep
    fails."""
    from hvdtrain.collectives.horovod_backend import HorovodCollectives
    from hvdtrain.launchers import apply_runtime_defaults

    apply_runtime_defaults(gpus_visible=False)
    import numpy as np
    import tensorflow as tf

    collectives = HorovodCollectives()
    functions = path_functions(collectives)
    rows = []
    for nbytes in sizes:
        quarters = tf.random.stateless_uniform([nbytes // 4], (0, 1), -8, 8, dtype=tf.int32)
        single = tf.cast(quarters, tf.float32) / 4
        inputs = {False: single, True: tf.cast(single, tf.float16)}
        expected = (single * collectives.world.size).numpy()
        calls = {name: functools.partial(functions[name][0], inputs[functions[name][1]])
                 for name in paths}
        for name, call in calls.items():                  # warm-up (tracing, compiling)
            result = call()
            if name in REDUCTIONS and not np.array_equal(np.asarray(result, np.float32),
                                                         expected):
                raise AssertionError(f"{name} at {nbytes} bytes is not the exact sum")
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(repeats):      # round-robin, so a slow spell hits every path alike
            for name, call in calls.items():
                started = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - started)
        row: dict[str, Any] = {"bytes": nbytes}
        for name in paths:
            row[f"{name}_seconds"] = statistics.median(times[name])
            row[f"{name}_samples"] = times[name]
        rows.append(row)
    return rows if collectives.world.is_chief else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[4, 16, 64],
                        help="float32 gradient sizes in MiB (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    rows = sweep([int(mib * 2**20) // 4 * 4 for mib in args.mib], args.repeats,
                 tuple(args.paths))
    for row in rows:
        times = "  ".join(f"{name} {row[f'{name}_seconds'] * 1e3:8.2f}" for name in args.paths)
        print(f"{row['bytes'] / 2**20:>6g} MiB float32 (ms)  {times}", flush=True)
    if rows and args.output:
        args.output.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
