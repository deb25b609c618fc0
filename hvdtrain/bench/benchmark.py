"""``hvdtrain benchmark``: training throughput on synthetic data, through hvdtrain's own step.

Synthetic batches held on the device (no input pipeline in the way), warm-up steps excluded,
several timed repeats: prints per-rank and total examples/second and the step time (median and
spread over repeats) on rank 0, and writes them as JSON. Launch it like training:
``horovodrun -np 2 python -m hvdtrain benchmark --model cnn``. ``resnet50`` is Keras' ResNet-50
at 224x224 (for GPUs); ``mlp``, ``cnn`` and ``resnet`` suit CPUs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdtrain.builtin_names import GRADIENT_COMPRESSIONS
from hvdtrain.config import BUCKET_MIB, POWERSGD_RANK, OptimConfig, bucket_bytes

# Beside the ranks' folders of a ``--profile-dir``: how many ranks were profiled.
PROFILED_WORLD = "world.json"
DEFAULT_SHAPES = {"mlp": (28, 28, 1), "cnn": (28, 28, 1), "resnet": (32, 32, 3),
                  "resnet50": (224, 224, 3)}


def count(text: str) -> int:
    """An argparse type for counts that must be at least 1 (steps, repeats, rounds, ranks,
    threads): zero would leave nothing to time and end in a statistics error instead of this
    line."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def count_or_skip(text: str) -> int:
    """An argparse type for counts where 0 means "skip it" (the harnesses' allreduce sweep)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (skip) or more, got {value}")
    return value


def add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """What every timed variant takes, hvdtrain's benchmark and the baselines alike, so that
    a comparison hands each the same model, batch and timing loop."""
    parser.add_argument("--model", default="cnn", choices=sorted(DEFAULT_SHAPES),
                        help="model to time (default: cnn)")
    parser.add_argument("--input-shape", type=int, nargs="+", metavar="N",
                        help="example shape instead of the model's default (e.g. resnet50 at "
                             "32 32 3: its 23.6M-parameter gradient at a CPU's compute)")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank (default: 64)")
    parser.add_argument("--warmup-steps", type=int, default=10,
                        help="untimed steps first (tracing, allocation; default: 10)")
    parser.add_argument("--steps", type=count, default=30, help="steps per repeat (default: 30)")
    parser.add_argument("--repeats", type=count, default=5, help="timed repeats (default: 5)")
    parser.add_argument("--output", type=Path, help="write the result as JSON here (rank 0)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_timing_arguments(parser)
    parser.add_argument("--loop", default="custom", choices=("custom", "fit", "exchange"),
                        help="training path, or only the step's gradient exchange (tensors "
                             "shaped like the gradients, no compute; default: custom)")
    parser.add_argument("--compression", default="none", choices=GRADIENT_COMPRESSIONS,
                        help="gradients on the wire (default: none)")
    parser.add_argument("--powersgd-rank", type=count, default=POWERSGD_RANK,
                        help=f"--compression powersgd's rank (default: {POWERSGD_RANK})")
    parser.add_argument("--bucket-mib", type=float, default=BUCKET_MIB,
                        help="gradient bucket size, as in training (0: one allreduce after the "
                             f"backward pass; default: {BUCKET_MIB:g})")
    parser.add_argument("--bucket-order", default="ready", choices=("ready", "issued"),
                        help="when each bucket's allreduce is submitted, as in training "
                             "(default: ready)")
    parser.add_argument("--bucket-choice", default=OptimConfig().bucket_choice,
                        choices=("measured", "fixed"),
                        help="as in training: measured times --bucket-mib buckets against one "
                             "allreduce after the backward pass first and keeps the faster "
                             f"(default: {OptimConfig().bucket_choice})")
    parser.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2),
                        help="ZeRO stage, as in training (default: 0)")
    parser.add_argument("--profile-dir", type=Path, metavar="DIR",
                        help="after the timed repeats, record --steps more steps with "
                             "TensorFlow's profiler, each rank into DIR/rank<N> (read by "
                             "python -m hvdtrain.bench.overlap --profile DIR)")


def synthetic_problem(args: argparse.Namespace, rank: int):
    """(model, one synthetic batch (x, y) held on the device) for this rank: the same for
    hvdtrain and every baseline."""
    import numpy as np
    import tensorflow as tf

    shape = tuple(args.input_shape or DEFAULT_SHAPES[args.model])
    classes = 1000 if args.model == "resnet50" and not args.input_shape else 10
    model = build_benchmark_model(args.model, shape, classes)
    rng = np.random.default_rng(rank)
    batch = (tf.constant(rng.standard_normal((args.batch_size, *shape), dtype=np.float32)),
             tf.constant(rng.integers(0, classes, args.batch_size)))
    return model, batch


def build_benchmark_model(name: str, shape: tuple[int, ...], classes: int):
    """The benchmarked model, built the same way for hvdtrain and for every baseline."""
    import keras

    from hvdtrain.config import ModelConfig
    from hvdtrain.models import build_model

    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=shape, classes=classes)
    return build_model(ModelConfig(model=name), shape, classes)


def host_cpu_jiffies(stat: str | None = None) -> tuple[int, int] | None:
    """(busy, total) time of this host's CPUs since boot, from the first line of /proc/stat
    (``stat``: its text, for tests): every process and the kernel's own work (network
    interrupts, a traffic shaper) included, idle and I/O wait not busy; time a hypervisor gave
    to other guests (steal) is in neither. None off Linux."""
    try:
        text = Path("/proc/stat").read_text() if stat is None else stat
        fields = [int(value) for value in text.split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    total = sum(fields)          # user nice system idle iowait irq softirq
    return total - fields[3] - fields[4], total


def busy_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The fraction of the host's CPU time that was busy between two ``host_cpu_jiffies``."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


@dataclass(frozen=True)
class Timing:
    """Seconds per step for each repeat, and the fraction of this host's CPU time that was
    busy over the repeats (None where /proc/stat is not there)."""

    seconds: list[float]
    host_cpu_busy: float | None


def time_steps(run_step, batch, warmup: int, steps: int, repeats: int) -> Timing:
    """Time ``repeats`` runs of ``steps`` steps after ``warmup`` (one host sync per repeat, not
    per step)."""
    for _ in range(warmup):
        run_step(*batch)
    float(run_step(*batch)["loss"])
    times = []
    before = host_cpu_jiffies()
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(steps):
            logs = run_step(*batch)
        float(logs["loss"])                      # wait for the last step to finish
        times.append((time.perf_counter() - started) / steps)
    return Timing(times, busy_fraction(before, host_cpu_jiffies()))


def profile_steps(run_step, batch, steps: int, directory: Path) -> None:
    """``steps`` more steps recorded by TensorFlow's profiler into ``directory`` (after the
    timed repeats, so the profiler costs them nothing)."""
    import tensorflow as tf

    tf.profiler.experimental.start(str(directory))
    try:
        for _ in range(steps):
            logs = run_step(*batch)
        float(logs["loss"])                      # every profiled step has ended
    finally:
        tf.profiler.experimental.stop()


def _exchange_step(step):
    """The step's gradient exchange alone (``StepMath.reduce``: the same buckets, compression
    and scalars) on tensors shaped like the gradients."""
    import tensorflow as tf

    gradients = [tf.zeros(v.shape, v.dtype) for v in step.model.trainable_variables]

    @tf.function(jit_compile=False)
    def exchange(*_):
        reduced, scalars = step.reduce([tf.identity(g) for g in gradients],
                                       [tf.identity(tf.constant(1.0)) for _ in range(4)])
        return {"loss": scalars[0], "reduced": reduced}   # every output kept: none pruned

    return exchange


def _chosen(step, traced, batch):
    """``--bucket-choice measured`` before the timed steps, on the same schedule as a run's
    first steps (``bucket_choice.BucketChoice``, fed one batch at a time): the kept way's
    traced step."""
    from hvdtrain.training.step.bucket_choice import TracedPerWay, choosing

    ways = TracedPerWay(step, traced)
    [choice] = choosing(step, ways.switch)
    while choice.kept is None:
        choice.on_train_batch_begin(0)
        ways(*batch)
        choice.on_train_batch_end(0)
    return ways.traced[choice.kept]


def _fit_step(step, batch):
    """The Keras fit path's compiled step (the function fit itself would run); call it while
    the step is installed (``loops.step_installed``)."""
    import tensorflow as tf

    step.model.make_train_function(force=True)     # traced anew for the step's reduction
    train_function = step.model.train_function
    iterator = iter(tf.data.Dataset.from_tensors(batch).repeat())
    return lambda *_: train_function(iterator)


def run(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    """(is this rank 0, the result gathered from every rank)."""
    import tensorflow as tf

    from hvdtrain.training.loops.driver import step_installed
    from hvdtrain.training.step.bucket_choice import measured_candidates
    from hvdtrain.training.step.objective import DEFAULT_LOSS, DEFAULT_METRICS, build_for_training
    from hvdtrain.training.step.schedule import make_optimizer, make_schedule
    from hvdtrain.training.step.core import StepMath, StepOptions
    from hvdtrain.training.step.for_run import wire_and_powersgd_rank
    from hvdtrain.collectives import init_collectives, place_devices

    collectives = init_collectives(prepare=place_devices)
    world = collectives.world
    model, (x, y) = synthetic_problem(args, world.rank)
    optimizer = make_optimizer(OptimConfig(warmup_epochs=0),
                               make_schedule(OptimConfig(warmup_epochs=0), world.size, 1, 1))
    if not args.zero_stage:     # sharded, the step builds it in pieces
        optimizer.build(model.trainable_variables)
    collectives.broadcast_variables(model.weights + optimizer.variables)
    batch = (x, y, tf.ones([args.batch_size]),
             tf.fill([args.batch_size], 1.0 / (args.batch_size * world.size)))
    model.compile(optimizer=optimizer, loss=DEFAULT_LOSS, metrics=list(DEFAULT_METRICS),
                  jit_compile=False)
    share = build_for_training(model, batch, args.model)
    wire, powersgd_rank = wire_and_powersgd_rank(args.compression, args.powersgd_rank,
                                                 world.size)
    step = StepMath(model, optimizer, collectives, share,
                    StepOptions(compression=wire,
                                global_batch=args.batch_size * world.size,
                                bucket_bytes=bucket_bytes(args.bucket_mib),
                                zero_stage=args.zero_stage,
                                in_issue_order=args.bucket_order == "issued",
                                powersgd_rank=powersgd_rank))
    step.bucket_candidates = measured_candidates(
        step.reduction, model.trainable_variables,
        args.bucket_choice == "measured" and world.size > 1 and args.loop != "exchange"
        and not args.zero_stage and step.powersgd is None)
    with step_installed(step), step.training():
        def traced() -> Any:
            return (_fit_step(step, batch) if args.loop == "fit" else
                    _exchange_step(step) if args.loop == "exchange" else
                    tf.function(step.train_step, jit_compile=False))

        run_step = (traced() if step.bucket_candidates is None else
                    _chosen(step, traced, batch))
        timing = time_steps(run_step, batch, args.warmup_steps, args.steps, args.repeats)
        if args.profile_dir:
            profile_steps(run_step, batch, args.steps, args.profile_dir / f"rank{world.rank}")
            if world.rank == 0:
                # The reader's check that no rank's profile is missing, the last one's included.
                args.profile_dir.mkdir(parents=True, exist_ok=True)
                (args.profile_dir / PROFILED_WORLD).write_text(
                    json.dumps({"ranks": world.size}) + "\n")
    rank_result = {"rank": world.rank, "step_seconds": timing.seconds,
                   "examples_per_second": args.batch_size / statistics.median(timing.seconds),
                   "host_cpu_busy": timing.host_cpu_busy}
    everyone = collectives.allgather_object(rank_result)
    medians = [statistics.median(r["step_seconds"]) for r in everyone]
    return world.is_chief, {
        "model": args.model, "loop": args.loop, "compression": args.compression,
        "bucket_mib": args.bucket_mib, "bucket_order": args.bucket_order,
        "bucket_choice": args.bucket_choice,
        "bucket_kept_mib": step.reduction.bucket_bytes / 2**20,
        "zero_stage": args.zero_stage,
        "world_size": world.size, "batch_size_per_rank": args.batch_size,
        "input_shape": list(x.shape[1:]),
        "parameters": sum(int(v.shape.num_elements()) for v in model.trainable_variables),
        "warmup_steps": args.warmup_steps, "steps": args.steps, "repeats": args.repeats,
        "step_seconds_median": max(medians),
        "step_seconds_spread": max(max(r["step_seconds"]) - min(r["step_seconds"])
                                   for r in everyone),
        "examples_per_second_total": args.batch_size * world.size / max(medians),
        # Rank 0's host's CPUs while the steps were timed: where ranks share a machine, what
        # its cores had left for communication to overlap with compute.
        "host_cpu_busy": timing.host_cpu_busy,
        "per_rank": everyone,
    }


def main(args: argparse.Namespace) -> int:
    is_chief, result = run(args)
    if is_chief:
        for each in result["per_rank"]:
            print(f"rank {each['rank']}: {each['examples_per_second']:,.1f} examples/s")
        print(f"{result['model']} ({result['loop']}), {result['world_size']} rank(s) x batch "
              f"{result['batch_size_per_rank']}: {result['examples_per_second_total']:,.1f} "
              f"examples/s in total; step {result['step_seconds_median'] * 1e3:.2f} ms median, "
              f"spread {result['step_seconds_spread'] * 1e3:.2f} ms over "
              f"{result['repeats']} repeats")
        if args.output:
            args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0
