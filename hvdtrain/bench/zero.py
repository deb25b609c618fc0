"""ZeRO's cost and savings on one machine (or across nodes): a model with Adam, trained by the
CLI at each ZeRO stage on each number of ranks; every rank's optimizer-state bytes, gradient
bytes kept and peak resident memory read from the run's ``summary.json``, the step time from
its last epoch. ``--memory-limit-mib`` then finds, for each stage, the widest model whose ranks
all train to the end (checkpoints and the final save included) within that much memory each (a
memory cgroup per rank; needs root and cgroup v1's memory controller), by bisection over
``--widths``.

Models: ``mlp`` (``--layers`` x ``--hidden`` units on ``--input`` inputs: one layer holds a
third of the weights) and ``residual`` (``hvdtrain.bench.plugin_models:residual_mlp``, 24
residual blocks ``--hidden`` wide: its largest layer is 1/48 of the whole, the model ZeRO stage 3
is for). A stage is 0-3, or ``3r``: stage 3 with Keras' rematerialisation of every layer
(``--remat full``).

    python -m hvdtrain.bench.zero --out runs/bench-zero
    python -m hvdtrain.bench.zero --ranks 2 --stages 0 2 --memory-limit-mib 1500
    python -m hvdtrain.bench.zero --model residual --ranks 4 --stages 0 2 3 3r \\
        --memory-limit-mib 2500 --widths 1024 1280 1536 1792 2048
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hvdtrain.bench.benchmark import count
from hvdtrain.bench.scaling import mpirun, parse_hosts
from hvdtrain.bench.variants import python, variant_env

CGROUPS = Path("/sys/fs/cgroup/memory")
CGROUP_PREFIX = "hvdtrain-bench-zero"
RESIDUAL = "hvdtrain.bench.plugin_models:residual_mlp"
CLASSES = 10                       # the synthetic dataset's default
PEAK_FILE = "whole-run-peak-rank{rank}.json"
TRACE_SECONDS = 0.5
TIMELINE = "timeline.json"
# The operations of a Horovod timeline that move data (each one's row also holds its
# negotiation and the MPI call inside it).
COLLECTIVES = ("ALLREDUCE", "ALLGATHER", "REDUCESCATTER", "BROADCAST")


@dataclass(frozen=True)
class Stage:
    """One column of the study: a ZeRO stage, with Keras' rematerialisation of every layer
    (``--remat full``, the mode that keeps least) or without."""

    zero: int
    remat: bool = False

    @property
    def label(self) -> str:
        return f"{self.zero}{'r' if self.remat else ''}"

    def arguments(self) -> list[str]:
        return ["--zero-stage", str(self.zero), *(["--remat", "full"] if self.remat else [])]


def stage(text: str) -> Stage:
    """An argparse type: ``0``-``3``, or ``3r`` for stage 3 with ``--remat full``."""
    zero = text.removesuffix("r")
    if zero not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"a ZeRO stage 0-3, with r for --remat full (e.g. "
                                         f"3r), got {text!r}")
    return Stage(int(zero), text.endswith("r"))


def threads_per_rank(ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks)


def model_arguments(args: argparse.Namespace, width: int) -> list[str]:
    if args.model == "mlp":
        return ["--model", "mlp", "--hidden-units", *[str(width)] * args.layers,
                "--synthetic-shape", str(args.input)]
    return ["--model", RESIDUAL, "--synthetic-shape", str(width)]


def parameters(args: argparse.Namespace, width: int) -> int:
    if args.model == "mlp":
        widths = [args.input, *[width] * args.layers, CLASSES]
        return sum(a * b + b for a, b in zip(widths, widths[1:]))
    from hvdtrain.bench.plugin_models import residual_mlp_parameters   # imports Keras

    return residual_mlp_parameters(width, CLASSES)


def describe(args: argparse.Namespace, width: int) -> str:
    shape = (f"MLP {args.layers} x {width}" if args.model == "mlp" else
             f"residual MLP 24 blocks x {width}")
    return f"{shape} ({parameters(args, width) / 1e6:.1f}M parameters)"


def train_arguments(args: argparse.Namespace, run_dir: Path, stage_: Stage, ranks: int,
                    width: int) -> list[str]:
    examples = args.batch_size * ranks * args.steps * 5 // 4   # a fifth held out
    return ["train", *model_arguments(args, width), "--dataset", "synthetic",
            "--synthetic-examples", str(examples), "--optimizer", "adam",
            "--learning-rate", "0.0001", "--warmup-epochs", "0", "--batch-size",
            str(args.batch_size), "--epochs", "2", *stage_.arguments(), "--run-dir",
            str(run_dir), "--backend", args.backend, "--no-progress", "--no-tensorboard",
            "--threads", str(threads_per_rank(ranks))]


def launch(args: argparse.Namespace, run_dir: Path, stage_: Stage, ranks: int, width: int,
           limit_mib: int | None = None) -> tuple[int, str]:
    """One run (each rank in a memory cgroup of ``limit_mib`` when given): (exit code, the end
    of its output). ``--hosts`` places the ranks on other nodes (one per slot)."""
    import subprocess

    program = ([python(), "-m", "hvdtrain"] if limit_mib is None else
               [python(), "-m", "hvdtrain.bench.zero", "--join-cgroup", str(limit_mib),
                str(run_dir), "--"])
    program += train_arguments(args, run_dir, stage_, ranks, width)
    hosts = argparse.Namespace(hosts=args.hosts or f"localhost:{ranks}", iface=args.iface,
                               ssh="ssh")
    command = ([*mpirun(hosts), "--command", " ".join(program)] if ranks > 1 else program)
    env = variant_env(threads_per_rank(ranks))
    if args.timeline and limit_mib is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        env["HOROVOD_TIMELINE"] = str(run_dir.resolve() / TIMELINE)
    result = subprocess.run(command, env=env,
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


def whole_run_peaks(run_dir: Path) -> list[float]:
    """Each rank's peak resident memory (MiB) over its whole process, the final save
    included, as its cgroup's parent read it when the rank ended (runs under a limit only)."""
    files = sorted(run_dir.glob(PEAK_FILE.format(rank="*")))
    return [json.loads(path.read_text())["peak_resident_mib"] for path in files]


