"""``horovod.tensorflow``'s functions on the TensorFlow backend, for ``hvdtrain.tensorflow`` to
offer where Horovod is not the backend (``hvdtrain.dropin.core``), with Horovod's names, arguments
and results.

The process facts come from the drop-in's session, the tensor operations from
``tensor_operations`` (over ``TensorFlowCollectives``' raw ops), with Horovod's gradients
registered around them (``tf.custom_gradient``, for floating-point tensors), Horovod's handling
of ``IndexedSlices`` and of compression (any object with ``compress``/``decompress``), and
Horovod's deprecated ``average=``. What only Horovod does (join, Adasum, process sets, the
timeline) raises ``core.refused``'s one line. Arguments that only steer Horovod's internals
(``name``, ``ignore_name_scope``, ``session``) are accepted and have no effect.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import tensorflow as tf

from hvdtrain.dropin import core
from hvdtrain.collectives.tensorflow_backend import TensorFlowCollectives
from hvdtrain.dropin.ops import Average, Compression, Sum, op_name
from hvdtrain.dropin.tensor_operations import TensorOperations


# The tensor operations below are traced as written when a tf.function calls them: their
# Python branches and loops depend on shapes and settings, never on tensor values, and
# AutoGraph's conversion of everything they call only costs time at a script's first trace
# (measured on the 2-core VM: a function of 23 operations traced and ran in 20 s converted,
# 10-13 s not).
as_written = tf.autograph.experimental.do_not_convert


def _collectives() -> TensorOperations:
    backend = core.collectives()
    assert isinstance(backend, TensorFlowCollectives)
    return TensorOperations(backend)


def _global_only(process_set: Any) -> None:
    if process_set is not None:
        raise core.refused("process_set=")


# --- the process ---------------------------------------------------------------------------

def is_initialized() -> bool:
    return core.is_open()


def shutdown() -> None:
    """Leave the drop-in: ``is_initialized()`` is False until the next ``init()``."""
    core.close()


def size() -> int:
    return core.collectives().world.size


def local_size() -> int:
    return core.collectives().world.local_size


def cross_size() -> int:
    return core.collectives().world.cross_size


def rank() -> int:
    return core.collectives().world.rank


def local_rank() -> int:
    return core.collectives().world.local_rank


def cross_rank() -> int:
    return core.collectives().world.cross_rank


def is_homogeneous() -> bool:
    return core.homogeneous()


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    return _fact_op(size, process_set_id, name)


def rank_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    return _fact_op(rank, process_set_id, name)


def local_size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    return _fact_op(local_size, process_set_id, name)


def local_rank_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    return _fact_op(local_rank, process_set_id, name)


def _fact_op(fact: Any, process_set_id: int, name: str | None) -> tf.Tensor:
    """A process fact as an int32 tensor (the world does not change on this backend)."""
    if process_set_id != 0:
        raise core.refused("process_set_id=")
    return tf.constant(fact(), tf.int32, name=name)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise core.refused("Horovod's timeline (use TensorFlow's profiler instead)")


def stop_timeline() -> None:
    raise core.refused("Horovod's timeline (use TensorFlow's profiler instead)")


def join() -> int:
    raise core.refused("hvd.join()")


# --- what this backend is built with: TensorFlow's collectives, NCCL where built with CUDA ----

def mpi_built(verbose: bool = False) -> bool:
    return False


def gloo_built(verbose: bool = False) -> bool:
    return False


def ddl_built(verbose: bool = False) -> bool:
    return False


def ccl_built(verbose: bool = False) -> bool:
    return False


def nccl_built(verbose: bool = False) -> bool:
    return tf.test.is_built_with_cuda()


def cuda_built(verbose: bool = False) -> bool:
    return tf.test.is_built_with_cuda()


def rocm_built(verbose: bool = False) -> bool:
    return tf.test.is_built_with_rocm()


def mpi_enabled() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


# --- tensors -------------------------------------------------------------------------------

def _op(op: Any, average: bool | None) -> str:
    """Horovod's ``op`` (default Average) and its deprecated ``average``, as a name."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in "
                      "v1.0", DeprecationWarning, stacklevel=3)
        op = Average if average else Sum
    return op_name(Average if op is None else op)


@as_written
def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: Any = None,
              ignore_name_scope: bool = False) -> Any:
    """Combine a tensor (or ``IndexedSlices``: gathered, as Horovod does) across ranks."""
    _global_only(process_set)
    reduction = _op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        with tf.device(device_sparse):
            return _reduced_slices(tensor, reduction, prescale_factor, postscale_factor)
    if reduction == "adasum":
        raise core.refused("op=hvd.Adasum")
    with tf.device(device_dense):
        compressed, context = compression.compress(tf.convert_to_tensor(tensor))
        reduced = _reduced(compressed, reduction, prescale_factor, postscale_factor)
        return compression.decompress(reduced, context)


@as_written
def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: Any = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = None, ignore_name_scope: bool = False,
                      name: str | None = None) -> list[Any]:
    """``allreduce`` of each tensor (tensors and ``IndexedSlices`` may be mixed)."""
    return [allreduce(tensor, average=average, device_dense=device_dense,
                      device_sparse=device_sparse, compression=compression, op=op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      process_set=process_set) for tensor in tensors]


