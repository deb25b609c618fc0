"""Allreduce sweep: hvdtrain's gradient path (Horovod, inside a ``tf.function``) against
mpi4py's ``MPI.Allreduce`` on the same ranks, 4 KB to 64 MB of float32.

Run under a launcher with the MPI controller: ``launch/mpirun.sh -np 2 --command "python -m
hvdtrain.bench_comm --output comm.json"``. Both paths run in the same processes, alternating per
message size, so they see the same machine state. Reported per size: median seconds over the
repeats, bus bandwidth (2 (n-1)/n x bytes / time, the usual allreduce convention) and the ratio
hvdtrain / MPI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _timed(run, repeats: int) -> float:
    run()                                                  # warm-up (and tracing)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def sweep(repeats: int) -> list[dict]:
    import mpi4py

    mpi4py.rc.initialize = False                           # Horovod owns MPI_Init
    import numpy as np
    import tensorflow as tf

    from hvdtrain.world import HorovodCollectives

    collectives = HorovodCollectives()
    from mpi4py import MPI

    comm, size = MPI.COMM_WORLD, collectives.world.size
    rows = []
    for nbytes in SIZES:
        count = nbytes // 4
        send = np.ones(count, np.float32)
        receive = np.empty_like(send)
        tensor = tf.ones([count], tf.float32)
        reduce = tf.function(lambda t: collectives.reduce_gradients([t], adasum=False,
                                                                    fp16=False)[0])

        def mpi_allreduce() -> None:
            comm.Allreduce(send, receive, op=MPI.SUM)

        def horovod_allreduce() -> None:
            reduce(tensor).numpy()

        mpi_s = _timed(mpi_allreduce, repeats)
        hvd_s = _timed(horovod_allreduce, repeats)
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