def covered_ms(spans: list[tuple[float, float]]) -> float:
    """Milliseconds during which at least one of ``spans`` (microsecond begin, end) ran."""
    total, reach = 0.0, float("-inf")
    for begin, end in sorted(spans):
        total += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
    return total / 1e3


def collectives(run_dir: Path) -> dict[str, dict[str, float]]:
    """From a run's Horovod timeline (``--timeline``): per collective operation its calls, the
    milliseconds during which one ran (calls at once counted once) and the median call's (a
    whole run: the start's broadcast, every step, checkpoints and the end); empty without a
    timeline."""
    import statistics

    from hvdtrain.bench.comm import timeline_events, timeline_spans

    path = run_dir / TIMELINE
    if not path.exists():
        return {}
    spans: dict[str, list[tuple[float, float]]] = {}
    for span in timeline_spans(timeline_events(path)):
        if span.name in COLLECTIVES:
            spans.setdefault(span.name, []).append((span.begin, span.end))
    return {name: {"calls": len(ran), "running_ms": covered_ms(ran), "median_ms":
                   statistics.median(end - begin for begin, end in ran) / 1e3}
            for name, ran in spans.items()}


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
        "whole_run_peak_mib": whole_run_peaks(run_dir),
        "collectives": collectives(run_dir),
        "step_s": batch_size * ranks / rows[-1]["examples_per_second"],
    }


def table(results: dict[tuple[int, str], dict], rounds: int) -> str:
    lines = ["| ranks | stage | optimizer state / rank (MiB) | gradients kept / rank (MiB) | "
             "peak resident, rank 0 / others max (MiB) | step (s): median (rounds) | "
             "step vs stage 0 |", "|---|---|---|---|---|---|---|"]
    for (ranks, label), seen in sorted(results.items()):
        base = results.get((ranks, "0"))
        ratio = f"{seen['step_s'] / base['step_s']:.3f}" if base else "-"
        peaks = seen["peak_mib"]
        others = f"{max(peaks[1:]):.0f}" if len(peaks) > 1 else "-"
        each = ", ".join(f"{step:.3f}" for step in seen["rounds_s"])
        lines.append(f"| {ranks} | {label} | {max(seen['state_mib']):.1f} | "
                     f"{max(seen['gradient_mib']):.1f} | {peaks[0]:.0f} / {others} | "
                     f"{seen['step_s']:.3f} ({each}) | {ratio} |")
    lines.append(f"\nstep: median over {rounds} interleaved round(s) of the second epoch's "
                 "time per step")
    for (ranks, label), seen in sorted(results.items()):
        if seen["collectives"]:
            lines.append(f"{ranks} ranks, stage {label}, the first round's whole run: "
                         + "; ".join(collective_text(name, c)
                                     for name, c in sorted(seen["collectives"].items())))
    return "\n".join(lines)


