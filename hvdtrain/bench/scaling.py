"""``python -m hvdtrain.bench.scaling``: data parallelism across nodes, over their network.

On the nodes named by ``--hosts``, back to back with the same per-rank batch and threads: one
process alone, one process per rank computing at once with no communication (the concurrent
compute floor: on nodes that share a machine's cores, the one a step cannot beat), hvdtrain's
gradient exchange alone, ``hvdtrain benchmark`` (with each ``--bucket-mib``, ``--bucket-order
issued``, ``--compression fp16`` and ``bf16``, each ``--fusion-mib`` and hierarchical
allreduce), the minimal Horovod loop, ``MultiWorkerMirroredStrategy`` and the allreduce sweep.
Per variant: median step time, examples/second, the communication share of a step and the
exchange's bus bandwidth against ``--link-gbit``; writes ``scaling.json``. ``resnet50`` runs at
32x32x3: its full 94 MB gradient at a compute a CPU finishes in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

from hvdtrain.bench.benchmark import count, count_or_skip
from hvdtrain.bench.variants import (MPIRUN_WRAPPER, interop_threads, python, run_checked,
                                     run_concurrent_singles, run_multiworker, variant_env)

SHAPES = {"resnet50": [32, 32, 3]}


def parse_hosts(text: str) -> list[str]:
    """``node1:2,node2:2`` -> one entry per slot: [node1, node1, node2, node2]."""
    slots = []
    for item in text.split(","):
        host, _, count = item.partition(":")
        slots += [host] * int(count or 1)
    return slots


def variant_names(fusion_mib: list[float], bucket_mib: list[float]) -> list[str]:
    """Every variant, in the order they run (and are reported)."""
    return ["single", "concurrent", "exchange", "hvdtrain",
            *(f"hvdtrain-buckets-{mib:g}MiB" for mib in bucket_mib),
            "hvdtrain-issued-order", "hvdtrain-tensorflow", "hvdtrain-fp16", "hvdtrain-bf16",
            "hvdtrain-powersgd", "hvdtrain-hierarchical",
            "hvdtrain-zero-1", "hvdtrain-zero-2",
            *(f"hvdtrain-fusion-{mib:g}MiB" for mib in fusion_mib), "minimal", "multiworker"]


def hvdtrain_knobs(name: str) -> tuple[list[str], dict[str, str]]:
    """What an ``hvdtrain benchmark`` variant adds: (its arguments, its environment)."""
    if name == "exchange":
        return ["--loop", "exchange"], {}
    if name == "hvdtrain-tensorflow":   # the same step on TensorFlow's collectives
        return [], {"HVDTRAIN_BACKEND": "tensorflow"}
    if name == "hvdtrain-issued-order":
        return ["--bucket-order", "issued"], {}
    if name in ("hvdtrain-fp16", "hvdtrain-bf16", "hvdtrain-powersgd"):
        return ["--compression", name.removeprefix("hvdtrain-")], {}
    if name == "hvdtrain-hierarchical":
        return [], {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}
    if name.startswith("hvdtrain-zero-"):
        return ["--zero-stage", name.removeprefix("hvdtrain-zero-")], {}
    if name.startswith("hvdtrain-buckets-"):
        return ["--bucket-mib", name.removeprefix("hvdtrain-buckets-").removesuffix("MiB"),
                "--bucket-choice", "fixed"], {}
    if name.startswith("hvdtrain-fusion-"):
        mib = float(name.removeprefix("hvdtrain-fusion-").removesuffix("MiB"))
        return [], {"HOROVOD_FUSION_THRESHOLD": str(int(mib * 2 ** 20))}
    return [], {}


def run_variant(name: str, args: argparse.Namespace, model: str, output: Path) -> None:
    """Time one variant of one model; its result lands in ``output`` (JSON)."""
    timing = ["--model", model, "--batch-size", str(args.batch_size), "--warmup-steps",
              str(args.warmup_steps), "--steps", str(args.steps), "--repeats", str(args.repeats),
              *(["--input-shape", *map(str, SHAPES[model])] if model in SHAPES else [])]
    env = variant_env(args.threads, args.interop_threads)
    if name == "multiworker":
        run_multiworker(timing, parse_hosts(args.hosts), env, output, args.ssh, args.timeout)
        return
    if name == "concurrent":
        run_concurrent_singles(timing, parse_hosts(args.hosts), env, output, args.ssh,
                               args.timeout)
        return
    common = [*timing, "--output", str(output)]
    if name == "single":
        run_checked([python(), "-m", "hvdtrain", "benchmark", *common], env, args.timeout)
        return
    if name == "minimal":
        program = [python(), "-m", "hvdtrain.bench.baselines.minimal_horovod", *common]
    else:
        knobs, settings = hvdtrain_knobs(name)
        program = [python(), "-m", "hvdtrain", "benchmark", *common, *knobs]
        env.update(settings)
    run_checked([*mpirun(args), "--command", shlex.join(program)], env, args.timeout)


def mpirun(args: argparse.Namespace) -> list[str]:
    """``launch/mpirun.sh`` across the nodes (the environment's HOROVOD_* and TF_* travel)."""
    return [str(MPIRUN_WRAPPER), "-np", str(len(parse_hosts(args.hosts))),
            "-H", args.hosts, *(["--iface", args.iface] if args.iface else []),
            *(["--ssh", args.ssh] if args.ssh != "ssh" else [])]


def summarize(results: dict[str, dict[str, list[dict]]], ranks: int,
              link_gbit: float | None) -> list[dict]:
    """One row per model and variant, medians over rounds. The floor is the concurrent one
    where it was measured (one process alone otherwise). A training variant's exchange time is
    its step minus the floor; the ``exchange`` variant's is its whole step (no compute). With
    both measured, every training variant also gets ``step_over_bound``: its step over
    max(floor, exchange alone), 1.0 when communication hides entirely behind compute or the
    other way round."""
    rows = []
    link_gbytes = link_gbit / 8 if link_gbit else None
    for model, variants in results.items():
        floor = statistics.median(r["step_seconds_median"]
                                  for r in variants.get("concurrent") or variants["single"])
        parameters = variants["single"][0]["parameters"]
        alone = (statistics.median(r["step_seconds_median"] for r in variants["exchange"])
                 if "exchange" in variants else None)
        for name, rounds in variants.items():
            step = statistics.median(r["step_seconds_median"] for r in rounds)
            row = {"model": model, "variant": name, "parameters": parameters,
                   "step_seconds": step, "examples_per_second":
                   statistics.median(r["examples_per_second_total"] for r in rounds)}
            busy = [r["host_cpu_busy"] for r in rounds if r.get("host_cpu_busy") is not None]
            if busy:
                row["host_cpu_busy"] = statistics.median(busy)
            if name not in ("single", "concurrent"):
                # (PowerSGD's bytes depend on each layer's shape: its bandwidth is not shown)
                wire_bytes = (parameters * (2 if name in ("hvdtrain-fp16", "hvdtrain-bf16")
                                            else 4)
                              if name != "hvdtrain-powersgd" else 0)
                exchange = step if name == "exchange" else step - floor
                if name != "exchange":
                    row["communication_share"] = max(0.0, exchange / step)
                    if alone is not None:
                        row["step_over_bound"] = step / max(floor, alone)
                row["bus_gbytes_per_second"] = (2 * (ranks - 1) / ranks * wire_bytes / exchange
                                                / 1e9 if exchange > 0 and wire_bytes else None)
                if link_gbytes and row["bus_gbytes_per_second"] is not None:
                    row["fraction_of_link"] = row["bus_gbytes_per_second"] / link_gbytes
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| model | variant | step ms | examples/s | communication share | bus GB/s "
          "(of link) | step / max(floor, exchange) | first node's CPUs busy |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        share = (f"{row['communication_share']:.0%}" if "communication_share" in row else "")
        bus = row.get("bus_gbytes_per_second")
        bus_text = "" if bus is None else f"{bus:.3f}"
        if "fraction_of_link" in row:
            bus_text += f" ({row['fraction_of_link']:.0%})"
        bound = f"{row['step_over_bound']:.2f}" if "step_over_bound" in row else ""
        busy = f"{row['host_cpu_busy']:.0%}" if "host_cpu_busy" in row else ""
        print(f"| {row['model']} | {row['variant']} | {row['step_seconds'] * 1e3:,.0f} | "
              f"{row['examples_per_second']:,.1f} | {share} | {bus_text} | {bound} | {busy} |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hvdtrain.bench.scaling",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", required=True,
                        help="nodes and slots, as for mpirun -H: node1:1,node2:1")
    parser.add_argument("--iface", help="the network the ranks use (name or subnet)")
    parser.add_argument("--ssh", default="ssh", help="how to reach the nodes (default: ssh)")
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet50"])
    parser.add_argument("--variants", nargs="+", help="a subset of the variants (default: all)")
    parser.add_argument("--fusion-mib", type=float, nargs="*", default=[0.0, 8.0],
                        help="tensor fusion thresholds to try (MiB; default: 0 8)")
    parser.add_argument("--bucket-mib", type=float, nargs="*", default=[0.0],
                        help="gradient bucket sizes to try beside the default (MiB; 0: one "
                             "allreduce after the backward pass; default: 0)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank (default: 32)")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--steps", type=count, default=10)
    parser.add_argument("--repeats", type=count, default=3)
    parser.add_argument("--rounds", type=count, default=1,
                        help="run every variant this many times, interleaved (median reported)")
    parser.add_argument("--threads", type=count, default=max(1, (os.cpu_count() or 1) // 2),
                        help="CPU threads per process (default: half this node's cores)")
    parser.add_argument("--interop-threads", type=count,
                        help="TensorFlow inter-op threads per process, every variant (default: "
                             "min(2, --threads), as hvdtrain's own default)")
    parser.add_argument("--link-gbit", type=float,
                        help="each node's link in Gbit/s, to report bandwidth as its fraction")
    parser.add_argument("--comm-repeats", type=count_or_skip, default=3,
                        help="repeats of the allreduce sweep across the nodes (0: skip it)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per variant")
    parser.add_argument("--output-dir", type=Path, default=Path("bench-scaling"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = variant_names(args.fusion_mib, args.bucket_mib)
    chosen = ["single", *(args.variants or names)]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        print(f"hvdtrain: error: unknown variant {', '.join(unknown)}; choose from "
              f"{', '.join(names)}", file=sys.stderr)
        return 2
    chosen = [name for name in names if name in chosen]
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[dict]]] = {}
    for model in args.models:
        results[model] = {name: [] for name in chosen}
        for round_ in range(1, args.rounds + 1):
            for name in chosen:
                output = out / f"{model}-{name}-{round_}.json"
                print(f"{model}: {name} (round {round_})", flush=True)
                run_variant(name, args, model, output)
                results[model][name].append(json.loads(output.read_text()))
    ranks = len(parse_hosts(args.hosts))
    report = {"hosts": args.hosts, "ranks": ranks, "threads_per_process": args.threads,
              "interop_threads": interop_threads(args.threads, args.interop_threads),
              "batch_size_per_rank": args.batch_size, "link_gbit": args.link_gbit,
              "rows": summarize(results, ranks, args.link_gbit)}
    if args.comm_repeats:
        sweep = out / "allreduce.json"
        run_checked([*mpirun(args), "--command", shlex.join(
            [python(), "-m", "hvdtrain.bench.comm", "--repeats", str(args.comm_repeats),
             "--output", str(sweep)])], variant_env(args.threads, args.interop_threads),
                    args.timeout)
        report["allreduce"] = json.loads(sweep.read_text())
    (out / "scaling.json").write_text(json.dumps(report, indent=2) + "\n")
    print_table(report["rows"])
    for row in report.get("allreduce", []):
        print(f"allreduce {row['bytes'] / 2 ** 20:g} MiB: bus {row['hvdtrain_bus_gbps']:.3f} "
              f"GB/s (hvdtrain), {row['mpi_bus_gbps']:.3f} GB/s (MPI)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
