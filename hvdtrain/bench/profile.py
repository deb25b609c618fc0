"""TensorFlow profiler traces of a benchmark's ranks, read as the overlap tool's steps.

Horovod's timeline sees only Horovod's operations, so the TensorFlow backend's collectives
(TensorFlow's collective executor: ``CollectiveReduceV2`` and its kin) need another record:
``hvdtrain benchmark --profile-dir DIR`` records a few steps with TensorFlow's profiler, one
XPlane file per rank under ``DIR/rank<N>``, and this module reads them. Per collective and
step, in the overlap tool's terms (``TensorStep``, microseconds on the hosts' clocks):

- *submitted*: the first rank's kernel launch (``CollectiveOpV2Kernel::Run`` on the compute
  thread: its input existed and the executor got to it);
- *negotiated*: the last rank's launch (TensorFlow has no negotiation; from here every rank
  had the collective);
- *start* and *end*: the collective's run on the ``collective_ops`` threads, from the last
  rank's start (a rank that starts first waits inside it for the others, moving nothing) to
  the last rank's end.

The ranks' clocks are taken to agree: true for ranks on one machine (the netcluster's nodes);
across real hosts their skew enters every cross-rank figure.

Steps are told apart as in a Horovod timeline: the k-th run of every collective is step k.
A launch is not when its gradients were ready: collectives that share an ordering token run
in program order (the gradient buckets each have their own unless ``--bucket-order issued``:
``collectives.tf_ordering``), and the executor may queue a launch behind other ops. So the trace's
compute gives the backward pass's end (its last op under ``gradient_tape/``) and, per rank
and step, the time at least one TensorFlow op was running on a compute thread
(``compute_busy_ms``): how much of a step the model's own work took beside the collectives.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from hvdtrain.bench.benchmark import PROFILED_WORLD
from hvdtrain.bench.step_records import TensorStep, by_occurrence, covered

HOST_PLANE = "/host:CPU"
LAUNCH = "CollectiveOpV2Kernel::Run"
# tf.GradientTape.gradient names the backward pass's ops under this scope.
BACKWARD_SCOPE = "gradient_tape/"


@dataclass
class RankTrace:
    """One rank's collectives and compute, microseconds on its host's clock."""

    launches: dict[str, list[float]] = field(default_factory=dict)
    runs: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    compute: list[tuple[float, float]] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)     # the ends of gradient ops


def rank_files(directory: Path) -> list[Path]:
    """The newest XPlane file of each rank, from ``directory/rank0`` on: every rank of the
    profiled world (``world.json``, which ``hvdtrain benchmark`` writes; else up to the highest
    folder) must have one, or the merged steps would silently miss a rank."""
    folders = {int(path.name[4:]): path for path in directory.glob("rank*")
               if path.name[4:].isdigit()}
    world = directory / PROFILED_WORLD
    try:
        ranks = (int(json.loads(world.read_text())["ranks"]) if world.is_file()
                 else max(folders, default=-1) + 1)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{PROFILED_WORLD} holds no world size ({error!r}): record the "
                         "profiles again with hvdtrain benchmark --profile-dir") from error
    files = []
    for rank in range(ranks):
        found = sorted(folders[rank].rglob("*.xplane.pb"), key=lambda path: path.stat().st_mtime
                       ) if rank in folders else []
        if not found:
            raise ValueError(f"no TensorFlow profile of rank {rank} (rank{rank}/.../"
                             "*.xplane.pb) under it")
        files.append(found[-1])
    if not files:
        raise ValueError("no TensorFlow profile (rank*/.../*.xplane.pb) under it: record one "
                         "with hvdtrain benchmark --profile-dir")
    return files


def read_rank(path: Path) -> RankTrace:
    """The collectives and compute ops of one rank's XPlane file."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(path.read_bytes())
    planes = [plane for plane in space.planes if plane.name == HOST_PLANE]
    if not planes:
        raise ValueError(f"{path}: no {HOST_PLANE} plane")
    plane = planes[0]
    names = {key: meta.name for key, meta in plane.event_metadata.items()}
    stat_names = {key: meta.name for key, meta in plane.stat_metadata.items()}
    trace = RankTrace()
    for line in plane.lines:
        for event in line.events:
            name = names[event.metadata_id]
            begin = line.timestamp_ns / 1e3 + event.offset_ps / 1e6
            end = begin + event.duration_ps / 1e6
            op, _, op_type = name.partition(":")
            if name == LAUNCH:
                launched = [stat.str_value or stat_names.get(stat.ref_value, "")
                            for stat in event.stats if stat_names[stat.metadata_id] == "name"]
                if launched:      # a launch that names no op cannot be matched to its run
                    trace.launches.setdefault(launched[0], []).append(begin)
            elif line.name.startswith("collective_ops") and op_type.startswith("Collective"):
                trace.runs.setdefault(op, []).append((begin, end))
            elif (line.name.startswith("tf_Compute") and op_type and "::" not in name
                  and not op_type.startswith("Collective")):
                trace.compute.append((begin, end))
                if op.startswith(BACKWARD_SCOPE):
                    trace.backward.append(end)
    return trace


