"""``python -m hvdtrain.bench.convergence``: what each ``--compression`` costs in accuracy.

The step-time tools show what a compression saves; only training shows what it costs, since
every compression is approximate (fp16 and bf16 round each rank's gradients, PowerSGD sends a
low-rank approximation of them). This trains one real task on N ranks once per compression and
seed, everything else equal and ``--deterministic``, reads each run's per-epoch metrics from its
run directory (``metrics.jsonl``) and writes ``convergence.json`` (every curve, each
variant's final values per seed and their mean, the mean's difference to float32's) and
``convergence.png`` (validation accuracy, training and validation loss per epoch: the mean of
the seeds, their range shaded).

A variant is a ``--compression`` name, or ``powersgd-rR`` for PowerSGD at rank R.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

from hvdtrain.bench.benchmark import count
from hvdtrain.bench.variants import MPIRUN_WRAPPER, run_checked
from hvdtrain.builtin_names import GRADIENT_COMPRESSIONS

# The task: the cnn on the built-in digits (8x8 images, 359 held out), a cosine schedule so
# each run ends at a small rate and its final accuracy is not one noisy step's.
TASK = ["--model", "cnn", "--dataset", "digits", "--lr-schedule", "cosine"]
CURVES = ("loss", "accuracy", "val_loss", "val_accuracy")
PANELS = (("val_accuracy", "validation accuracy"), ("loss", "training loss"),
          ("val_loss", "validation loss"))
BASELINE = "none"


def variant_flags(name: str) -> list[str]:
    """The ``train`` flags of a variant: ``none``, ``fp16``, ``bf16``, ``powersgd`` (the default
    rank) or ``powersgd-rR``."""
    compression, _, rank = name.partition("-r")
    ranked = compression == "powersgd" and rank.isdigit()
    if compression not in GRADIENT_COMPRESSIONS or (rank and not ranked):
        raise argparse.ArgumentTypeError(
            f"unknown variant {name}; choose from {', '.join(GRADIENT_COMPRESSIONS)} or "
            f"powersgd-rR (PowerSGD at rank R, e.g. powersgd-r4)")
    return ["--compression", compression, *(["--powersgd-rank", str(count(rank))] if rank
                                            else [])]


def read_curves(run_dir: Path) -> dict[str, list[float]]:
    """The per-epoch values of ``CURVES`` (and the epochs) from a run's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in
            (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {name: [row[name] for row in rows] for name in ("epoch", *CURVES)}


def summarize(curves: dict[str, dict[int, dict[str, list[float]]]]) -> dict[str, dict]:
    """Per variant: each curve's mean, min and max over the seeds per epoch; the final epoch's
    values per seed and their mean; and, for accuracies, the mean's difference to the
    ``BASELINE`` variant's (float32) in percentage points."""
    summary = {}
    for variant, seeds in curves.items():
        runs = list(seeds.values())
        bands = {name: {"mean": [statistics.fmean(values) for values in zip(*columns)],
                        "min": [min(values) for values in zip(*columns)],
                        "max": [max(values) for values in zip(*columns)]}
                 for name in CURVES for columns in [[run[name] for run in runs]]}
        final = {name: {"per_seed": {seed: run[name][-1] for seed, run in seeds.items()},
                        "mean": statistics.fmean(run[name][-1] for run in runs)}
                 for name in CURVES}
        summary[variant] = {"epochs": runs[0]["epoch"], "bands": bands, "final": final}
    if BASELINE in summary:
        base = summary[BASELINE]["final"]
        for entry in summary.values():
            for name in ("accuracy", "val_accuracy"):
                entry["final"][name]["points_vs_float32"] = 100 * (
                    entry["final"][name]["mean"] - base[name]["mean"])
    return summary


def plot(summary: dict[str, dict], output: Path, title: str) -> Path:
    """One panel per ``PANELS`` entry, one line per variant (mean of the seeds, range shaded)."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.8))
    for axis, (name, label) in zip(axes, PANELS):
        for variant, entry in summary.items():
            band = entry["bands"][name]
            line, = axis.plot(entry["epochs"], band["mean"], label=variant, linewidth=1.4)
            axis.fill_between(entry["epochs"], band["min"], band["max"],
                              color=line.get_color(), alpha=0.15)
        axis.set_title(label)
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        if name == "val_accuracy":   # the epochs that decide the comparison, not the first ones
            final = [entry["bands"][name]["min"][-1] for entry in summary.values()]
            axis.set_ylim(max(0.0, min(final) - 0.1), 1.0)
        else:
            axis.set_yscale("log")
    axes[0].legend(title="--compression")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return output


def train(variant: str, seed: int, args: argparse.Namespace, run_dir: Path) -> None:
    """One run on ``args.np`` ranks; fails with its log's end if it fails or if the ranks'
    weights were not identical at its end."""
    command = [str(MPIRUN_WRAPPER), "-np", str(args.np), "-H", args.hosts, "--", "train",
               *args.task, *variant_flags(variant), "--epochs", str(args.epochs), "--seed",
               str(seed), "--deterministic", "--no-tensorboard", "--no-progress",
               "--run-dir", str(run_dir)]
    print(f"{variant} seed {seed}: {shlex.join(command)}", flush=True)
    run_checked(command, dict(os.environ), args.timeout)
    if not json.loads((run_dir / "summary.json").read_text()).get("weights_identical"):
        raise RuntimeError(f"{variant} seed {seed}: the ranks' weights differ ({run_dir})")


def print_table(summary: dict[str, dict]) -> None:
    print("| --compression | final val accuracy: mean (per seed) | vs float32, points | "
          "final val loss: mean (per seed) | final training loss: mean |")
    print("|---|---|---|---|---|")
    for variant, entry in summary.items():
        final = entry["final"]
        accuracy, loss = final["val_accuracy"], final["val_loss"]
        seeds = ", ".join(f"{value:.4f}" for value in accuracy["per_seed"].values())
        losses = ", ".join(f"{value:.4f}" for value in loss["per_seed"].values())
        points = accuracy.get("points_vs_float32")
        print(f"| {variant} | {accuracy['mean']:.4f} ({seeds}) | "
              f"{'' if points is None else f'{points:+.2f}'} | {loss['mean']:.4f} ({losses}) | "
              f"{final['loss']['mean']:.4f} |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hvdtrain.bench.convergence",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["none", "fp16", "bf16", "powersgd"],
                        help="compressions to train with (powersgd-rR: PowerSGD at rank R; "
                             "default: none fp16 bf16 powersgd)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--epochs", type=count, default=20)
    parser.add_argument("--np", type=count, default=2, help="ranks (default: 2)")
    parser.add_argument("--hosts", default="localhost:2",
                        help="as for mpirun -H (default: localhost:2)")
    parser.add_argument("--reuse", action="store_true",
                        help="read a run whose run directory already holds its summary.json "
                             "instead of training it again (same options assumed)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--output-dir", type=Path, default=Path("bench-convergence"))
    parser.add_argument("task", nargs=argparse.REMAINDER,
                        help=f"after --: the train flags of the task, instead of "
                             f"{shlex.join(TASK)}")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.task = [flag for flag in args.task if flag != "--"] or TASK
    try:
        for variant in args.variants:
            variant_flags(variant)
    except argparse.ArgumentTypeError as error:
        print(f"hvdtrain: error: {error}", file=sys.stderr)
        return 2
    curves: dict[str, dict[int, dict[str, list[float]]]] = {}
    for variant in args.variants:
        curves[variant] = {}
        for seed in args.seeds:
            run_dir = (args.output_dir / f"{variant}-seed{seed}").resolve()
            if not (args.reuse and (run_dir / "summary.json").exists()):
                train(variant, seed, args, run_dir)
            curves[variant][seed] = read_curves(run_dir)
    summary = summarize(curves)
    title = (f"{shlex.join(args.task)}, {args.np} ranks, {args.epochs} epochs, seeds "
             f"{', '.join(map(str, args.seeds))}: mean, range shaded")
    report = {"task": args.task, "ranks": args.np, "epochs": args.epochs, "seeds": args.seeds,
              "runs": curves, "variants": summary}
    (args.output_dir / "convergence.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(summary, args.output_dir / "convergence.png", title)
    print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
