"""``python -m hvdtrain.bench.overlap``: do gradient allreduces start before the backward pass ends?

Read from a record of a real job, not claimed: it runs a short ``hvdtrain benchmark`` on
``--np`` ranks (arguments after ``--`` go to the benchmark) with ``HOROVOD_TIMELINE`` set, or on
the TensorFlow backend (``--backend tensorflow``) with a TensorFlow profile of every rank
(``hvdtrain.bench.profile``); or it reads an earlier benchmark's timeline (``--timeline``) or
profiles (``--profile``). The latest submission of a step is when the last gradient was ready
on some rank (from a profile: the backward pass's end); ``overlap_ms`` is how long reductions
ran before it (from a Horovod timeline an upper bound by at most one cycle). Writes
``overlap.json`` and ``overlap.png`` for one step (``--step``) and prints per-step phases,
including the time with no allreduce running."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from hvdtrain.bench.benchmark import count
from hvdtrain.bench.comm import GROUP_MEMBER, Span, row_names, timeline_events, timeline_spans
from hvdtrain.bench.profile import (backward_ends, collective_steps, compute_busy_ms, rank_files,
                                    read_rank)
from hvdtrain.bench.step_records import (TensorStep, by_occurrence, covered, first_submissions,
                                         last_ends)
from hvdtrain.bench.variants import MPIRUN_WRAPPER, python, run_checked, variant_env

# Short and cheap; what follows ``--`` on the command line comes later and wins. The buckets
# as given (--bucket-choice fixed): the timeline's steps then all send the gradients alike.
BENCHMARK_DEFAULTS = ["--model", "cnn", "--batch-size", "64", "--warmup-steps", "3",
                      "--steps", "5", "--repeats", "1", "--bucket-choice", "fixed"]


@dataclass(frozen=True)
class Call:
    """One allreduce call (a grouped allreduce: a bucket) in a step, ms from the step's first
    submission."""

    name: str
    tensors: int
    bytes: int | None
    submitted_ms: float    # its earliest tensor's
    negotiated_ms: float   # every rank had all of its tensors
    reduction_start_ms: float
    reduction_end_ms: float


def tensor_bytes(args: dict) -> int | None:
    """Bytes of the tensor an ``ALLREDUCE`` span's closing event describes (``dtype``
    ``float32``, ``shape`` ``[3, 3, 1, 64]``), None when it does not say."""
    if "dtype" not in args or "shape" not in args:
        return None
    width = re.search(r"\d+$", args["dtype"])            # bits; none in "bool", one byte
    return math.prod(json.loads(args["shape"])) * (int(width.group()) // 8 if width else 1)


def allreduce_steps(events: list[dict]) -> list[list[TensorStep]]:
    """Every step's allreduced tensors: the k-th negotiation and the k-th reduction of each
    tensor are its step k (``by_occurrence``)."""
    names = row_names(events)
    negotiations: dict[int, list[Span]] = {}
    reductions: dict[int, list[Span]] = {}
    for span in timeline_spans(events):
        if span.name == "NEGOTIATE_ALLREDUCE":
            negotiations.setdefault(span.pid, []).append(span)
        elif span.name == "ALLREDUCE":
            reductions.setdefault(span.pid, []).append(span)
    per_tensor: dict[str, list[TensorStep]] = {}
    for pid, spans in negotiations.items():
        reduced = reductions.get(pid, [])
        if len(reduced) != len(spans):
            raise ValueError(f"{names[pid]} was negotiated {len(spans)} times but reduced "
                             f"{len(reduced)} times (a job cut off mid-step?)")
        per_tensor[names[pid]] = [
            TensorStep(names[pid], negotiation.begin, negotiation.end, reduction.begin,
                       reduction.end, tensor_bytes(reduction.args))
            for negotiation, reduction in zip(spans, reduced)]
    return by_occurrence(per_tensor)


def calls_of(tensors: list[TensorStep], origin: float) -> list[Call]:
    """The step's allreduce calls, in order of submission: a grouped allreduce's tensors
    (one name with ``_<i>of<n>`` stripped) make one call; any other tensor is a call alone."""
    groups: dict[str, list[TensorStep]] = {}
    for tensor in tensors:
        groups.setdefault(GROUP_MEMBER.sub("", tensor.name), []).append(tensor)
    calls = []
    for name, members in groups.items():
        sizes = [member.bytes for member in members]
        calls.append(Call(
            name, len(members), None if None in sizes else sum(sizes),
            (min(m.submitted for m in members) - origin) / 1e3,
            (max(m.negotiated for m in members) - origin) / 1e3,
            (min(m.start for m in members) - origin) / 1e3,
            (max(m.end for m in members) - origin) / 1e3))
    return sorted(calls, key=lambda call: (call.submitted_ms, call.name))


def running_before(calls: list[Call], moment: float) -> float:
    """Milliseconds before ``moment`` during which at least one call was reducing (the union
    of their spans cut at ``moment``: calls Horovod fused count once)."""
    return covered([(call.reduction_start_ms, call.reduction_end_ms) for call in calls],
                   float("-inf"), moment)


def step_phases(steps: list[list[TensorStep]]) -> dict[str, float]:
    """Where steps spend their time, ms, each a median over every step after the first (taken
    separately, so the four need not come from one step): from the previous step's first
    submission to this one's (``step_ms``); from the previous step's last reduction end to this
    one's first submission, with nothing reducing (``idle_ms``: the update, the forward pass and
    the backward pass up to the first bucket, which no synchronous step can overlap with its
    own exchange); from this step's first reduction start to its last reduction end
    (``reducing_ms``); the sum over the step's calls of the time from a call's first
    submission on some rank to its submission on every rank (``waiting_ms``: what ranks that
    submit in different orders, or compute at different speeds, wait for each other). Empty
    for a timeline of one step."""
    if len(steps) < 2:
        return {}
    submitted, ended = first_submissions(steps), last_ends(steps)
    return {"step_ms": statistics.median((now - before) / 1e3
                                         for before, now in zip(submitted, submitted[1:])),
            "idle_ms": statistics.median((now - before) / 1e3
                                         for before, now in zip(ended, submitted[1:])),
            "reducing_ms": statistics.median((end - min(t.start for t in tensors)) / 1e3
                                             for tensors, end in zip(steps[1:], ended[1:])),
            "waiting_ms": statistics.median(sum(call.negotiated_ms - call.submitted_ms
                                                for call in calls_of(tensors, 0.0))
                                            for tensors in steps[1:])}


def analyse(timeline: Path, step: int = -1) -> dict:
    """The overlap report of one step (an index into the timeline's steps) of a Horovod
    timeline."""
    return report_of(allreduce_steps(timeline_events(timeline)), str(timeline), step)


def analyse_profile(directory: Path, step: int = -1) -> dict:
    """The overlap report of one step of the TensorFlow backend's collectives, from the
    TensorFlow profiles of ``hvdtrain benchmark --profile-dir`` (``profile``). A launch is not
    when the gradients were ready there, so the last gradient is the backward pass's end where
    the profile shows one (``last_gradient_from`` says which), and ``overlap_ms`` is counted
    before it; ``launched_after_backward_ms`` (median over steps 2..) is how long after it the
    first collective was launched, and each rank's compute-thread time per step stands beside."""
    traces = [read_rank(path) for path in rank_files(directory)]
    steps = collective_steps(traces)
    ends = backward_ends(traces, steps)
    chosen = ends[step_index(steps, step)]
    report = report_of(steps, str(directory), step, ready_us=chosen)
    delays = [(first - end) / 1e3 for first, end in zip(first_submissions(steps)[1:], ends[1:])
              if end is not None]
    source = ("the backward pass's end" if chosen is not None
              else "the last collective's first launch: no backward pass found")
    return {**report, "last_gradient_from": source,
            "compute_busy_ms": compute_busy_ms(traces, steps),
            "launched_after_backward_ms": statistics.median(delays) if delays else None}


def step_index(steps: list[list[TensorStep]], step: int) -> int:
    """``step`` (from 0; negative counts from the end) as an index into ``steps``, or the
    tool's one-line refusal."""
    if not -len(steps) <= step < len(steps):
        raise ValueError(f"no step {step}: the record holds {len(steps)}")
    return step % len(steps)


def report_of(steps: list[list[TensorStep]], source: str, step: int,
              ready_us: float | None = None) -> dict:
    """The report of ``steps[step]`` with every step's phases; ``ready_us``: when its last
    gradient was ready, where the record knows better than its latest submission."""
    index = step_index(steps, step)
    tensors = steps[index]
    origin = min(tensor.submitted for tensor in tensors)
    calls = calls_of(tensors, origin)
    ready = ((max(tensor.submitted for tensor in tensors) if ready_us is None else ready_us)
             - origin) / 1e3
    overlap = running_before(calls, ready)
    return {"timeline": source, "steps": len(steps), "step": index,
            "calls_per_step": [len(calls_of(each, 0.0)) for each in steps],
            "time_origin_us": origin, "last_gradient_ready_ms": ready,
            "overlap_ms": overlap, "overlaps": overlap > 0,
            "last_reduction_end_ms": max(call.reduction_end_ms for call in calls),
            "phases": step_phases(steps), "calls": [asdict(call) for call in calls]}


def summary(report: dict) -> str:
    calls = report["calls"]
    sizes = [call["bytes"] for call in calls]
    size = "" if None in sizes else f", {sum(sizes) / 2 ** 20:.2f} MiB"
    first = min(call["reduction_start_ms"] for call in calls)
    profiled = "last_gradient_from" in report     # ready: the slowest rank's backward end
    verdict = (f"so reductions ran for {report['overlap_ms']:.3f} ms while "
               f"{'some' if profiled else 'every'} rank was still in its backward pass"
               if report["overlaps"] else
               "so nothing was reduced before the backward pass had ended: no overlap")
    ready = (f"The first collective was launched at 0 ms and the last gradient was ready at "
             f"{report['last_gradient_ready_ms']:.3f} ms ({report['last_gradient_from']})"
             if profiled else "The first gradient was submitted at 0 ms and the last at "
             f"{report['last_gradient_ready_ms']:.3f} ms")
    return (f"Step {report['step'] + 1} of {report['steps']} ({report['timeline']}): "
            f"{len(calls)} allreduce call(s), {sum(call['tensors'] for call in calls)} "
            f"tensors{size}. {ready}; the first reduction started at "
            f"{first:.3f} ms and the last ended at {report['last_reduction_end_ms']:.3f} ms, "
            f"{verdict}." + phases_line(report["phases"], report["steps"])
            + compute_line(report))


def compute_line(report: dict) -> str:
    """The summary's sentences on a profile's backward pass and compute-thread time (none for
    a Horovod timeline)."""
    if not report.get("compute_busy_ms"):
        return ""
    delay = report.get("launched_after_backward_ms")
    launch = ("" if delay is None else
              f" The first collective was launched {delay:.1f} ms after the backward pass "
              "ended (median; negative: before).")
    return (launch + " Some TensorFlow op ran on the compute threads for "
            + ", ".join(f"{ms:.1f}" for ms in report["compute_busy_ms"])
            + " ms of a step (per rank, medians); the rest of the step they waited.")


def phases_line(phases: dict[str, float], steps: int) -> str:
    """The summary's sentence on ``step_phases`` (none for a timeline of one step)."""
    if not phases:
        return ""
    return (f" Over steps 2-{steps} (medians): a step took {phases['step_ms']:.1f} ms, "
            f"{phases['idle_ms']:.1f} ms of it with no allreduce running (the update, the forward "
            f"pass and the backward pass up to the first bucket), and its reductions spanned "
            f"{phases['reducing_ms']:.1f} ms; its calls waited {phases['waiting_ms']:.1f} ms in "
            f"all for every rank's submission.")


def draw(report: dict, path: Path) -> None:
    """Gantt chart of the step: per call, waiting (submitted to reduction start) and reducing
    (reduction start to end), and a line where the last gradient was ready."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    calls = report["calls"]
    figure, axis = plt.subplots(figsize=(11, 1.8 + 0.45 * len(calls)))
    for row, call in enumerate(calls):
        start, end = call["reduction_start_ms"], call["reduction_end_ms"]
        axis.barh(row, start - call["submitted_ms"], left=call["submitted_ms"], height=0.6,
                  color="0.8", label="submitted, negotiating" if row == 0 else None)
        axis.barh(row, end - start, left=start, height=0.6, color="tab:blue",
                  label="reducing (ALLREDUCE)" if row == 0 else None)
    axis.axvline(report["last_gradient_ready_ms"], color="tab:red", linestyle="--",
                 label=f"last gradient ({report.get('last_gradient_from', 'submitted')})")
    axis.set_yticks(range(len(calls)), [
        f"call {row + 1}: {call['tensors']} tensor(s)"
        + ("" if call["bytes"] is None else f", {call['bytes'] / 2 ** 20:.2f} MiB")
        for row, call in enumerate(calls)])
    axis.invert_yaxis()
    axis.set_xlabel("ms from the step's first submitted gradient")
    axis.set_title(f"step {report['step'] + 1} of {report['steps']}: "
                   + (f"reductions overlap the backward pass by {report['overlap_ms']:.2f} ms"
                      if report["overlaps"] else "no reduction starts before the last gradient"))
    axis.grid(axis="x", alpha=0.3)
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run_benchmark(record: Path, backend: str, ranks: int, benchmark_args: list[str],
                  output: Path) -> None:
    """``hvdtrain benchmark`` on ``ranks`` ranks of ``backend``, in the environment every
    harness variant gets, recording ``record``: Horovod's timeline, or for the TensorFlow
    backend a TensorFlow profile of every rank (a folder)."""
    env = {**variant_env(max(1, (os.cpu_count() or 1) // ranks)), "HVDTRAIN_PYTHON": python(),
           "HVDTRAIN_BACKEND": backend}
    if backend == "tensorflow":
        shutil.rmtree(record, ignore_errors=True)
        benchmark_args = [*benchmark_args, "--profile-dir", str(record.resolve())]
    else:
        record.unlink(missing_ok=True)
        env["HOROVOD_TIMELINE"] = str(record.resolve())
    run_checked([str(MPIRUN_WRAPPER), "-np", str(ranks), "--", "benchmark",
                 *BENCHMARK_DEFAULTS, *benchmark_args, "--output", str(output)], env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    own, forwarded = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="arguments after -- go to hvdtrain benchmark (defaults: "
               + " ".join(BENCHMARK_DEFAULTS) + ")")
    parser.add_argument("--np", type=count, default=2, help="ranks (default: 2)")
    parser.add_argument("--backend", choices=("horovod", "tensorflow"), default="horovod",
                        help="the benchmark's collectives: horovod (read from Horovod's "
                             "timeline) or tensorflow (from a TensorFlow profile of each rank)")
    parser.add_argument("--output-dir", type=Path, default=Path("overlap"))
    parser.add_argument("--step", type=int, default=-1,
                        help="which step to chart, from 0; negative counts from the end "
                             "(default: -1, the last)")
    records = parser.add_mutually_exclusive_group()
    records.add_argument("--timeline", type=Path,
                         help="read this Horovod timeline instead of running a benchmark")
    records.add_argument("--profile", type=Path,
                         help="read this folder of TensorFlow profiles (hvdtrain benchmark "
                              "--profile-dir) instead of running a benchmark")
    args = parser.parse_args(own)
    given = args.timeline or args.profile
    if given and forwarded:
        parser.error("arguments after -- are for a benchmark run, which --timeline and "
                     "--profile skip")
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    profiled = bool(args.profile) or (not given and args.backend == "tensorflow")
    record = given or out / ("profile" if profiled else "timeline.json")
    if not given:
        run_benchmark(record, args.backend, args.np, forwarded, out / "benchmark.json")
    try:
        report = (analyse_profile if profiled else analyse)(record, args.step)
    except ValueError as error:
        parser.error(f"{record}: {error}")
    (out / "overlap.json").write_text(json.dumps(report, indent=2) + "\n")
    draw(report, out / "overlap.png")
    print(summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
