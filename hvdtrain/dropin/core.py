"""What the Horovod drop-in's two APIs share: the backend, the collectives ``init()`` opens,
Horovod's gradient arguments as the trainer's ``GradientReduction``, and
``DistributedOptimizer``; kept below ``hvdtrain.tensorflow`` and ``hvdtrain.keras`` so that
neither imports the other.

The backend is chosen when the drop-in is first imported, by the rule of ``--backend auto``,
not at ``init()``, because a script binds ``hvd.Sum`` or ``hvd.rank`` before it calls
``init()`` and on Horovod those are Horovod's own objects. On the TensorFlow backend nothing
here imports Horovod, and what needs it (join, Adasum, process sets, elastic, the timeline) is
``refused`` in one line.
"""

from __future__ import annotations

from typing import Any, Sequence

import keras

from hvdtrain.collectives import Collectives, GradientReduction, World, chosen_backend
from hvdtrain.collectives.horovod_backend import HorovodCollectives, horovod_tensorflow
from hvdtrain.errors import UserError
from hvdtrain.dropin import ops
from hvdtrain.log import for_run, logger
from hvdtrain.optimizers.reduction import reducing_class as optimizer_reducing_class
from hvdtrain.optimizers.run_class import become

BACKEND, BACKEND_WHY = chosen_backend("auto")
_ops: Any = horovod_tensorflow() if BACKEND == "horovod" else ops
Average = _ops.Average
Sum = _ops.Sum
Adasum = _ops.Adasum
Min = _ops.Min
Max = _ops.Max
Product = _ops.Product
Compression = _ops.Compression

_REDUCTIONS = ("average", "sum", "adasum")
_session: Collectives | None = None
_homogeneous = True


def refused(what: str) -> UserError:
    """The one-line error for what only the Horovod backend does (raise it)."""
    why = "HVDTRAIN_BACKEND=tensorflow" if BACKEND_WHY == "as asked" else BACKEND_WHY
    return UserError(f"{what} needs the Horovod backend, and this job runs on TensorFlow's "
                     f"collectives ({why}); install Horovod (launch/setup.sh) and unset "
                     "HVDTRAIN_BACKEND")


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Horovod's ``init`` (same arguments), with hvdtrain's runtime defaults for MPI and
    Horovod (stall check; on CPU, yielding MPI waits and a short cycle time). On the
    TensorFlow backend: joins the job's TensorFlow cluster (the first time in the process;
    before any TensorFlow tensor exists) with this rank's GPU pinned (``_pin_gpu``), eagerly
    wherever it is called (a TensorFlow 1 graph is only where the script is at the time)."""
    global _session, _homogeneous
    if BACKEND == "horovod":
        _session = HorovodCollectives(comm=comm, process_sets=process_sets)
        return
    if comm is not None:
        raise refused("hvd.init(comm=...)")
    if process_sets is not None:
        raise refused("Process sets")
    from hvdtrain.collectives.tensorflow_backend import tensorflow_collectives
    from hvdtrain.collectives.tf_graph_mode import eagerly

    with eagerly():       # also when init() is called inside a TensorFlow 1 graph
        collectives = tensorflow_collectives(_pin_gpu)
        collectives.chosen = BACKEND_WHY
        _homogeneous = len(set(collectives.allgather_object(collectives.world.local_size))) == 1
    if collectives.world.is_chief and BACKEND_WHY != "as asked":
        # A Horovod script runs on another backend than it names: a warning, said once, on
        # stderr where the script configured no logging (hvdtrain.log).
        with for_run("INFO", collectives.world.rank):
            logger.warning(f"TensorFlow's collectives, not Horovod ({BACKEND_WHY})")
    _session = collectives


def _pin_gpu(world: World) -> None:
    """What Horovod scripts do right after ``init()``: memory growth on every GPU, then only
    the local rank's GPU visible. On the TensorFlow backend the runtime starts inside
    ``init()``, after which TensorFlow refuses changes, so it is done first; the script's own
    calls, asking for the same, then change nothing."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    try:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        if gpus:
            tf.config.set_visible_devices(gpus[world.local_rank % len(gpus)], "GPU")
    except RuntimeError:
        # The runtime exists already: a tensor came first (the cluster's start then says so
        # in one line), or this is a second init() in the process (the pinning stands).
        pass


def collectives() -> Collectives:
    """The collectives behind the drop-in API; ``init()`` must have run."""
    if _session is None:
        raise ValueError("Horovod has not been initialized; run hvd.init() first")
    return _session


def is_open() -> bool:
    """Whether ``init()`` has run (and ``close()`` has not since)."""
    return _session is not None


def close() -> None:
    """Forget the session (the TensorFlow backend's ``shutdown``): the process's cluster stays
    up for the other ranks, and a later ``init()`` joins it again."""
    global _session
    _session = None


def homogeneous() -> bool:
    """Whether every node runs the same number of ranks (learnt by the TensorFlow backend's
    ``init()``)."""
    collectives()
    return _homogeneous


def gradient_reduction(op: Any = Average, compression: Any = Compression.none,
                       sparse_as_dense: bool = False,
                       gradient_predivide_factor: float = 1.0) -> GradientReduction:
    """Horovod's gradient arguments (Horovod's ops and compressors or ours) as the trainer's
    ``GradientReduction``."""
    reduction = ops.op_name(op)
    if reduction not in _REDUCTIONS:
        raise ValueError("op must be hvd.Average, hvd.Sum or hvd.Adasum")
    if reduction == "adasum" and BACKEND != "horovod":
        raise refused("op=hvd.Adasum")
    if gradient_predivide_factor != 1.0 and reduction != "average":
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    return GradientReduction(reduction, ops.compression_name(compression),
                             prescale=1.0 / gradient_predivide_factor,
                             postscale=gradient_predivide_factor,
                             sparse_as_dense=sparse_as_dense)


def reduce_gradients(gradients: Sequence[Any], reduction: GradientReduction,
                     variables: Sequence[Any] = ()) -> list[Any]:
    """Combine gradients across ranks (None stays None): the trainer's reduction (of the
    gradients alone: the drop-in keeps no state per variable, so ``variables`` is not read)."""
    return collectives().reduce_gradients(list(gradients), reduction)


def reducing_class(optimizer_class: type, reduction: GradientReduction, passes: int,
                   average_passes: bool) -> type:
    """The subclass of ``optimizer_class`` that reduces gradients so, through the drop-in's
    collectives (one per setting): ``hvdtrain.optimizers.reduction``, the same
    mechanism the trainer uses for a model's own ``train_step``."""
    return optimizer_reducing_class(optimizer_class, reduction, passes, average_passes,
                                    reduce_gradients)


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = Average,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False
                         ) -> keras.optimizers.Optimizer:
    """Horovod's ``DistributedOptimizer`` on any Keras 3 optimizer: the optimizer passed in,
    made distributed by changing only its class, so its schedule, variables and attributes stay
    (Horovod rebuilds it from ``get_config``, which fails for a schedule without one). Called
    again, the new settings replace the old. ``name``: its new name.

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
    become(optimizer, lambda cls: reducing_class(cls, reduction, int(backward_passes_per_step),
                                                 bool(average_aggregated_gradients)))
    if name is not None:
        optimizer.name = name
    return optimizer
