"""What the Horovod drop-in's two APIs share: the collectives ``init()`` opens, Horovod's
gradient arguments as the trainer's ``GradientReduction``, and ``DistributedOptimizer``.

``hvdtrain.tensorflow`` and ``hvdtrain.keras`` both offer these (as Horovod's two APIs do), and
``hvdtrain.keras`` re-exports much of ``hvdtrain.tensorflow``. Kept here, below both, they need
nothing from each other in return: either API imports first, and neither imports the other
while it loads.
"""

from __future__ import annotations

from typing import Any, Sequence

import keras

from hvdtrain.training import distributed_optimizer
from hvdtrain.world import GradientReduction, HorovodCollectives, horovod_tensorflow

_hvd = horovod_tensorflow()
Average = _hvd.Average
Sum = _hvd.Sum
Adasum = _hvd.Adasum
Compression = _hvd.Compression

_OPS = {Average: "average", Sum: "sum", Adasum: "adasum"}
_session: HorovodCollectives | None = None


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Horovod's ``init`` (same arguments), with hvdtrain's runtime defaults for MPI and
    Horovod (stall check; on CPU, yielding MPI waits and a short cycle time)."""
    global _session
    _session = HorovodCollectives(comm=comm, process_sets=process_sets)


def collectives() -> HorovodCollectives:
    """The collectives behind the drop-in API; ``init()`` must have run."""
    if _session is None:
        raise ValueError("Horovod has not been initialized; run hvd.init() first")
    return _session


def gradient_reduction(op: Any = Average, compression: Any = Compression.none,
                       sparse_as_dense: bool = False,
                       gradient_predivide_factor: float = 1.0) -> GradientReduction:
    """Horovod's gradient arguments as the trainer's ``GradientReduction``."""
    if op not in _OPS:
        raise ValueError("op must be hvd.Average, hvd.Sum or hvd.Adasum")
    if compression not in (Compression.none, Compression.fp16):
        raise ValueError("compression must be hvd.Compression.none or hvd.Compression.fp16")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    return GradientReduction(_OPS[op], compression is Compression.fp16,
                             prescale=1.0 / gradient_predivide_factor,
                             postscale=gradient_predivide_factor,
                             sparse_as_dense=sparse_as_dense)


def reduce_gradients(gradients: Sequence[Any], reduction: GradientReduction) -> list[Any]:
    """Combine gradients across ranks (None stays None): the trainer's reduction."""
    return collectives().reduce_gradients(list(gradients), reduction)


def reducing_class(optimizer_class: type, reduction: GradientReduction, passes: int,
                   average_passes: bool) -> type:
    """The subclass of ``optimizer_class`` that reduces gradients so, through the drop-in's
    collectives (one per setting): ``hvdtrain.training.distributed_optimizer``, the same
    mechanism the trainer uses for a model's own ``train_step``."""
    return distributed_optimizer.reducing_class(optimizer_class, reduction, passes,
                                                average_passes, reduce_gradients)


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = Average,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False
                         ) -> keras.optimizers.Optimizer:
    """Horovod's ``DistributedOptimizer`` on any Keras 3 optimizer (including
    ``LossScaleOptimizer`` and optimizers with a learning-rate schedule): a new optimizer of
    the same class and configuration; the one passed in is left as it was.

    op: ``Average`` (default), ``Sum`` or ``Adasum``; compression: ``Compression.none`` or
    ``Compression.fp16``; sparse_as_dense: densify ``IndexedSlices`` gradients before the
    allreduce (else they are allgathered); gradient_predivide_factor f: divide by f before the
    sum and by size/f after it; backward_passes_per_step k: reduce and apply every k-th call
    the sum of the k calls' gradients, divided by k if ``average_aggregated_gradients``.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer wraps a Keras 3 optimizer, got {optimizer!r}")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be > 0")
    reduction = gradient_reduction(op, compression, sparse_as_dense, gradient_predivide_factor)
    cls = reducing_class(type(optimizer), reduction, int(backward_passes_per_step),
                         bool(average_aggregated_gradients))
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return cls.from_config(config)
