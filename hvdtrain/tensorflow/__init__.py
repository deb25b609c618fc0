"""Horovod's ``horovod.tensorflow`` API on Keras 3 (TensorFlow >= 2.16), on Horovod or on
TensorFlow's own collectives.

Change ``import horovod.tensorflow as hvd`` to ``import hvdtrain.tensorflow as hvd`` and a
Horovod script runs on current TensorFlow, where upstream 0.28.1 fails at the first step (Keras 3
variables are not ``tf.Variable``). On the Horovod backend the names that need no change are
Horovod's own; those that touch variables or gradients go through the trainer's collectives, so
trainer and drop-in share one gradient reduction and one broadcast. On the TensorFlow backend the
names come from ``hvdtrain.dropin.tf_ops`` and Horovod is not imported.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Sequence

import tensorflow as tf

from hvdtrain.dropin import core, tf_ops
from hvdtrain.collectives import GradientReduction, tf_variables
from hvdtrain.collectives.horovod_backend import horovod_tensorflow
from hvdtrain.dropin.tf_ops import as_written
from hvdtrain.errors import UserError
from hvdtrain.keras_internals import copy_as
from hvdtrain.tensorflow import elastic, util  # noqa: F401  (hvd.elastic, hvd.util)
from hvdtrain.tensorflow.util import _executing_eagerly  # noqa: F401  (as Horovod has it)

_hvd: ModuleType = horovod_tensorflow() if core.BACKEND == "horovod" else tf_ops

# The backend's own names: process facts, build facts and the collectives that take tensors
# (Keras 3 tensors are TensorFlow tensors); on Horovod, Horovod's objects unchanged.
shutdown = _hvd.shutdown
is_initialized = _hvd.is_initialized
start_timeline = _hvd.start_timeline
stop_timeline = _hvd.stop_timeline
size = _hvd.size
local_size = _hvd.local_size
cross_size = _hvd.cross_size
rank = _hvd.rank
local_rank = _hvd.local_rank
cross_rank = _hvd.cross_rank
is_homogeneous = _hvd.is_homogeneous
size_op = _hvd.size_op
rank_op = _hvd.rank_op
local_size_op = _hvd.local_size_op
local_rank_op = _hvd.local_rank_op
mpi_threads_supported = _hvd.mpi_threads_supported
mpi_enabled = _hvd.mpi_enabled
mpi_built = _hvd.mpi_built
gloo_enabled = _hvd.gloo_enabled
gloo_built = _hvd.gloo_built
nccl_built = _hvd.nccl_built
ddl_built = _hvd.ddl_built
ccl_built = _hvd.ccl_built
cuda_built = _hvd.cuda_built
rocm_built = _hvd.rocm_built
allgather = _hvd.allgather
grouped_allgather = _hvd.grouped_allgather
broadcast = _hvd.broadcast
reducescatter = _hvd.reducescatter
grouped_reducescatter = _hvd.grouped_reducescatter
allgather_object = _hvd.allgather_object
broadcast_object = _hvd.broadcast_object
join = _hvd.join

# Reduction ops and compression: Horovod's on Horovod, hvdtrain.dropin.ops' (same values)
# otherwise.
Average = core.Average
Sum = core.Sum
Adasum = core.Adasum
Min = core.Min
Max = core.Max
Product = core.Product
Compression = core.Compression

# The drop-in's session and Horovod's gradient arguments, shared with hvdtrain.keras.
init = core.init
collectives = core.collectives
gradient_reduction = core.gradient_reduction
reduce_gradients = core.reduce_gradients


@as_written
def allreduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    """Horovod's ``allreduce`` (same arguments); also takes a Keras 3 variable."""
    return _hvd.allreduce(tf_variables([tensor])[0], *args, **kwargs)


