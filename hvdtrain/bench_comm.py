"""Allreduce sweep: hvdtrain's gradient path (Horovod, inside a ``tf.function``) against
mpi4py's ``MPI.Allreduce`` on the same ranks, 4 KB to 64 MB of float32.

Run under a launcher with the MPI controller: ``launch/mpirun.sh -np 2 --command "python -m
hvdtrain.bench_comm --output comm.json"``. The same processes time MPI first, before Horovod
starts (its background thread polls MPI every cycle and would slow a raw MPI call made beside
it), then hvdtrain's path on the MPI that Horovod adopts. Both run under hvdtrain's runtime
defaults (``world.apply_runtime_defaults``), both write into a preallocated-or-allocator-reused
output, and a Horovod call is timed to its result being ready, not to a copy into NumPy.
Reported per size: median seconds over the repeats, bus bandwidth (2 (n-1)/n x bytes / time,
the usual allreduce convention) and the ratio hvdtrain / MPI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


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


def hvdtrain_sweep(collectives, repeats: int) -> list[float]:
    """Median seconds of hvdtrain's gradient reduction (one grouped allreduce) for each size."""
    import tensorflow as tf

    reduce = tf.function(lambda t: collectives.reduce_gradients([t], adasum=False,
                                                                fp16=False)[0])
    seconds = []
    for nbytes in SIZES:
        tensor = tf.ones([nbytes // 4], tf.float32)
        # Eager execution returns once the allreduce has completed on this rank.
        seconds.append(_timed(lambda: reduce(tensor), repeats))
    return seconds


def sweep(repeats: int) -> list[dict]:
    from hvdtrain.world import apply_runtime_defaults

    apply_runtime_defaults(gpus_visible=False)
    from mpi4py import MPI                                 # MPI_Init, thread level multiple

    comm = MPI.COMM_WORLD
    mpi_seconds = mpi_sweep(comm, repeats)
    from hvdtrain.world import HorovodCollectives

    collectives = HorovodCollectives()                     # adopts the initialised MPI
    hvdtrain_seconds = hvdtrain_sweep(collectives, repeats)
    size = collectives.world.size
    rows = []
    for nbytes, mpi_s, hvd_s in zip(SIZES, mpi_seconds, hvdtrain_seconds):
        bus = 2 * (size - 1) / size * nbytes
        rows.append({"bytes": nbytes, "mpi_seconds": mpi_s, "hvdtrain_seconds": hvd_s,
                     "mpi_bus_gbps": bus / mpi_s / 1e9, "hvdtrain_bus_gbps": bus / hvd_s / 1e9,
                     "ratio": hvd_s / mpi_s})
    return rows if collectives.world.is_chief else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    rows = sweep(args.repeats)
    for row in rows:
        print(f"{row['bytes'] / 1024:>8,.0f} KiB  MPI {row['mpi_seconds'] * 1e3:8.3f} ms "
              f"({row['mpi_bus_gbps']:.2f} GB/s)  hvdtrain {row['hvdtrain_seconds'] * 1e3:8.3f} "
              f"ms ({row['hvdtrain_bus_gbps']:.2f} GB/s)  ratio {row['ratio']:.3f}", flush=True)
    if rows and args.output:
        args.output.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
