"""``python -m hvdtrain.bench.compare``: hvdtrain against its alternatives, back to back, as ratios.

On one machine, with the same model, per-rank batch, world size and CPU threads per rank:
hvdtrain's custom loop and ``fit`` path, the minimal hand-written Horovod loop (the floor),
``MultiWorkerMirroredStrategy``, one process alone, the concurrent compute floor (one world-of-one
``hvdtrain benchmark`` per rank, all at once: the step with no communication, computed while the
other ranks compute), the allreduce sweep (``bench.comm``, on each backend), the input pipeline
alone and the startup time. Writes ``compare.json`` and
``compare.png`` to ``--output-dir`` and prints the table of ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from hvdtrain.bench.benchmark import count, count_or_skip
from hvdtrain.bench.variants import (MPIRUN_WRAPPER, python, run_checked, run_concurrent_singles,
                                     run_multiworker, variant_env)


def launcher(name: str, np: int) -> Callable[[list[str]], list[str]]:
    """The command that runs a program on ``np`` ranks: ``horovodrun`` (the README's), or
    ``mpirun`` (launch/mpirun.sh: no Horovod build check before every job, seconds each on 2
    cores; the wrapper splits the program at spaces)."""
    if name == "horovodrun":
        return lambda program: [str(Path(python()).with_name("horovodrun")), "-np", str(np),
                                *program]
    return lambda program: [str(MPIRUN_WRAPPER), "-np", str(np), "--command", " ".join(program)]


def launch_to_first_step(ranks: Callable[[list[str]], list[str]], env: dict[str, str],
                         out: Path) -> dict:
    """Time the default job from its launch command to the end of its first training step."""
    run_dir = out / "startup-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    launched = time.time()
    run_checked(ranks([python(), "-m", "hvdtrain", "--epochs", "1", "--run-dir",
                       str(run_dir)]), env)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"launch_to_first_step_seconds": summary["first_step_unix_time"] - launched,
            "process_start_to_first_step_seconds": summary["first_step_seconds"],
            "setup_seconds": summary["setup_seconds"]}


def input_pipeline_sweep(batch: int, steps: int = 200) -> list[dict]:
    """Data-only examples/second of every built-in in-memory source and of TFRecord."""
    import numpy as np

    from hvdtrain.config import DataConfig
    from hvdtrain.data.convert import convert
    from hvdtrain.data.pipeline import ShardSpec
    from hvdtrain.data.load import load_source
    from hvdtrain.collectives import World

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        x = (rng.random((4096, 28, 28, 1)) * 255).astype(np.uint8)
        np.savez(Path(tmp) / "d.npz", x=x, y=rng.integers(0, 10, 4096), x_val=x[:64],
                 y_val=np.zeros(64, int))
        convert(Path(tmp) / "d.npz", Path(tmp) / "rec", shards=4)
        sources = {
            "digits": DataConfig(),
            "synthetic": DataConfig(dataset="synthetic", synthetic_shape=[28, 28, 1]),
            "npz": DataConfig(dataset="npz", data_path=str(Path(tmp) / "d.npz")),
            "tfrecord": DataConfig(dataset="tfrecord", data_path=str(Path(tmp) / "rec/train-*"),
                                   val_data_path=str(Path(tmp) / "rec/validation-*")),
        }
        for name, config in sources.items():
            split = load_source(config, 0).train
            spec = ShardSpec(split.num_examples, World(), batch)
            dataset = split.dataset(spec, 0, 10_000).take(steps)
            for _ in dataset.take(5):
                pass
            started = time.perf_counter()
            count = sum(int(b[0].shape[0]) for b in dataset)
            rows.append({"source": name,
                         "examples_per_second": count / (time.perf_counter() - started)})
    return rows


def multi_rank_env(args: argparse.Namespace) -> dict[str, str]:
    """Every multi-rank variant's environment: each rank's share of the cores, as hvdtrain's
    own ranks take it on one node."""
    from hvdtrain.collectives.world import cpu_threads_per_rank

    cores = os.cpu_count() or 1
    return variant_env(cpu_threads_per_rank(args.np, cores, cores), args.interop_threads)


def single_env() -> dict[str, str]:
    """The one-process baseline's: every core."""
    return variant_env(os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--np", type=count, default=2, help="ranks / workers")
    parser.add_argument("--steps", type=count, default=30)
    parser.add_argument("--repeats", type=count, default=5)
    parser.add_argument("--rounds", type=count, default=1,
                        help="run every training variant this many times, interleaved; "
                             "report the median over rounds")
    parser.add_argument("--comm-repeats", type=count_or_skip, default=20,
                        help="calls per size of the allreduce sweep on each backend (0: skip "
                             "it)")
    parser.add_argument("--interop-threads", type=count, metavar="N",
                        help="TensorFlow inter-op threads of every multi-rank variant "
                             "(default: min(2, intra-op threads), hvdtrain's own default)")
    parser.add_argument("--output-dir", type=Path, default=Path("bench"))
    parser.add_argument("--launcher", choices=("horovodrun", "mpirun"), default="horovodrun",
                        help="how the multi-rank variants start (mpirun: launch/mpirun.sh)")
    args = parser.parse_args(argv)
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    env = multi_rank_env(args)
    threads = int(env["TF_NUM_INTRAOP_THREADS"])
    common = ["--model", args.model, "--batch-size", str(args.batch_size), "--steps",
              str(args.steps), "--repeats", str(args.repeats)]
    ranks = launcher(args.launcher, args.np)
    print(f"comparing on {args.np} rank(s) x batch {args.batch_size}, {threads} thread(s) "
          f"each ({env['TF_NUM_INTEROP_THREADS']} inter-op), model {args.model}", flush=True)
    for round_ in range(1, args.rounds + 1):
        # Every variant once per round, in the same order: a slow spell of the machine hits
        # all of them alike, and the median over rounds discards it.
        for loop in ("custom", "fit"):
            run_checked(ranks([python(), "-m", "hvdtrain", "benchmark", *common, "--loop", loop,
                               "--output", str(out / f"hvdtrain-{loop}-{round_}.json")]), env)
        # The same step on TensorFlow's collectives (--backend tensorflow), no Horovod.
        run_checked(ranks([python(), "-m", "hvdtrain", "benchmark", *common, "--loop", "custom",
                           "--output", str(out / f"hvdtrain-tensorflow-{round_}.json")]),
                    {**env, "HVDTRAIN_BACKEND": "tensorflow"})
        run_checked(ranks([python(), "-m", "hvdtrain.bench.baselines.minimal_horovod", *common,
                           "--output", str(out / f"minimal-{round_}.json")]), env)
        run_multiworker(common, ["localhost"] * args.np, env, out / f"multiworker-{round_}.json")
        run_concurrent_singles(common, ["localhost"] * args.np, env,
                               out / f"concurrent-{round_}.json")
        run_checked([python(), "-m", "hvdtrain", "benchmark", *common, "--output",
                     str(out / f"single-{round_}.json")], single_env())
    for backend in ("horovod", "tensorflow") if args.comm_repeats else ():
        run_checked([str(MPIRUN_WRAPPER), "-np", str(args.np), "--command",
                     f"{python()} -m hvdtrain.bench.comm --repeats {args.comm_repeats} "
                     f"--backend {backend} --output {out / f'comm-{backend}.json'}"], env)
    startup = launch_to_first_step(ranks, env, out)
    report = summarize(out, args, input_pipeline_sweep(args.batch_size), startup)
    (out / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    draw(report, out / "compare.png")
    print_table(report)
    return 0


def summarize(out: Path, args: argparse.Namespace, pipeline: list[dict],
              startup: dict) -> dict:
    def load(name: str):
        return json.loads((out / f"{name}.json").read_text())

    def over_rounds(name: str, field: str) -> float:
        return statistics.median(load(f"{name}-{round_}")[field]
                                 for round_ in range(1, args.rounds + 1))

    pools = {variant: {"intra_op": int(env["TF_NUM_INTRAOP_THREADS"]),
                       "inter_op": int(env["TF_NUM_INTEROP_THREADS"])}
             for variant, env in (("multi_rank", multi_rank_env(args)), ("single", single_env()))}
    names = ("hvdtrain-custom", "hvdtrain-fit", "hvdtrain-tensorflow", "minimal", "multiworker",
             "single", "concurrent")
    step = {name: over_rounds(name, "step_seconds_median") for name in names}
    rate = {name: over_rounds(name, "examples_per_second_total") for name in names}
    training_rate = rate["hvdtrain-custom"] / args.np     # per rank, what the input must feed
    return {
        "machine": {"cpus": os.cpu_count(), "np": args.np, "launcher": args.launcher,
                    "threads": pools},
        "rounds": args.rounds,
        "config": {"model": args.model, "batch_size_per_rank": args.batch_size},
        "examples_per_second": rate,
        "step_seconds_median": step,
        "ratios": {
            "custom_step_vs_minimal": step["hvdtrain-custom"] / step["minimal"],
            "fit_step_vs_minimal": step["hvdtrain-fit"] / step["minimal"],
            "custom_throughput_vs_multiworker": rate["hvdtrain-custom"] / rate["multiworker"],
            "fit_throughput_vs_multiworker": rate["hvdtrain-fit"] / rate["multiworker"],
            "tensorflow_backend_throughput_vs_multiworker":
                rate["hvdtrain-tensorflow"] / rate["multiworker"],
            "tensorflow_backend_throughput_vs_horovod_backend":
                rate["hvdtrain-tensorflow"] / rate["hvdtrain-custom"],
            "scaling_efficiency": rate["hvdtrain-custom"] / (args.np * rate["single"]),
            # What the exchange and the ranks' coordination add to hvdtrain's step, and the
            # most any exact variant of that step could gain on MultiWorkerMirroredStrategy:
            # its ranks computing with nothing to exchange (a synchronous step waits for the
            # slowest rank, so the floor's step, not its summed rate).
            "custom_step_vs_concurrent_floor": step["hvdtrain-custom"] / step["concurrent"],
            "concurrent_floor_throughput_vs_multiworker":
                step["multiworker"] / step["concurrent"],
        },
        "allreduce": load("comm-horovod") if args.comm_repeats else [],
        "allreduce_tensorflow_backend": load("comm-tensorflow") if args.comm_repeats else [],
        "input_pipeline": [{**row, "ratio_to_training": row["examples_per_second"]
                            / training_rate} for row in pipeline],
        "startup": startup,
    }


def print_table(report: dict) -> None:
    for name, value in report["ratios"].items():
        print(f"{name:36s} {value:6.3f}")
    for row, other in zip(report["allreduce"], report["allreduce_tensorflow_backend"]):
        print(f"allreduce {row['bytes'] / 1024:>8,.0f} KiB  hvdtrain/MPI {row['ratio']:.3f} "
              f"(call floor {row['call_seconds'] / row['mpi_seconds']:.3f}, bare Horovod "
              f"{row['horovod_seconds'] / row['mpi_seconds']:.3f}; TensorFlow backend "
              f"{other['ratio']:.3f})")
    for row in report["input_pipeline"]:
        print(f"input {row['source']:10s} {row['examples_per_second']:>12,.0f} ex/s  "
              f"{row['ratio_to_training']:.1f}x training")
    startup = report["startup"]
    print(f"startup: launch to end of first training step "
          f"{startup['launch_to_first_step_seconds']:.1f} s "
          f"(process start to first step {startup['process_start_to_first_step_seconds']:.1f} s, "
          f"of which setup {startup['setup_seconds']:.1f} s)")


def draw(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    names = list(report["examples_per_second"])
    left.bar(names, [report["examples_per_second"][n] for n in names])
    left.set_title("training throughput")
    left.set_ylabel("examples / second (all ranks)")
    left.tick_params(axis="x", rotation=30)
    sizes = [row["bytes"] / 2 ** 20 for row in report["allreduce"]]
    middle.semilogx(sizes, [row["mpi_bus_gbps"] for row in report["allreduce"]], "o-",
                    label="mpi4py Allreduce")
    middle.semilogx(sizes, [row["hvdtrain_bus_gbps"] for row in report["allreduce"]], "o-",
                    label="hvdtrain (Horovod)")
    middle.semilogx(sizes, [row["hvdtrain_bus_gbps"]
                            for row in report["allreduce_tensorflow_backend"]], "o-",
                    label="hvdtrain (TensorFlow backend)")
    middle.set_title("allreduce bus bandwidth" if sizes else
                     "allreduce bus bandwidth: sweep skipped (--comm-repeats 0)")
    middle.set_xlabel("message (MiB)")
    middle.set_ylabel("GB/s")
    if sizes:
        middle.legend()
    sources = [row["source"] for row in report["input_pipeline"]]
    right.bar(sources, [row["ratio_to_training"] for row in report["input_pipeline"]])
    right.axhline(5, color="red", linestyle="--", label="target 5x")
    right.set_title("input pipeline / training rate")
    right.set_ylabel("ratio")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