def _reduced_slices(slices: tf.IndexedSlices, reduction: str, prescale: float,
                    postscale: float) -> tf.IndexedSlices:
    """Horovod's allreduce of ``IndexedSlices``: every rank's rows and indices gathered (an
    average divides the rows by the world size); other ops and scaling are refused."""
    if reduction == "adasum":
        raise NotImplementedError("The Adasum reduction does not support sparse tensors; pass "
                                  "sparse_as_dense=True to DistributedOptimizer")
    if reduction not in ("sum", "average"):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    values, indices = allgather(slices.values), allgather(slices.indices)
    if reduction == "average":
        values = values / tf.cast(size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _reduced(tensor: tf.Tensor, reduction: str, prescale: float, postscale: float) -> tf.Tensor:
    """The collectives' allreduce; its gradient is the incoming gradient reduced the same way
    (Horovod's)."""
    collectives = _collectives()
    if not tensor.dtype.is_floating:
        return collectives.allreduce(tensor, reduction, prescale, postscale)

    @tf.custom_gradient
    def reduce(value: tf.Tensor) -> Any:
        def gradient(upstream: tf.Tensor) -> tf.Tensor:
            return _reduced(upstream, reduction, prescale, postscale)

        return collectives.allreduce(value, reduction, prescale, postscale), gradient

    return reduce(tensor)


@as_written
def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = None) -> tf.Tensor:
    """Every rank's tensor concatenated along the first dimension (which may differ between
    ranks), in rank order. Gradient (Horovod's): the incoming gradient averaged over ranks,
    this rank's rows of it."""
    _global_only(process_set)
    collectives = _collectives()
    tensor = tf.convert_to_tensor(tensor)
    if not tensor.dtype.is_floating:
        return collectives.allgather(tensor)

    @tf.custom_gradient
    def gather(value: tf.Tensor) -> Any:
        def gradient(upstream: tf.Tensor) -> tf.Tensor:
            averaged = _reduced(upstream, "average", 1.0, 1.0)
            firsts = collectives.allgather(tf.shape(value)[:1])
            start = tf.reduce_sum(firsts[:rank()])
            return averaged[start:start + firsts[rank()]]

        return collectives.allgather(value), gradient

    return gather(tensor)


@as_written
def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False, process_set: Any = None) -> list[Any]:
    return [allgather(tensor, process_set=process_set) for tensor in tensors]


@as_written
def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False, process_set: Any = None) -> tf.Tensor:
    """The root rank's tensor on every rank. Gradient (Horovod's): the incoming gradient
    averaged over ranks on the root, zero elsewhere."""
    _global_only(process_set)
    collectives = _collectives()
    tensor = tf.convert_to_tensor(tensor)
    if not tensor.dtype.is_floating:
        return collectives.broadcast(tensor, root_rank)

    @tf.custom_gradient
    def send(value: tf.Tensor) -> Any:
        def gradient(upstream: tf.Tensor) -> tf.Tensor:
            averaged = _reduced(upstream, "average", 1.0, 1.0)
            return averaged if rank() == root_rank else averaged * 0

        return collectives.broadcast(value, root_rank), gradient

    return send(tensor)


@as_written
def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: Any = None) -> list[Any]:
    """Horovod's in-place broadcast: every variable takes the root rank's value (checked as
    ``broadcast`` checks it); returns their new values (in a TensorFlow 1 graph, tensors whose
    evaluation runs the broadcast)."""
    _global_only(process_set)
    collectives = _collectives()
    return [variable.assign(collectives.broadcast(variable, root_rank))
            for variable in variables]


@as_written
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False, process_set: Any = None) -> Any:
    """Rank r's ``splits[d]`` rows go to rank d (equal parts without ``splits``). Returns the
    rows received, and with ``splits`` also how many came from each rank. Gradient
    (Horovod's): the incoming gradient sent back the way the rows came."""
    _global_only(process_set)
    collectives = _collectives()
    tensor = tf.convert_to_tensor(tensor)
    received: list[tf.Tensor] = []

    def exchange(value: tf.Tensor) -> tf.Tensor:
        rows, counts = collectives.alltoall(value, splits)
        received.append(counts)
        return rows

    if tensor.dtype.is_floating:
        @tf.custom_gradient
        def differentiable(value: tf.Tensor) -> Any:
            rows = exchange(value)
            counts = received[0]
            return rows, lambda upstream: alltoall(upstream, counts)[0]

        rows = differentiable(tensor)
    else:
        rows = exchange(tensor)
    return rows if splits is None else (rows, received[0])


@as_written
def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: Any = Average, name: str | None = None, process_set: Any = None,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Combine across ranks, each rank keeping its share of the first dimension. Gradient
    (Horovod's): the incoming gradient, multiplied by the world size for Sum and by the
    factors, gathered from every rank."""
    _global_only(process_set)
    reduction = op_name(op)
    if reduction == "adasum":
        raise core.refused("op=hvd.Adasum")
    collectives = _collectives()
    with tf.device(device_dense):
        compressed, context = compression.compress(tf.convert_to_tensor(tensor))

        def scatter(value: tf.Tensor) -> tf.Tensor:
            return collectives.reducescatter(value, reduction, prescale_factor,
                                             postscale_factor)

        if not compressed.dtype.is_floating:
            return compression.decompress(scatter(compressed), context)

        @tf.custom_gradient
        def differentiable(value: tf.Tensor) -> Any:
            def gradient(upstream: tf.Tensor) -> tf.Tensor:
                factor = prescale_factor * postscale_factor * (
                    size() if reduction == "sum" else 1)
                return allgather(upstream * tf.cast(factor, upstream.dtype))

            return scatter(value), gradient

        return compression.decompress(differentiable(compressed), context)


@as_written
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Any]:
    return [reducescatter(tensor, device_dense=device_dense, compression=compression, op=op,
                          process_set=process_set, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor) for tensor in tensors]


# --- objects -------------------------------------------------------------------------------

def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: Any = None) -> Any:
    _global_only(process_set)
    return core.collectives().broadcast_object(obj, root_rank)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: Any = None) -> list[Any]:
    _global_only(process_set)
    return core.collectives().allgather_object(obj)