def collective_text(name: str, seen: dict[str, float]) -> str:
    return (f"{name} {seen['calls']:,} calls, running {seen['running_ms']:,.0f} ms (median "
            f"{seen['median_ms']:.2f})")


def sweep(args: argparse.Namespace) -> dict[tuple[int, str], dict]:
    """Every stage on every number of ranks, ``--rounds`` times interleaved; medians."""
    import statistics

    runs: dict[tuple[int, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for ranks in args.ranks:
            for stage_ in args.stages:
                run_dir = args.out / f"np{ranks}-stage{stage_.label}-r{round_}"
                code, output = launch(args, run_dir, stage_, ranks, args.hidden)
                if code:
                    raise RuntimeError(f"{run_dir.name} failed:\n{output}")
                runs.setdefault((ranks, stage_.label), []).append(
                    measured(run_dir, ranks, args.batch_size))
                drop_large_files(run_dir)
    return {key: {**seen[0], "step_s": statistics.median(s["step_s"] for s in seen),
                  "rounds_s": [s["step_s"] for s in seen]} for key, seen in runs.items()}


def outcome(seen: dict) -> str:
    """One width's run under the limit, in words."""
    peak = f"peak {seen['peak_mib']:,.0f} MiB" if seen["peak_mib"] else "no peak"
    if seen["exit"] == 0:
        return f"trained ({peak})"
    return f"failed ({seen['exit']}, {peak}) after: {seen['last']}"


def widest(args: argparse.Namespace, stage_: Stage, ranks: int) -> tuple[int | None, dict]:
    """The widest ``--widths`` entry whose run trains to its end on ``ranks`` ranks at
    ``stage_`` with each rank held to ``--memory-limit-mib``, found by bisection (a wider model
    never needs less); and what each width tried did (exit code, the largest rank's peak
    resident memory over its whole run, the last log line)."""
    widths = sorted(args.widths)
    tried: dict[int, dict] = {}
    fits, fails = -1, len(widths)          # widths[fits] trained, widths[fails] did not
    while fails - fits > 1:
        middle = (fits + fails) // 2
        width = widths[middle]
        run_dir = args.out / f"limit-stage{stage_.label}-h{width}"
        code, _ = launch(args, run_dir, stage_, ranks, width, args.memory_limit_mib)
        peaks = whole_run_peaks(run_dir)
        tried[width] = {"exit": code, "peak_mib": max(peaks) if peaks else None,
                        "last": last_log_line(run_dir)}
        fits, fails = (middle, fails) if code == 0 else (fits, middle)
        print(f"stage {stage_.label}, {describe(args, width)}: {outcome(tried[width])}",
              flush=True)
        drop_large_files(run_dir)
    return (widths[fits] if fits >= 0 else None), dict(sorted(tried.items()))


def limit_table(args: argparse.Namespace, found: dict[str, tuple[int | None, dict]]) -> str:
    lines = ["| stage | widest that trains | parameters | vs stage 0 | peak resident, whole "
             "run, largest rank (MiB) | tried |", "|---|---|---|---|---|---|"]
    base = found.get("0", (None, {}))[0]
    for label, (best, tried) in found.items():
        size = parameters(args, best) if best else 0
        ratio = f"{size / parameters(args, base):.2f}x" if best and base else "-"
        peak = f"{tried[best]['peak_mib']:,.0f}" if best else "-"
        lines.append(f"| {label} | {best or 'none'} | {size / 1e6:.1f}M | {ratio} | {peak} | "
                     + "; ".join(f"{w}: {outcome(seen)}" for w, seen in tried.items()) + " |")
    return "\n".join(lines)


def resident_trace(child: int) -> tuple[list[tuple[float, int]], int, resource.struct_rusage]:
    """Wait for ``child``, reading its resident memory (MiB) every ``TRACE_SECONDS`` (what a
    run holds when: build, training, checkpoints, the final save); then (the trace, its wait
    status, its resource usage)."""
    start = time.time()
    trace = []
    while True:
        ended, status, usage = os.wait4(child, os.WNOHANG)
        if ended:
            return trace, status, usage
        try:
            with open(f"/proc/{child}/statm") as statm:
                pages = int(statm.read().split()[1])
            trace.append((round(time.time() - start, 1),
                          round(pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20)))
        except (OSError, ValueError, IndexError):
            pass
        time.sleep(TRACE_SECONDS)


def join_cgroup(limit_mib: int, run_dir: Path, command: list[str]) -> None:
    """In a rank: run ``python -m hvdtrain COMMAND`` in a new memory cgroup of ``limit_mib``
    (swap included where the kernel accounts it), killed if this process dies; when it ends,
    write its peak resident memory over its whole life (the kernel's account of the child,
    final save included, which the run's own summary, written before, cannot see; it counts
    shared libraries the cgroup may not), the cgroup's own peak charge (which counts the page
    cache of files the rank wrote) and a trace of its resident memory to ``run_dir``, and exit
    as it did. This process stays outside the cgroup."""
    import ctypes
    import signal

    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    group = CGROUPS / f"{CGROUP_PREFIX}-{rank}-{os.getpid()}"
    group.mkdir()
    limit = str(limit_mib * 2 ** 20)
    (group / "memory.limit_in_bytes").write_text(limit)
    if (group / "memory.memsw.limit_in_bytes").exists():
        (group / "memory.memsw.limit_in_bytes").write_text(limit)
    child = os.fork()
    if child == 0:
        (group / "cgroup.procs").write_text(str(os.getpid()))
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
        os.execv(python(), [python(), "-m", "hvdtrain", *command])
    trace, status, usage = resident_trace(child)
    code = os.waitstatus_to_exitcode(status)
    run_dir.mkdir(parents=True, exist_ok=True)
    charged = int((group / "memory.max_usage_in_bytes").read_text()) / 2 ** 20
    (run_dir / PEAK_FILE.format(rank=rank)).write_text(json.dumps(
        {"peak_resident_mib": usage.ru_maxrss / 1024, "charged_peak_mib": charged,
         "exit": code, "trace": trace}))
    sys.exit(code if code >= 0 else 128 - code)


def remove_cgroups() -> None:
    """The cgroups of finished ranks (empty once their processes ended)."""
    for group in CGROUPS.glob(f"{CGROUP_PREFIX}-*"):
        try:
            group.rmdir()
        except OSError:
            pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hvdtrain.bench.zero", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-zero"))
    parser.add_argument("--model", choices=("mlp", "residual"), default="mlp")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hosts", help="nodes and slots, as for mpirun -H (node1:1,node2:1): "
                                        "the ranks there instead of --ranks on this host")
    parser.add_argument("--iface", help="with --hosts: the network the ranks use")
    parser.add_argument("--stages", type=stage, nargs="+", default=[stage(s) for s in "012"])
    parser.add_argument("--backend", choices=("horovod", "tensorflow"), default="horovod")
    parser.add_argument("--hidden", type=int, default=5000, help="the sweep's width")
    parser.add_argument("--layers", type=int, default=3, help="mlp: hidden layers")
    parser.add_argument("--input", type=int, default=1024, help="mlp: inputs")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=count, default=8, help="steps per epoch")
    parser.add_argument("--rounds", type=count, default=1)
    parser.add_argument("--memory-limit-mib", type=int, default=None)
    parser.add_argument("--widths", type=int, nargs="+",
                        default=[2000, 3000, 4000, 5000, 6000, 7000, 8000])
    parser.add_argument("--timeline", action="store_true",
                        help="the sweep: record each run's Horovod timeline and count its "
                             "collectives")
    parser.add_argument("--timeout", type=int, default=1800)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--join-cgroup"]:
        join_cgroup(int(argv[1]), Path(argv[2]), argv[4:])
    args = build_parser().parse_args(argv)
    if args.hosts:
        args.ranks = [len(parse_hosts(args.hosts))]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    report: dict = {"parameters": parameters(args, args.hidden)}
    if args.memory_limit_mib is None:
        results = sweep(args)
        report["sweep"] = {f"np{r}-stage{s}": v for (r, s), v in results.items()}
        print(f"{describe(args, args.hidden)}, Adam, batch {args.batch_size} per rank, "
              f"{args.backend} backend{', hosts ' + args.hosts if args.hosts else ''}\n")
        print(table(results, args.rounds))
    else:
        ranks = args.ranks[0]
        found = {}
        try:
            for stage_ in args.stages:
                found[stage_.label] = widest(args, stage_, ranks)
                best, tried = found[stage_.label]
                report[f"stage{stage_.label}"] = {"widest": best, "tried": tried,
                                                  "parameters": best and parameters(args, best)}
        finally:
            remove_cgroups()
        print(f"\n{ranks} ranks, {args.memory_limit_mib} MiB per rank, {args.model}, batch "
              f"{args.batch_size} per rank, {args.steps} steps x 2 epochs\n")
        print(limit_table(args, found))
    report["seconds"] = time.time() - started
    (args.out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
