"""Allreduce sweep: hvdtrain's gradient path (inside a ``tf.function``) against mpi4py's
``MPI.Allreduce`` on the same ranks, 4 KB to 64 MB of float32, with what lies between them.

Run under a launcher with the MPI controller: ``launch/mpirun.sh -np 2 --command "python -m
hvdtrain.bench.comm --output comm.json"``. MPI is timed first, before Horovod starts, since
Horovod's polling thread would slow a raw MPI call beside it. Then, per size, the median time
of: the same ``tf.function`` call with no collective in it (``call_seconds``: what any
collective run from TensorFlow pays, the floor below which no TensorFlow path can go), Horovod's
own ``hvd.allreduce`` in that function (``horovod_seconds``: what a bare Horovod script pays) and
hvdtrain's gradient reduction (``hvdtrain_seconds``). ``--backend tensorflow`` times hvdtrain on
TensorFlow's collectives instead (no Horovod in the process). Reports bus bandwidth and the
ratio hvdtrain / MPI. ``--breakdown tl.json`` reads a Horovod timeline of the sweep
(``HOROVOD_TIMELINE=tl.json``) and prints where Horovod's time goes: negotiation, the
``MPI_Allreduce`` itself, and the gap between calls.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hvdtrain.bench.benchmark import count

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
# Horovod's timeline name for the i-th of a grouped allreduce's n tensors: ``<op name>_<i>of<n>``
# (hvdtrain's gradient reduction is a grouped allreduce; bare ``hvd.allreduce`` is not).
GROUP_MEMBER = re.compile(r"_\d+of\d+$")


def _timed(run: Callable[[], object], repeats: int) -> float:
    run()                                                  # warm-up (and tracing)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def mpi_sweep(comm, repeats: int) -> list[float]:
    """Median seconds of ``MPI.Allreduce`` (sum, out of place) for each size."""
    import numpy as np
    from mpi4py import MPI

    seconds = []
    for nbytes in SIZES:
        send = np.ones(nbytes // 4, np.float32)
        receive = np.empty_like(send)
        comm.Barrier()
        seconds.append(_timed(lambda: comm.Allreduce(send, receive, op=MPI.SUM), repeats))
    return seconds


def function_sweep(reduce, repeats: int) -> list[float]:
    """Median seconds of ``reduce`` (one float32 tensor in, one out) run as a ``tf.function``
    for each size; eager execution returns once it has completed on this rank."""
    import tensorflow as tf

    function = tf.function(reduce)
    seconds = []
    for nbytes in SIZES:
        tensor = tf.ones([nbytes // 4], tf.float32)
        seconds.append(_timed(lambda: function(tensor), repeats))
    return seconds


def no_collective(tensor):
    """The call floor: the function returns its input (``tf.identity``), no collective."""
    import tensorflow as tf

    return tf.identity(tensor)


def sweep(repeats: int, backend: str = "horovod") -> list[dict]:
    from hvdtrain.launchers import apply_runtime_defaults

    apply_runtime_defaults(gpus_visible=False)
    from mpi4py import MPI                                 # MPI_Init, thread level multiple

    comm = MPI.COMM_WORLD
    timed = {"mpi_seconds": mpi_sweep(comm, repeats)}
    collectives: Any
    if backend == "tensorflow":
        from hvdtrain.collectives.tensorflow_backend import tensorflow_collectives

        collectives = tensorflow_collectives()             # before any tensor exists
    else:
        from hvdtrain.collectives.horovod_backend import HorovodCollectives

        collectives = HorovodCollectives()                 # adopts the initialised MPI
    timed["call_seconds"] = function_sweep(no_collective, repeats)
    if backend == "horovod":
        from hvdtrain.collectives.horovod_backend import horovod_tensorflow

        hvd = horovod_tensorflow()
        timed["horovod_seconds"] = function_sweep(lambda t: hvd.allreduce(t, op=hvd.Sum),
                                                  repeats)
    timed["hvdtrain_seconds"] = function_sweep(
        lambda t: collectives.reduce_gradients([t])[0], repeats)
    size = collectives.world.size
    rows = []
    for index, nbytes in enumerate(SIZES):
        row = {"bytes": nbytes, "backend": backend,
               **{name: seconds[index] for name, seconds in timed.items()}}
        bus = 2 * (size - 1) / size * nbytes
        row.update(mpi_bus_gbps=bus / row["mpi_seconds"] / 1e9,
                   hvdtrain_bus_gbps=bus / row["hvdtrain_seconds"] / 1e9,
                   ratio=row["hvdtrain_seconds"] / row["mpi_seconds"])
        rows.append(row)
    return rows if collectives.world.is_chief else []


def timeline_events(path: Path) -> list[dict]:
    """A Horovod timeline's events (the file of a job that ended may lack its closing ``]``)."""
    text = path.read_text().rstrip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


