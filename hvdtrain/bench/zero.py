"""ZeRO's cost and savings on one machine: an MLP of ``--hidden`` x ``--layers`` (55M parameters
by default) with Adam, trained by the CLI at each ZeRO stage on each number of ranks; every
rank's optimizer-state bytes, gradient bytes kept and peak resident memory read from the run's
``summary.json``, the step time from its last epoch. ``--memory-limit-mib`` then finds, for
stages 0 and 2, the widest model whose ranks all train within that much memory each (a memory
cgroup per rank; needs root and cgroup v1's memory controller).

    python -m hvdtrain.bench.zero --out runs/bench-zero
    python -m hvdtrain.bench.zero --ranks 2 --stages 0 2 --memory-limit-mib 1500
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from hvdtrain.bench.benchmark import count
from hvdtrain.bench.variants import MPIRUN_WRAPPER, python, variant_env

CGROUPS = Path("/sys/fs/cgroup/memory")
CGROUP_PREFIX = "hvdtrain-bench-zero"


def threads_per_rank(ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks)


def train_arguments(args: argparse.Namespace, run_dir: Path, stage: int, ranks: int,
                    hidden: int) -> list[str]:
    examples = args.batch_size * ranks * args.steps * 5 // 4   # a fifth held out
    return ["train", "--model", "mlp", "--hidden-units", *[str(hidden)] * args.layers,
            "--dataset", "synthetic", "--synthetic-shape", str(args.input),
            "--synthetic-examples", str(examples), "--optimizer", "adam",
            "--learning-rate", "0.0001", "--warmup-epochs", "0", "--batch-size",
            str(args.batch_size), "--epochs", "2", "--zero-stage", str(stage), "--run-dir",
            str(run_dir), "--backend", args.backend, "--no-progress", "--no-tensorboard",
            "--threads", str(threads_per_rank(ranks))]


def launch(args: argparse.Namespace, run_dir: Path, stage: int, ranks: int, hidden: int,
           limit_mib: int | None = None) -> tuple[int, str]:
    """One run (each rank in a memory cgroup of ``limit_mib`` when given): (exit code, the end
    of its output)."""
    import subprocess

    program = ([python(), "-m", "hvdtrain"] if limit_mib is None else
               [python(), "-m", "hvdtrain.bench.zero", "--join-cgroup", str(limit_mib), "--"])
    program += train_arguments(args, run_dir, stage, ranks, hidden)
    command = ([str(MPIRUN_WRAPPER), "-np", str(ranks), "-H", f"localhost:{ranks}",
                "--command", " ".join(program)] if ranks > 1 else program)
    result = subprocess.run(command, env=variant_env(threads_per_rank(ranks)),
                            text=True, capture_output=True, timeout=args.timeout,
                            stdin=subprocess.DEVNULL)
    return result.returncode, (result.stdout + result.stderr)[-2000:]


def drop_large_files(run_dir: Path) -> None:
    """A measured run's checkpoints and final model (GBs per run at these widths): the
    figures come from its ``summary.json`` and ``metrics.jsonl``, which stay."""
    import shutil

    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    for name in ("model.keras", "model.weights.h5"):
        (run_dir / name).unlink(missing_ok=True)


def last_log_line(run_dir: Path) -> str:
    """Where a run that failed had got to (the last line of rank 0's log)."""
    log = run_dir / "hvdtrain.log"
    lines = log.read_text().strip().splitlines() if log.exists() else []
    return lines[-1][:160] if lines else "no log"


def measured(run_dir: Path, ranks: int, batch_size: int) -> dict:
    """Per rank memory (MiB) and the last epoch's step time (s) of a finished run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mib = 2 ** 20
    memory = summary["memory"]
    return {
        "state_mib": [m["optimizer_state_bytes"] / mib for m in memory],
        "gradient_mib": [m["gradient_bytes"] / mib for m in memory],
        "peak_mib": [m["peak_resident_bytes"] / mib for m in memory],
        "step_s": batch_size * ranks / rows[-1]["examples_per_second"],
    }


def parameters(args: argparse.Namespace, hidden: int) -> int:
    widths = [args.input, *[hidden] * args.layers, 10]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def table(results: dict[tuple[int, int], dict], rounds: int) -> str:
    lines = ["| ranks | stage | optimizer state / rank (MiB) | gradients kept / rank (MiB) | "
             "peak resident, rank 0 / others max (MiB) | step (s) | step vs stage 0 |",
             "|---|---|---|---|---|---|---|"]
    for (ranks, stage), seen in sorted(results.items()):
        base = results.get((ranks, 0))
        ratio = f"{seen['step_s'] / base['step_s']:.3f}" if base else "-"
        peaks = seen["peak_mib"]
        others = f"{max(peaks[1:]):.0f}" if len(peaks) > 1 else "-"
        lines.append(f"| {ranks} | {stage} | {max(seen['state_mib']):.1f} | "
                     f"{max(seen['gradient_mib']):.1f} | {peaks[0]:.0f} / {others} | "
                     f"{seen['step_s']:.3f} | {ratio} |")
    lines.append(f"\nstep: median over {rounds} round(s) of the second epoch's time per step")
    return "\n".join(lines)


def sweep(args: argparse.Namespace) -> dict[tuple[int, int], dict]:
    """Every stage on every number of ranks, ``--rounds`` times interleaved; medians."""
    import statistics

    runs: dict[tuple[int, int], list[dict]] = {}
    for round_ in range(args.rounds):
        for ranks in args.ranks:
            for stage in args.stages:
                run_dir = args.out / f"np{ranks}-stage{stage}-r{round_}"
                code, output = launch(args, run_dir, stage, ranks, args.hidden)
                if code:
                    raise RuntimeError(f"{run_dir.name} failed:\n{output}")
                runs.setdefault((ranks, stage), []).append(
                    measured(run_dir, ranks, args.batch_size))
                drop_large_files(run_dir)
    return {key: {**seen[0], "step_s": statistics.median(s["step_s"] for s in seen)}
            for key, seen in runs.items()}


def widest(args: argparse.Namespace, stage: int, ranks: int) -> tuple[int | None, dict]:
    """The widest ``--widths`` entry whose run trains on ``ranks`` ranks at ``stage`` with
    each rank held to ``--memory-limit-mib``; and what each width did."""
    tried: dict = {}
    best = None
    for hidden in sorted(args.widths):
        run_dir = args.out / f"limit-stage{stage}-h{hidden}"
        code, output = launch(args, run_dir, stage, ranks, hidden, args.memory_limit_mib)
        if code != 0:
            tried[hidden] = f"failed ({code}) after: {last_log_line(run_dir)}"
            drop_large_files(run_dir)
            break
        peak = max(measured(run_dir, ranks, args.batch_size)["peak_mib"])
        tried[hidden] = f"trained (peak resident {peak:.0f} MiB)"
        drop_large_files(run_dir)
        best = hidden
    return best, tried


def join_cgroup(limit_mib: int, command: list[str]) -> None:
    """In a rank: move this process into a new memory cgroup of ``limit_mib`` (swap included
    where the kernel accounts it), then become ``python -m hvdtrain COMMAND``."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    group = CGROUPS / f"{CGROUP_PREFIX}-{rank}-{os.getpid()}"
    group.mkdir()
    limit = str(limit_mib * 2 ** 20)
    (group / "memory.limit_in_bytes").write_text(limit)
    if (group / "memory.memsw.limit_in_bytes").exists():
        (group / "memory.memsw.limit_in_bytes").write_text(limit)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    os.execv(python(), [python(), "-m", "hvdtrain", *command])


def remove_cgroups() -> None:
    """The cgroups of finished ranks (empty once their processes ended)."""
    for group in CGROUPS.glob(f"{CGROUP_PREFIX}-*"):
        try:
            group.rmdir()
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--join-cgroup"]:
        join_cgroup(int(argv[1]), argv[3:])
    parser = argparse.ArgumentParser(prog="python -m hvdtrain.bench.zero", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-zero"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--backend", choices=("horovod", "tensorflow"), default="horovod")
    parser.add_argument("--hidden", type=int, default=5000)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--input", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=count, default=8, help="steps per epoch")
    parser.add_argument("--rounds", type=count, default=1)
    parser.add_argument("--memory-limit-mib", type=int, default=None)
    parser.add_argument("--widths", type=int, nargs="+",
                        default=[2000, 3000, 4000, 5000, 6000, 7000, 8000])
    parser.add_argument("--timeout", type=int, default=1800)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    report = {"parameters": parameters(args, args.hidden)}
    if args.memory_limit_mib is None:
        results = sweep(args)
        report["sweep"] = {f"np{r}-stage{s}": v for (r, s), v in results.items()}
        print(f"MLP {args.layers} x {args.hidden} ({report['parameters'] / 1e6:.1f}M "
              f"parameters), Adam, batch {args.batch_size} per rank, {args.backend} "
              "backend\n")
        print(table(results, args.rounds))
    else:
        ranks = args.ranks[0]
        try:
            for stage in args.stages:
                best, tried = widest(args, stage, ranks)
                report[f"stage{stage}"] = {"widest": best, "tried": tried, "parameters":
                                           best and parameters(args, best)}
                shown = f"{best} ({parameters(args, best) / 1e6:.1f}M parameters)" if best \
                    else "none"
                print(f"stage {stage}, {ranks} ranks, {args.memory_limit_mib} MiB per rank: "
                      f"widest {shown}; {tried}")
        finally:
            remove_cgroups()
    report["seconds"] = time.time() - started
    (args.out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
