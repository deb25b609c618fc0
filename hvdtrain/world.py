"""The world a run lives in: rank facts, device placement and the collective operations.

This is the one module that imports Horovod. Everything else receives a ``Collectives`` object
and a ``World`` value and never asks Horovod directly, so the single-process implementation
here lets ``python -m hvdtrain`` and most tests run without MPI.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from hvdtrain.errors import first_sentence

# Environment variables that a launcher sets in every rank it starts: horovodrun with Gloo,
# Open MPI's mpirun (also used by horovodrun with MPI), PMIx (srun --mpi=pmix), MPICH/PMI2.
LAUNCHER_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK",
                      "HOROVOD_ELASTIC")
# ... of which these mean an MPI launch (Horovod's MPI controller), not Gloo's.
MPI_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


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


@dataclass(frozen=True)
class GradientReduction:
    """How gradients are combined across ranks: the one description that the trainer's step and
    the Horovod drop-in (``hvdtrain.keras.DistributedOptimizer``,
    ``hvdtrain.tensorflow.DistributedGradientTape``) hand to ``reduce_gradients``.

    ``op`` is "sum", "average" (Horovod divides by the current world size, so it follows an
    elastic world) or "adasum". Each rank's tensors are multiplied by ``prescale`` before they
    are combined and the result by ``postscale`` (Horovod's ``gradient_predivide_factor`` f is
    prescale 1/f, postscale f). ``fp16`` halves the bytes on the wire. Sparse gradients
    (``tf.IndexedSlices``, e.g. of an embedding) are gathered, not summed, unless
    ``sparse_as_dense`` turns them into dense tensors first.

    ``bucket_bytes`` > 0 splits the dense gradients into buckets of about that many bytes,
    filled from the end of the list (the last layers' gradients, which the backward pass
    computes first), one grouped allreduce each: in a ``tf.function`` each bucket's allreduce
    starts as soon as its own gradients exist, while the backward pass still computes the
    earlier layers' (see ``buckets``). 0 keeps one group for everything.
    """

    op: str = "sum"
    fp16: bool = False
    prescale: float = 1.0
    postscale: float = 1.0
    sparse_as_dense: bool = False
    bucket_bytes: int = 0

    def __post_init__(self) -> None:
        if self.op not in ("sum", "average", "adasum"):
            raise ValueError(f"gradient reduction op must be sum, average or adasum, not {self.op}")
        if self.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be 0 (one group) or more, not {self.bucket_bytes}")

    def buckets(self, tensors: Sequence[Any]) -> list[list[int]]:
        """The positions of ``tensors`` grouped into buckets, in the order they are issued:
        walking from the last tensor to the first, a bucket closes once it holds at least
        ``bucket_bytes`` (a tensor larger than that is a bucket of its own). Within a bucket
        the positions ascend. A tensor of unknown size counts as 0 bytes."""
        if self.bucket_bytes == 0:
            return [list(range(len(tensors)))] if tensors else []
        found: list[list[int]] = []
        current: list[int] = []
        filled = 0
        for index in reversed(range(len(tensors))):
            current.insert(0, index)
            filled += _static_bytes(tensors[index])
            if filled >= self.bucket_bytes:
                found.append(current)
                current, filled = [], 0
        if current:
            found.append(current)
        return found

    def describe(self, variables: Sequence[Any], accumulated: bool = False) -> str:
        """One line for the run's log: how the gradients of ``variables`` will travel
        (``accumulated``: summed over micro-steps in variables first, so all at once)."""
        total = sum(_static_bytes(v) for v in variables) / 2**20
        count = len(self.buckets(variables))
        if self.bucket_bytes == 0:
            return f"gradients: {total:.2f} MiB in one allreduce after the backward pass"
        when = ("all at the last micro-step (accumulated: no overlap)" if accumulated else
                "each sent once the backward pass has computed it")
        return (f"gradients: {total:.2f} MiB in {count} bucket(s) of about "
                f"{self.bucket_bytes / 2**20:g} MiB, {when}")


def _static_bytes(tensor: Any) -> int:
    """Bytes of a tensor or variable (TensorFlow's or Keras') whose shape is known when the
    graph is built (0 otherwise)."""
    import tensorflow as tf

    elements = tf.TensorShape(tensor.shape).num_elements()
    return 0 if elements is None else elements * tf.as_dtype(tensor.dtype).size


class Collectives(Protocol):
    """The collective operations a data-parallel run needs, for any backend."""

    world: World
    backend: str      # "horovod", "tensorflow" or "none" (a world of one)
    chosen: str       # why this backend: "as asked", or what auto found

    def allreduce_sum(self, tensors: Sequence[Any]) -> list[Any]:
        """Sum each tensor across ranks (grouped into one fused ring-allreduce; graph-safe)."""

    def reduce_gradients(self, tensors: Sequence[Any],
                         reduction: GradientReduction = GradientReduction()) -> list[Any]:
        """Combine gradients across ranks as ``reduction`` says, dense ones in one grouped
        allreduce; a None gradient stays None (graph-safe)."""

    def broadcast_variables(self, variables: Sequence[Any], root_rank: int = 0) -> Any:
        """Overwrite every rank's variables (TensorFlow or Keras 3) with the root rank's. In a
        TensorFlow 1 graph that is an op to run, which is returned (None: nothing to run)."""

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        """Return the root rank's picklable object on every rank."""

    def allgather_object(self, obj: Any) -> list[Any]:
        """Return the list of every rank's object, in rank order."""

    def shutdown(self) -> None:
        """Leave the job's collectives after an error here, so no peer waits for this rank."""


