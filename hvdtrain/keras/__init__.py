"""Horovod's ``horovod.tensorflow.keras`` API on Keras 3 (TensorFlow >= 2.16).

Change ``import horovod.tensorflow.keras as hvd`` to ``import hvdtrain.keras as hvd``: the
process facts, ops and compression are the backend's (via ``hvdtrain.tensorflow``: Horovod's
own on Horovod); ``DistributedOptimizer``, the callbacks and the elastic state are written for
Keras 3 on the trainer's collectives. ``hvdtrain/dropin/README.md`` lists what differs, and
what the TensorFlow backend refuses.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hvdtrain.dropin.core import DistributedOptimizer
from hvdtrain.keras import callbacks, elastic
from hvdtrain import tensorflow as _hvd_tf
from hvdtrain.tensorflow import (Adasum, Average, Compression, Sum, broadcast_global_variables,
                                 ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                                 gloo_built, gloo_enabled, init, is_initialized, local_rank,
                                 local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                                 nccl_built, rank, rocm_built, shutdown, size, start_timeline,
                                 stop_timeline)

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Sum", "allgather", "allreduce",
    "broadcast", "broadcast_global_variables", "callbacks", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "elastic", "gloo_built", "gloo_enabled", "init",
    "is_initialized", "load_model", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "rocm_built", "shutdown",
    "size", "start_timeline", "stop_timeline",
]


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: Any = Compression.none) -> tf.Tensor:
    """Reduce a tensor-compatible value (number, array) across ranks; averaged by default."""
    return _hvd_tf.allreduce(tf.constant(value, name=name), average=average,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             op=op, compression=compression)


def allgather(value: Any, name: str | None = None) -> tf.Tensor:
    """Concatenate every rank's value along the first dimension, in rank order."""
    return _hvd_tf.allgather(tf.constant(value, name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    """The root rank's value on every rank."""
    return _hvd_tf.broadcast(tf.constant(value, name=name), root_rank)


def reducescatter(value: Any, name: str | None = None, op: Any = Average) -> tf.Tensor:
    """Reduce across ranks and give each rank its slice of the first dimension."""
    return _hvd_tf.reducescatter(tf.constant(value, name=name), op=op)


def load_model(filepath: Any, custom_optimizers: list[type] | None = None,
               custom_objects: dict[str, Any] | None = None,
               compression: Any = Compression.none) -> keras.Model:
    """Load a saved Keras 3 model (``.keras``) whose optimizer becomes a
    ``DistributedOptimizer`` with its saved state (slots, step counter) kept.

    The file holds the plain optimizer (a DistributedOptimizer saves as its own class), so
    ``custom_optimizers`` is only needed for optimizer classes Keras cannot find by itself;
    they and ``custom_objects`` are passed on to Keras.
    """
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or []})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        DistributedOptimizer(optimizer, compression=compression)   # in place, state kept
    return model
