"""Where this process stands among the job's ranks, and the devices it computes on: one GPU per
local rank, or an equal share of the node's cores."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class World:
    """Where this process stands among the ranks of one job.

    ``local_*``: among the ranks on this node; ``cross_*``: among the nodes (the rank of this
    node's group of local ranks, and how many nodes there are); ``host``: this node's name.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    host: str = field(default_factory=socket.gethostname)

    @property
    def is_chief(self) -> bool:
        """Rank 0 alone writes files and prints progress."""
        return self.rank == 0


def gpus_visible() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def cpu_threads_per_rank(local_size: int, affinity: int, cores: int) -> int:
    """Threads for TensorFlow's pools so the ranks on one node share its cores without contention.

    A launcher that binds ranks to cores already gave each rank its share (affinity < cores);
    otherwise every rank sees every core and takes an equal slice of them.
    """
    if affinity < cores:
        return max(1, affinity)
    return max(1, cores // max(1, local_size))


def positive_int(text: str | None) -> int | None:
    """``text`` as a whole number of at least 1, or None (unset, empty or not one)."""
    try:
        value = int(text or "")
    except ValueError:
        return None
    return value if value >= 1 else None


def default_interop_threads(intra: int) -> int:
    """TensorFlow's inter-op threads for a rank with ``intra`` intra-op threads, where the user
    set none: two let the executor run a collective beside the backward pass, but a rank with
    one core keeps one: there a second thread made the custom loop's step 8% slower on one
    machine (the bench README's comparison harness), likely competing with the other ranks'
    compute."""
    return min(2, intra)


def cpu_thread_pools(threads: int | None, local_size: int, affinity: int, cores: int,
                     environ: Mapping[str, str] | None = None) -> tuple[int, int, str]:
    """(intra-op threads, inter-op threads, where the count came from) for a CPU rank:
    ``threads`` (``--threads``) when given; else TensorFlow's own ``TF_NUM_INTRAOP_THREADS`` and
    ``TF_NUM_INTEROP_THREADS`` where the user set them (TensorFlow reads them, and sizing its
    pools here would silently replace them); else an equal share of the node's cores
    (``cpu_threads_per_rank``). Inter-op: the variable, else ``default_interop_threads``."""
    variables = os.environ if environ is None else environ
    from_env = positive_int(variables.get("TF_NUM_INTRAOP_THREADS"))
    if threads:
        intra, why = threads, "--threads"
    elif from_env:
        intra, why = from_env, "TF_NUM_INTRAOP_THREADS"
    else:
        intra, why = cpu_threads_per_rank(local_size, affinity, cores), "a share of the cores"
    inter = positive_int(variables.get("TF_NUM_INTEROP_THREADS")) or default_interop_threads(intra)
    return intra, inter, why


# This process's placement, once made (TensorFlow keeps it for the process's lifetime).
_placed: list[str] = []


def place_devices(world: World, threads: int | None = None) -> str:
    """Pin one GPU per local rank (memory growth on), or size CPU thread pools; say which.

    Must run before TensorFlow creates its runtime (before the first op). Once it has, the
    placement stands: an earlier run's, or TensorFlow's own defaults when the script used
    TensorFlow (built a model, a dataset) before hvdtrain could place the rank, which the line
    says, with the fix.
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    try:
        if gpus:
            gpu = gpus[world.local_rank % len(gpus)]
            tf.config.experimental.set_memory_growth(gpu, True)
            tf.config.set_visible_devices(gpu, "GPU")
            _placed.append(f"GPU {gpu.name} (local rank {world.local_rank} of {len(gpus)} "
                           "GPUs)")
        else:
            intra, inter, why = cpu_thread_pools(threads, world.local_size,
                                                 len(os.sched_getaffinity(0)),
                                                 os.cpu_count() or 1)
            tf.config.threading.set_intra_op_parallelism_threads(intra)
            tf.config.threading.set_inter_op_parallelism_threads(inter)
            _placed.append(f"CPU, {intra} thread(s) for this rank ({why})")
        return _placed[-1]
    except RuntimeError:
        if _placed:   # a second run in the same process (a notebook, a test)
            return f"{_placed[-1]}, as placed by an earlier run in this process"
        visible = tf.config.get_visible_devices("GPU")
        threads_now = tf.config.threading.get_intra_op_parallelism_threads() or "default"
        where = (f"every rank sees all {len(visible)} GPUs" if len(visible) > 1 else
                 f"{visible[0].name}" if visible else
                 f"CPU, TensorFlow's own {threads_now} thread(s) per rank")
        return (f"{where}: TensorFlow had started before hvdtrain could place this rank (the "
                "script used it first); call hvdtrain.init() at the top of the script to pin "
                "one GPU per rank or split the cores")