class LocalCollectives:
    """A world of one: every collective is the identity."""

    backend = "none"

    def __init__(self) -> None:
        self.world = World()
        self.chosen = "one process"

    def allreduce_sum(self, tensors: Sequence[Any]) -> list[Any]:
        return list(tensors)

    def reduce_gradients(self, tensors: Sequence[Any],
                         reduction: GradientReduction = GradientReduction()) -> list[Any]:
        # Sum, average and Adasum of one tensor are that tensor.
        import tensorflow as tf

        scale = reduction.prescale * reduction.postscale
        return [t if t is None or scale == 1.0 else
                _scaled_rows(t, scale) if isinstance(t, tf.IndexedSlices) else t * scale
                for t in tensors]

    def broadcast_variables(self, variables: Sequence[Any], root_rank: int = 0) -> None:
        return None

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        return obj

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def shutdown(self) -> None:
        return None


class _RetracingWarningFilter(logging.Filter):
    """Drops TensorFlow's warning that a ``tf.function`` is traced again and again."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "triggered tf.function retracing" not in record.getMessage()


@contextlib.contextmanager
def _without_retracing_warning() -> Iterator[None]:
    """TensorFlow's logger without its retracing warning, for the block only."""
    found = _RetracingWarningFilter()
    logger = logging.getLogger("tensorflow")
    logger.addFilter(found)
    try:
        yield
    finally:
        logger.removeFilter(found)


