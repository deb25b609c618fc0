"""The Horovod backend: the one module that imports Horovod. Everything else receives a
``Collectives`` object and a ``World`` value and never asks Horovod directly."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

from hvdtrain.collectives.base import (GradientReduction, positions_by_dtype, scaled_rows,
                                       tf_variables)
from hvdtrain.collectives.world import World, gpus_visible
from hvdtrain.errors import UserError
from hvdtrain.launchers import MPI_LAUNCHER_VARIABLES, apply_runtime_defaults

# Variables broadcast eagerly go in batches of about Horovod's default fusion buffer: a rank then
# holds at most one batch twice, not the whole model (one Horovod tf.function per batch).
BROADCAST_BATCH_BYTES = 64 * 2**20


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
        apply_runtime_defaults(gpus_visible())
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
        compression = (hvd.Compression.fp16 if reduction.compression == "fp16"
                       else hvd.Compression.none)
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
            previous: list[Any] = []
            for bucket in reduction.buckets([reduced[i] for i in dense]):
                members = [dense[i] for i in bucket]
                submitted = reduction.submitted(previous, [reduced[i] for i in members])
                combined = (self._gathered_sums(submitted, reduction)
                            if reduction.compression == "bf16" else hvd.grouped_allreduce(
                                submitted, op=op, compression=compression,
                                prescale_factor=reduction.prescale,
                                postscale_factor=reduction.postscale))
                for index, tensor in zip(members, combined):
                    reduced[index] = tensor
                previous = combined
        for index in sparse:
            reduced[index] = scaled_rows(hvd.allreduce(reduced[index], op=op),
                                         reduction.prescale * reduction.postscale)
        return reduced

    def _gathered_sums(self, tensors: list[Any], reduction: GradientReduction) -> list[Any]:
        """``tensors`` combined as ``reduction`` says ("sum" or "average"), with bfloat16 on
        the wire. Horovod 0.28.1's allreduce and reducescatter take no bfloat16 (their types
        end at float16; MPI has no bfloat16), so each rank's bfloat16 copy travels bit-cast to
        int16 in one grouped all-gather, and every rank adds the ranks' rows in the tensor's
        own type (float32): the same rows in the same order, so the same sum on every rank,
        rounded only when each rank's part left. Received per rank: (N-1)/2 of the float32
        bytes, where float32's ring allreduce receives 2(N-1)/N of them: half at 2 ranks, as
        many at 4, more beyond. A tensor that is not float32 or float64 is allreduced as it
        is."""
        import tensorflow as tf

        gathered = [i for i, t in enumerate(tensors)
                    if reduction.on_wire(t).dtype == tf.bfloat16]
        kept = [i for i in range(len(tensors)) if i not in gathered]
        wire = [reduction.on_wire(tensors[i] * reduction.prescale if reduction.prescale != 1.0
                                  else tensors[i]) for i in gathered]
        combined = list(tensors)
        for index, rows in zip(gathered, self._hvd.grouped_allgather(
                [tf.bitcast(tf.reshape(t, [-1]), tf.int16) for t in wire])):
            size = tf.size(tensors[index])
            ranks = tf.shape(rows)[0] // tf.maximum(size, 1)
            rows = tf.cast(tf.reshape(tf.bitcast(rows, tf.bfloat16), [ranks, size]),
                           tensors[index].dtype)
            total = tf.reduce_sum(rows, axis=0)
            if reduction.op == "average":
                total = total / tf.cast(ranks, total.dtype)
            combined[index] = tf.reshape(total * reduction.postscale, tf.shape(tensors[index]))
        if kept:
            op = self._hvd.Average if reduction.op == "average" else self._hvd.Sum
            for index, total in zip(kept, self._hvd.grouped_allreduce(
                    [tensors[i] for i in kept], op=op, prescale_factor=reduction.prescale,
                    postscale_factor=reduction.postscale)):
                combined[index] = total
        return combined

    def reduce_scatter_sum(self, tensors: Sequence[Any]) -> list[Any]:
        """Horovod's grouped reducescatter; bfloat16 (``--compression bf16`` under
        ``--zero-stage``) is refused in one line: Horovod 0.28.1's reducescatter takes none,
        and gathering whole tensors instead would move as many bytes as float32 pieces at 2
        ranks and more beyond."""
        if not tensors:
            return []
        if any(t.dtype.name == "bfloat16" for t in tensors):
            raise UserError("--compression bf16 with --zero-stage needs the TensorFlow backend "
                            "(Horovod's reducescatter takes no bfloat16); use --backend "
                            "tensorflow or --compression fp16")
        return list(self._hvd.grouped_reducescatter(list(tensors), op=self._hvd.Sum))

    def allgather(self, tensors: Sequence[Any]) -> list[Any]:
        """One grouped all-gather per dtype (Horovod's groups hold one dtype)."""
        gathered: list[Any] = [None] * len(tensors)
        for indices in positions_by_dtype(tensors):
            for index, value in zip(indices, self._hvd.grouped_allgather(
                    [tensors[i] for i in indices])):
                gathered[index] = value
        return gathered

    def broadcast_variables(self, variables: Sequence[Any], root_rank: int = 0) -> Any:
        """Horovod's, without TensorFlow's retracing warning: Horovod traces its one cached
        ``tf.function`` again for every new list of variables (each ``fit`` has one), so the
        sixth ``fit`` in a process printed a warning about the user's code that was about
        Horovod's (its in-place form, which does not trace, refuses two variables of one
        name, as a subclassed model's layers have)."""
        if not variables:
            return None
        variables = tf_variables(variables)
        import tensorflow as tf

        with _without_retracing_warning():
            if not tf.executing_eagerly():   # a TensorFlow 1 graph: the op to run
                return self._hvd.broadcast_variables(variables, root_rank=root_rank)
            # Eagerly, in batches: Horovod's one tf.function issues every broadcast at once,
            # so each rank held the whole model twice (measured: a 214M-parameter model's
            # ranks grew by 900 MiB, kept by TensorFlow's allocator for the run).
            batches = GradientReduction(bucket_bytes=BROADCAST_BATCH_BYTES).buckets(variables)
            for positions in reversed(batches):   # in the variables' order
                self._hvd.broadcast_variables([variables[i] for i in positions],
                                              root_rank=root_rank)
        return None

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


def horovod_usable() -> str | None:
    """None when Horovod's TensorFlow extension loads and was built with a controller (MPI or
    Gloo); otherwise why not, in a few words."""
    info = horovod_build_info()
    if "error" in info:
        return info["error"]
    if not any(info["controllers"].values()):
        return "Horovod was built without MPI and Gloo"
    return None


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