@dataclass(frozen=True)
class Span:
    """One activity of a Horovod timeline: a ``B`` event and the ``E`` that closes it on the
    same row (``pid``, one row per tensor), in microseconds; ``args``: the closing event's
    (Horovod puts the tensor's dtype and shape on the end of its operation)."""

    pid: int
    name: str
    begin: float
    end: float
    args: dict


def row_names(events: list[dict]) -> dict[int, str]:
    """The name of each row (``pid``) of a Horovod timeline: the tensor its ``M`` event names."""
    return {event["pid"]: event["args"]["name"] for event in events
            if event.get("ph") == "M" and event.get("name") == "process_name"
            and "name" in event.get("args", {})}


def timeline_spans(events: list[dict]) -> list[Span]:
    """Every completed activity, in the order they close. Activities nest on a row (an
    ``ALLREDUCE`` holds its ``MPI_ALLREDUCE``), so an ``E`` closes the row's latest open ``B``;
    instant (``X``) and metadata (``M``) events are not activities."""
    spans = []
    open_spans: dict[int, list[tuple[str, float]]] = {}
    for event in events:
        if event.get("ph") == "B":
            open_spans.setdefault(event["pid"], []).append((event["name"], event["ts"]))
        elif event.get("ph") == "E" and open_spans.get(event["pid"]):
            name, began = open_spans[event["pid"]].pop()
            spans.append(Span(event["pid"], name, began, event["ts"], event.get("args", {})))
    return spans


def timeline_breakdown(path: Path, repeats: int) -> list[dict]:
    """Median milliseconds per size of hvdtrain's timed sweep (warm-up call excluded; the bare
    ``hvd.allreduce`` calls before it are left out): negotiation, ``MPI_Allreduce`` inside
    Horovod, and the period from one call's start to the next."""
    events = timeline_events(path)
    grouped = {pid for pid, name in row_names(events).items() if GROUP_MEMBER.search(name)}
    spans: dict[str, list[tuple[float, float]]] = {}
    for span in timeline_spans(events):
        if span.pid in grouped:
            spans.setdefault(span.name, []).append((span.begin, span.end - span.begin))
    negotiations, reductions = spans["NEGOTIATE_ALLREDUCE"], spans["MPI_ALLREDUCE"]
    per_size = repeats + 1
    if len(negotiations) != len(SIZES) * per_size:
        raise ValueError(f"{path} holds {len(negotiations)} allreduces, not "
                         f"{len(SIZES)} sizes x {per_size} calls; give the sweep's --repeats")
    rows = []
    for index, nbytes in enumerate(SIZES):
        timed = slice(index * per_size + 1, (index + 1) * per_size)
        starts = [began for began, _ in negotiations[timed]]
        rows.append({
            "bytes": nbytes,
            "negotiate_ms": statistics.median(d for _, d in negotiations[timed]) / 1e3,
            "mpi_allreduce_ms": statistics.median(d for _, d in reductions[timed]) / 1e3,
            "period_ms": statistics.median(b - a for a, b in zip(starts, starts[1:])) / 1e3,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=count, default=20)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--backend", choices=("horovod", "tensorflow"), default="horovod",
                        help="hvdtrain's collectives to time beside MPI")
    parser.add_argument("--breakdown", type=Path, metavar="TIMELINE",
                        help="only analyse the Horovod timeline of an earlier sweep")
    args = parser.parse_args(argv)
    if args.breakdown:
        for row in timeline_breakdown(args.breakdown, args.repeats):
            print(f"{row['bytes'] / 1024:>8,.0f} KiB  negotiate {row['negotiate_ms']:7.3f} ms  "
                  f"MPI_Allreduce {row['mpi_allreduce_ms']:8.3f} ms  per call "
                  f"{row['period_ms']:8.3f} ms")
        return 0
    rows = sweep(args.repeats, args.backend)
    for row in rows:
        horovod = (f"  Horovod {row['horovod_seconds'] * 1e3:8.3f} ms"
                   if "horovod_seconds" in row else "")
        print(f"{row['bytes'] / 1024:>8,.0f} KiB  MPI {row['mpi_seconds'] * 1e3:8.3f} ms "
              f"({row['mpi_bus_gbps']:.2f} GB/s)  call {row['call_seconds'] * 1e3:7.3f} ms"
              f"{horovod}  hvdtrain ({args.backend}) {row['hvdtrain_seconds'] * 1e3:8.3f} "
              f"ms ({row['hvdtrain_bus_gbps']:.2f} GB/s)  ratio {row['ratio']:.3f}", flush=True)
    if rows and args.output:
        args.output.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