class HorovodCollectives:
    """Collectives over Horovod (MPI or Gloo controller; CPU, MPI or NCCL tensor ops)."""

    backend = "horovod"
    chosen = "as asked"

    def __init__(self, **init_arguments: Any) -> None:
        """Start Horovod (``init_arguments`` are Horovod's ``init`` arguments: comm,
        process_sets) with hvdtrain's runtime defaults."""
        apply_runtime_defaults(_gpus_visible())
        if any(name in os.environ for name in MPI_LAUNCHER_VARIABLES):
            # MPI started by mpi4py, not by Horovod: Horovod's shutdown then leaves MPI up, so a
            # failed run can shut Horovod down (which ends every peer's pending collective with
            # an error instead of a hang) and the next run in this process can start it again.
            from mpi4py import MPI  # noqa: F401
        hvd = horovod_tensorflow()
        hvd.init(**init_arguments)
        self._hvd = hvd
        self.world = self._read_world()

    def _read_world(self) -> World:
        hvd = self._hvd
        return World(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
                     hvd.cross_rank(), hvd.cross_size())

    def allreduce_sum(self, tensors: Sequence[Any]) -> list[Any]:
        if not tensors:
            return []
        return list(self._hvd.grouped_allreduce(list(tensors), op=self._hvd.Sum))

    def reduce_gradients(self, tensors: Sequence[Any],
                         reduction: GradientReduction = GradientReduction()) -> list[Any]:
        import tensorflow as tf

        hvd = self._hvd
        compression = hvd.Compression.fp16 if reduction.fp16 else hvd.Compression.none
        reduced = list(tensors)
        dense, sparse = [], []
        for index, tensor in enumerate(tensors):
            if isinstance(tensor, tf.IndexedSlices) and (reduction.sparse_as_dense
                                                         or reduction.op == "adasum"):
                reduced[index] = tensor = tf.convert_to_tensor(tensor)
            if isinstance(tensor, tf.IndexedSlices):
                sparse.append(index)
            elif tensor is not None:
                dense.append(index)
        op = {"sum": hvd.Sum, "average": hvd.Average, "adasum": hvd.Adasum}[reduction.op]
        if reduction.op == "adasum":
            # One allreduce per tensor (Horovod's tensor fusion still batches them):
            # grouped_allreduce with Adasum fails in Horovod 0.28.1 (it reads an unbound
            # variable on its Adasum branch).
            for index in dense:
                reduced[index] = hvd.allreduce(reduced[index] * reduction.prescale, op=op,
                                               compression=compression) * reduction.postscale
        else:
            for bucket in reduction.buckets([reduced[i] for i in dense]):
                members = [dense[i] for i in bucket]
                combined = hvd.grouped_allreduce(
                    [reduced[i] for i in members], op=op, compression=compression,
                    prescale_factor=reduction.prescale, postscale_factor=reduction.postscale)
                for index, tensor in zip(members, combined):
                    reduced[index] = tensor
        for index in sparse:
            reduced[index] = _scaled_rows(hvd.allreduce(reduced[index], op=op),
                                          reduction.prescale * reduction.postscale)
        return reduced

    def broadcast_variables(self, variables: Sequence[Any], root_rank: int = 0) -> Any:
        """Horovod's, without TensorFlow's retracing warning: Horovod traces its one cached
        ``tf.function`` again for every new list of variables (each ``fit`` has one), so the
        sixth ``fit`` in a process printed a warning about the user's code that was about
        Horovod's (its in-place form, which does not trace, refuses two variables of one
        name, as a subclassed model's layers have)."""
        if not variables:
            return None
        with _without_retracing_warning():
            return self._hvd.broadcast_variables(tf_variables(variables), root_rank=root_rank)

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        return self._hvd.broadcast_object(obj, root_rank=root_rank)

    def allgather_object(self, obj: Any) -> list[Any]:
        return list(self._hvd.allgather_object(obj))

    def shutdown(self) -> None:
        """End Horovod in this process: every peer's pending or next collective fails at once
        ("Horovod has been shut down") instead of waiting for this rank; ``init`` may follow."""
        self._hvd.shutdown()

    def refresh_world(self) -> World:
        """Re-read rank facts: elastic training re-initialises Horovod when the world changes."""
        self.world = self._read_world()
        return self.world

    def elastic_state(self, variables: Sequence[Any], **attributes: Any) -> Any:
        """A Horovod elastic state over TensorFlow variables plus picklable attributes."""
        return keras_elastic_state_class()(variables, **attributes)

    def elastic_run(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Horovod's elastic retry loop: on a world change, reset, restore or sync, rerun."""
        return elastic_retry(function)


def elastic_retry(function: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's elastic retry loop (``horovod.tensorflow.elastic.run``), retrying every error
    of a Horovod collective: the trainer's and the drop-in's ``elastic.run``.

    Horovod's loop retries a TensorFlow UnknownError only when it names HorovodAllreduce,
    HorovodAllgather or HorovodBroadcast, and returns None for any other, as if training had
    ended. Gradients travel in a HorovodGroupedAllreduce, so a lost rank would end training
    early and pass for its end. Any other UnknownError passes through as a RuntimeError."""
    import tensorflow as tf
    from horovod.common.exceptions import HorovodInternalError

    @functools.wraps(function)
    def attempt(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except tf.errors.UnknownError as error:
            if "Horovod" in error.message:   # a collective failed: the world changed
                raise HorovodInternalError(error) from error
            raise RuntimeError(error.message) from error

    return horovod_tensorflow().elastic.run(attempt)


# What a collective's error says on this rank when another rank has left the job: Horovod's
# (the other rank shut it down), TensorFlow's (its collectives aborted by the other rank's
# report, or its connection gone).
PEER_GONE_MARKERS = ("Horovod has been shut down", "Collective ops is aborted by",
                     "Socket closed", "Connection reset by peer", "stopped sending heartbeats",
                     "failed to connect to all addresses")


def ended_by_another_rank(error: BaseException) -> bool:
    """True for the error a collective raises on this rank when another rank has left the job
    (it failed, reported why, and shut its collectives down as its process ended): this rank
    has nothing to add to that report."""
    return any(marker in str(error) for marker in PEER_GONE_MARKERS)


def leave_horovod() -> None:
    """Shut Horovod down now, if this process started it (it would at exit): the other ranks'
    collectives then end at once instead of waiting for this rank."""
    import sys

    if "horovod.tensorflow" in sys.modules:
        horovod_tensorflow().shutdown()


def horovod_tensorflow() -> ModuleType:
    """The ``horovod.tensorflow`` module: the trainer's collectives use it, and the drop-in API
    (``hvdtrain.tensorflow``, ``hvdtrain.keras``) re-exports its unchanged names from here."""
    import horovod.tensorflow as hvd

    return hvd


def _scaled_rows(gathered: Any, scale: float) -> Any:
    """Horovod's reduced sparse gradient: every rank's rows, concatenated in rank order, each
    index as often as it occurs. That is the gradient one process computes over the whole
    global batch, so the optimizer sees what Keras would give it there: Keras 3 optimizers
    apply ``IndexedSlices`` row by row (Adam and RMSprop square each row), and summing repeated
    rows first would change the update (measured: 1e-3 apart after one RMSprop step)."""
    import tensorflow as tf

    if scale == 1.0:
        return gathered
    return tf.IndexedSlices(gathered.values * scale, gathered.indices, gathered.dense_shape)


def runtime_defaults(gpus_visible: bool) -> dict[str, str]:
    """hvdtrain's settings for Horovod and MPI: the single source of them, for training and for
    the benchmark harness (which gives every variant the same ones)."""
    defaults = {
        # A rank that stops submitting tensors (hung in I/O, stopped) while the others wait:
        # Horovod warns after 60 s and shuts the job down after 120 s, so no allocation burns.
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120",
    }
    if not gpus_visible:
        # CPU training keeps every core busy computing; Open MPI's default busy-polling while a
        # rank waits steals those cores (measured: 1.45x throughput when it yields, 2 ranks on
        # 2 cores). Read by MPI_Init.
        defaults["OMPI_MCA_mpi_yield_when_idle"] = "1"
        # Horovod's background thread starts a round of negotiation every cycle (1 ms by
        # default), so a collective waits up to a cycle before it starts. At 0.1 ms a 1 MiB
        # allreduce took 0.33 ms instead of 2.1 ms on 2 CPU ranks, and training throughput did
        # not change (cnn, 3 rounds each: within 1%).
        defaults["HOROVOD_CYCLE_TIME"] = "0.1"
    return defaults


# Open MPI's own TCP keep-alive settings for its daemons: idle seconds, seconds between probes,
# probes (oob_tcp_keepalive_time, _intvl, _probes).
OPEN_MPI_KEEPALIVE = (300, 20, 9)
KEEPALIVE_VARIABLES = ("OMPI_MCA_oob_tcp_keepalive_time", "OMPI_MCA_oob_tcp_keepalive_intvl",
                       "OMPI_MCA_oob_tcp_keepalive_probes")


def launcher_defaults() -> dict[str, str]:
    """hvdtrain's settings for the launcher itself (mpirun, and the orted daemons it starts on
    the other nodes): launch/mpirun.sh, launch/horovodrun.sh and the MPIJob manifest set them;
    for a bare mpirun or horovodrun, export them first (README, ``hvdtrain doctor``).

    Open MPI's daemons learn of a vanished node only from TCP. By default they probe an idle
    connection after 300 s and give up 9 x 20 s later, and once mpirun has started to end the
    job (a rank's liveness monitor ended one, say) its messages to the lost node wait for TCP's
    retransmissions, about 15 minutes: a launcher outside the nodes outlived its job. With
    these, a daemon that stops answering is declared lost 36 to 46 s after its node vanished:
    after a rank's liveness monitor has named it (30 s by default; a rank under a remote daemon then
    leaves the ending to Open MPI, ``keepalive_window_s``), and in time for the job, every
    process on every node included, to end within 60 s."""
    return dict(zip(KEEPALIVE_VARIABLES, ("10", "6", "6")))


def keepalive_window_s(environ: Mapping[str, str] | None = None) -> float:
    """The longest time Open MPI's daemons take to declare a silent node lost, with the
    keep-alive settings a launcher forwarded to this rank (Open MPI's own where it did not)."""
    env = os.environ if environ is None else environ
    try:
        idle, interval, probes = (float(env.get(name, default)) for name, default
                                  in zip(KEEPALIVE_VARIABLES, OPEN_MPI_KEEPALIVE))
    except ValueError:          # Open MPI itself refuses such a value
        idle, interval, probes = OPEN_MPI_KEEPALIVE
    return idle + interval * probes


# Seconds Open MPI waits before it ends a rank whose local daemon (mpirun or orted) is gone.
LOST_DAEMON_GRACE_S = 120


def hold_open_mpi_abort() -> None:
    """Before MPI starts, in a rank that stops itself when its launcher dies (the trainer's
    ranks: ``training/liveness.py``): Open MPI ends such a rank (exit 195) as soon as it
    notices that its daemon is gone, even mid-checkpoint; delayed, the rank's own stop
    (checkpoint, exit 75) comes first. A setting of the user's wins."""
    os.environ.setdefault("OMPI_MCA_mpi_abort_delay", str(LOST_DAEMON_GRACE_S))


def apply_runtime_defaults(gpus_visible: bool) -> None:
    """Set ``runtime_defaults`` in this process's environment, before MPI and Horovod start;
    a variable the user has set keeps the user's value."""
    for name, value in runtime_defaults(gpus_visible).items():
        os.environ.setdefault(name, value)


def tf_variables(variables: Sequence[Any]) -> list[Any]:
    """The TensorFlow variables behind Keras 3 variables (what Horovod's broadcast assigns);
    TensorFlow variables pass through."""
    import keras

    return [v.value if isinstance(v, keras.Variable) else v for v in variables]


def horovod_object_state_class() -> type:
    """Horovod's ``ObjectState`` (picklable attributes, saved, restored and synchronised from
    rank 0), which ``hvd.elastic.ObjectState`` names on the Horovod backend."""
    from horovod.common.elastic import ObjectState

    return ObjectState


@functools.cache
def keras_elastic_state_class() -> type:
    """Horovod elastic state for Keras 3 models.

    Horovod's own TensorFlow states do not fit Keras 3: ``TensorFlowKerasState`` calls
    ``optimizer.variables()`` (a list in Keras 3) and ``TensorFlowState`` never re-broadcasts
    its variables in eager mode. This one keeps the underlying TensorFlow variables (model
    weights, optimizer state including its step counter) in memory at every commit, restores
    them after a failure, and broadcasts them from rank 0 whenever the world is re-formed.
    """
    from horovod.common.elastic import ObjectState

    hvd = horovod_tensorflow()

    class KerasElasticState(ObjectState):
        def __init__(self, variables: Sequence[Any], **attributes: Any) -> None:
            self.variables = list(variables)
            self._values = [v.numpy() for v in self.variables]
            super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **attributes)

        def save(self) -> None:
            self._values = [v.numpy() for v in self.variables]
            super().save()

        def restore(self) -> None:
            for variable, value in zip(self.variables, self._values):
                variable.assign(value)
            super().restore()

        def sync(self) -> None:
            hvd.broadcast_variables(self.variables, root_rank=0)
            self._values = [v.numpy() for v in self.variables]
            super().sync()

    return KerasElasticState


def _gpus_visible() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def launched_by_a_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """True when horovodrun, mpirun or srun started this process as one of several ranks
    (``HVDTRAIN_BACKEND=local`` says no whatever the launcher, a named backend says yes)."""
    env = os.environ if environ is None else environ
    forced = env.get("HVDTRAIN_BACKEND", "").lower()
    if forced in ("horovod", "tensorflow", "local"):
        return forced != "local"
    return any(name in env for name in LAUNCHER_VARIABLES)


BACKENDS = ("auto", "horovod", "tensorflow")


def horovod_usable() -> str | None:
    """None when Horovod's TensorFlow extension loads and was built with a controller (MPI or
    Gloo); otherwise why not, in a few words."""
    info = horovod_build_info()
    if "error" in info:
        return info["error"]
    if not any(info["controllers"].values()):
        return "Horovod was built without MPI and Gloo"
    return None


def chosen_backend(requested: str, environ: Mapping[str, str] | None = None
                   ) -> tuple[str, str]:
    """(backend, why) for a launched job: ``requested`` (the config's ``backend``), else
    ``HVDTRAIN_BACKEND``, else auto: Horovod where it is installed and loads, TensorFlow's
    collectives otherwise."""
    env = os.environ if environ is None else environ
    if requested == "auto":
        requested = env.get("HVDTRAIN_BACKEND", "auto").lower()
        if requested not in BACKENDS:
            requested = "auto"
    if requested != "auto":
        return requested, "as asked"
    problem = horovod_usable()
    if problem is None:
        return "horovod", "auto: Horovod is installed and loads"
    return "tensorflow", f"auto: Horovod is not usable here ({first_sentence(problem)})"


def cpu_threads_per_rank(local_size: int, affinity: int, cores: int) -> int:
    """Threads for TensorFlow's pools so the ranks on one node share its cores without contention.

    A launcher that binds ranks to cores already gave each rank its share (affinity < cores);
    otherwise every rank sees every core and takes an equal slice of them.
    """
    if affinity < cores:
        return max(1, affinity)
    return max(1, cores // max(1, local_size))


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
            affinity = len(os.sched_getaffinity(0))
            count = threads or cpu_threads_per_rank(world.local_size, affinity,
                                                    os.cpu_count() or 1)
            tf.config.threading.set_intra_op_parallelism_threads(count)
            tf.config.threading.set_inter_op_parallelism_threads(min(2, count))
            _placed.append(f"CPU, {count} thread(s) for this rank")
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


def init_collectives(backend: str = "auto", prepare: Callable[[World], Any] = lambda world: None,
                     environ: Mapping[str, str] | None = None) -> Collectives:
    """The backend's collectives when a launcher started us (``chosen_backend``), a world of one
    otherwise; ``prepare(world)`` (device placement) runs once the rank facts are known and
    before TensorFlow's runtime starts."""
    collectives: Any
    if not launched_by_a_launcher(environ):
        collectives = LocalCollectives()
        prepare(collectives.world)
        return collectives
    name, why = chosen_backend(backend, environ)
    if name == "tensorflow":
        from hvdtrain.tf_collectives import tensorflow_collectives

        collectives = tensorflow_collectives(prepare)
    else:
        collectives = HorovodCollectives()
        prepare(collectives.world)
    collectives.chosen = why
    return collectives


def horovod_build_info() -> dict[str, Any]:
    """What the installed Horovod was built with, or why it cannot be loaded."""
    try:
        import horovod
        import horovod.tensorflow as hvd

        return {
            "version": horovod.__version__,
            "tensorflow": True,
            "controllers": {"MPI": bool(hvd.mpi_built()), "Gloo": bool(hvd.gloo_built())},
            "tensor_ops": {"NCCL": bool(hvd.nccl_built()), "MPI": bool(hvd.mpi_built()),
                           "Gloo": bool(hvd.gloo_built())},
        }
    except ImportError as error:
        return {"error": f"{type(error).__name__}: {error}"}
    except Exception as error:  # noqa: BLE001 - a broken extension raises many kinds
        return {"error": f"Horovod's TensorFlow extension does not load ({error})"}