@as_written
def grouped_allreduce(tensors: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
    """Horovod's ``grouped_allreduce`` (same arguments); also takes Keras 3 variables."""
    return _hvd.grouped_allreduce(tf_variables(list(tensors)), *args, **kwargs)


@as_written
def alltoall(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    """Horovod's ``alltoall`` (same arguments). A scalar is refused with ValueError, as Horovod's
    shape check refuses it in a graph (Horovod 0.28.1's eager alltoall of a scalar crashes the
    process)."""
    if tf.convert_to_tensor(tensor).shape.rank == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension, not a scalar")
    return _hvd.alltoall(tensor, *args, **kwargs)


@as_written
def broadcast_(variables: Sequence[Any], root_rank: int, *args: Any, **kwargs: Any) -> Any:
    """Horovod's in-place ``broadcast_`` (same arguments): every variable (Keras 3 or
    TensorFlow) takes the root rank's value; returns their new values."""
    return _hvd.broadcast_(tf_variables(list(variables)), root_rank, *args, **kwargs)


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0) -> Any:
    """Overwrite ``variables`` (Keras 3 or TensorFlow: ``model.variables``,
    ``optimizer.variables``) with the root rank's values: eagerly, in a tf.function, or in a
    TensorFlow 1 graph, where the op that does it is returned (run it)."""
    done = collectives().broadcast_variables(list(variables), root_rank=root_rank)
    return tf.group() if done is None and not tf.executing_eagerly() else done


def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's: in a TensorFlow 1 graph, the op that broadcasts every global variable
    (``tf.compat.v1.global_variables()``) from ``root_rank``. Eagerly there are none, and it
    raises as Horovod does."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() works in a TensorFlow 1 graph "
                           "only; eagerly use hvd.broadcast_variables(model.variables, "
                           "root_rank) and hvd.broadcast_variables(optimizer.variables, "
                           "root_rank), or the Keras BroadcastGlobalVariablesCallback")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: Any = None) -> Any:
    """Horovod's TensorFlow 1 helper: a function that returns the root rank's object
    (``broadcast_object``, which needs no session here)."""
    where = {} if process_set is None else {"process_set": process_set}

    def broadcast(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, **where)

    return broadcast


def PartialDistributedGradientTape(*args: Any, **kwargs: Any) -> Any:
    """Refused in one line: a tape that leaves some variables' gradients local needs Horovod's
    local-variable registry, which the drop-in does not have."""
    raise UserError("hvd.PartialDistributedGradientTape is not supported by hvdtrain's "
                    "drop-in; use hvd.DistributedGradientTape and combine every gradient")


class _ReducingTape:
    """Mixed in before the user's tape class: gradients are combined across ranks."""

    _hvdtrain_reduction: GradientReduction

    def register_local_source(self, source: Any) -> None:
        """Refused in one line (Horovod's local gradients, not supported)."""
        raise UserError("DistributedGradientTape.register_local_source is not supported by "
                        "hvdtrain's drop-in: every gradient is combined across ranks")

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 **kwargs: Any) -> Any:
        gradients = super().gradient(target, sources, output_gradients, **kwargs)
        reduced = reduce_gradients(tf.nest.flatten(gradients), self._hvdtrain_reduction)
        return tf.nest.pack_sequence_as(gradients, reduced)


@functools.cache
def _reducing_tape_class(tape_class: type) -> type:
    return type(tape_class.__name__, (_ReducingTape, tape_class), {})


def DistributedGradientTape(gradtape: tf.GradientTape, compression: Any = Compression.none,
                            sparse_as_dense: bool = False, op: Any = Average,
                            gradient_predivide_factor: float = 1.0) -> tf.GradientTape:
    """The same tape (what it recorded, persistent or not), whose ``gradient`` returns the
    gradients combined across ranks (averaged by default), as Horovod's does."""
    tape = copy_as(gradtape, _reducing_tape_class(type(gradtape)))
    tape._hvdtrain_reduction = gradient_reduction(op, compression, sparse_as_dense,
                                                  gradient_predivide_factor)
    return tape


def DistributedOptimizer(optimizer: Any, name: str | None = None, **options: Any) -> Any:
    """The Keras 3 optimizer passed in, made distributed in place: its updates use gradients
    combined across ranks; the arguments are ``hvdtrain.keras.DistributedOptimizer``'s
    (Horovod's, by keyword)."""
    return core.DistributedOptimizer(optimizer, name=name, **options)
