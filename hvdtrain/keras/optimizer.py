"""``DistributedOptimizer`` for Keras 3: the user's optimizer, with gradients combined across
ranks before every update (``hvdtrain.training.distributed_optimizer``: the same mechanism the
trainer uses for a model's own ``train_step``), reduced by the drop-in's collectives.
"""

from __future__ import annotations

from typing import Any

import keras

from hvdtrain.tensorflow import Average, Compression, gradient_reduction, reduce_gradients
from hvdtrain.training import distributed_optimizer
from hvdtrain.world import GradientReduction


def reducing_class(optimizer_class: type, reduction: GradientReduction, passes: int,
                   average_passes: bool) -> type:
    """The subclass of ``optimizer_class`` that reduces gradients so, through the drop-in's
    collectives (one per setting)."""
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