def collective_steps(traces: list[RankTrace]) -> list[list[TensorStep]]:
    """Every step's collectives, merged over the ranks (see the module doc)."""
    names = set().union(*(trace.launches for trace in traces))
    if not names:
        raise ValueError("the profile holds no TensorFlow collective (the Horovod backend's "
                         "allreduces are in its own timeline: HOROVOD_TIMELINE)")
    per_name: dict[str, list[TensorStep]] = {}
    for name in sorted(names):
        launches = [sorted(trace.launches.get(name, [])) for trace in traces]
        runs = [sorted(trace.runs.get(name, [])) for trace in traces]
        counts = {len(each) for each in launches + runs}
        if len(counts) != 1:
            raise ValueError(f"{name} was launched or run unequally often on the ranks "
                             f"({[len(each) for each in launches]} launches, "
                             f"{[len(each) for each in runs]} runs)")
        per_name[name] = [
            TensorStep(name, min(each[k] for each in launches),
                       max(each[k] for each in launches),
                       max(each[k][0] for each in runs), max(each[k][1] for each in runs), None)
            for k in range(counts.pop())]
    return by_occurrence(per_name)


def compute_busy_ms(traces: list[RankTrace], steps: list[list[TensorStep]]) -> list[float]:
    """Per rank, the median over steps 2.. of the time some op ran on its compute threads,
    from its own first submission of one step to its own of the next: a rank that runs
    behind the others (a loaded machine) is measured in its own steps, not in windows that
    the first rank's submissions open and close before its work."""
    if len(steps) < 2:
        return []
    busy = []
    for trace in traces:
        launches = {name: sorted(times) for name, times in trace.launches.items()}
        starts = [min(launches[tensor.name][index] for tensor in tensors)
                  for index, tensors in enumerate(steps)]
        busy.append(statistics.median(covered(trace.compute, begin, end) / 1e3
                                      for begin, end in zip(starts, starts[1:])))
    return busy


def backward_ends(traces: list[RankTrace], steps: list[list[TensorStep]]) -> list[float | None]:
    """Per step, when the last rank's backward pass ended (its last op under
    ``gradient_tape/``), None where no rank ran one. Each rank's window is its own: its step's
    backward pass lies after its previous step's last reduction (its update needs them) and
    before its own last one, so a rank that runs ahead is not credited with a slower rank's
    step, nor the reverse."""
    inside: list[list[float]] = [[] for _ in steps]
    stepped = {tensor.name for tensors in steps for tensor in tensors}
    for trace in traces:
        # Only the collectives the steps were read from: a run whose launch named no op
        # was never matched to a step.
        runs = [sorted(each) for name, each in trace.runs.items() if name in stepped]
        ends = [max(each[k][1] for each in runs) for k in range(len(steps))] if runs else []
        for index, end in enumerate(ends):
            begin = ends[index - 1] if index else float("-inf")
            inside[index] += [moment for moment in trace.backward if begin < moment <= end]
    return [max(moments) if moments else None for moments in inside]
