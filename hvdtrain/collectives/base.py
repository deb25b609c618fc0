"""What every backend offers: the ``Collectives`` protocol, how gradients are combined
(``GradientReduction``), the world of one (``LocalCollectives``), and the facts the backends share
(a peer's departure, Keras variables' TensorFlow variables)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from hvdtrain.builtin_names import COMPRESSIONS
from hvdtrain.collectives.world import World
from hvdtrain.errors import (AgreedError, CheckpointWriteFailed, StoppedBySignal, TrainingDiverged,
                             UserError)


@dataclass(frozen=True)
class GradientReduction:
    """How gradients are combined across ranks: the one description that the trainer's step and
    the Horovod drop-in (``hvdtrain.keras.DistributedOptimizer``,
    ``hvdtrain.tensorflow.DistributedGradientTape``) hand to ``reduce_gradients``.

    ``op`` is "sum", "average" (Horovod divides by the current world size, so it follows an
    elastic world) or "adasum". Each rank's tensors are multiplied by ``prescale`` before they
    are combined and the result by ``postscale`` (Horovod's ``gradient_predivide_factor`` f is
    prescale 1/f, postscale f). ``compression`` "fp16" or "bf16" halves the bytes on the wire:
    each rank's float32 (or float64) tensors travel rounded to float16 or bfloat16 (``on_wire``)
    and come back in their own type. bfloat16 keeps float32's exponent range (no overflow, no
    loss scaling) with 8 bits of mantissa (~3 significant digits) where float16 has 11 and
    overflows past 65504; both are approximate (N ranks x batch b is no longer exactly 1 x N*b).
    Sparse gradients (``tf.IndexedSlices``, e.g. of an embedding) are gathered, not summed,
    unless ``sparse_as_dense`` turns them into dense tensors first.

    ``bucket_bytes`` > 0 splits the dense gradients into buckets of about that many bytes,
    filled from the end of the list (the last layers' gradients, which the backward pass
    computes first), one grouped allreduce each: in a ``tf.function`` each bucket's allreduce
    starts as soon as its own gradients exist, while the backward pass still computes the
    earlier layers' (see ``buckets``). 0 keeps one group for everything. ``in_issue_order``
    submits each bucket only once the one issued before it has completed (``submitted_after``),
    so every rank submits them in one order.
    """

    op: str = "sum"
    compression: str = "none"
    prescale: float = 1.0
    postscale: float = 1.0
    sparse_as_dense: bool = False
    bucket_bytes: int = 0
    in_issue_order: bool = False

    def __post_init__(self) -> None:
        if self.op not in ("sum", "average", "adasum"):
            raise ValueError(f"gradient reduction op must be sum, average or adasum, not {self.op}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, not "
                             f"{self.compression}")
        if self.compression == "bf16" and self.op == "adasum":
            raise ValueError("bf16 cannot travel with adasum (Horovod's Adasum takes no "
                             "bfloat16)")
        if self.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be 0 (one group) or more, not {self.bucket_bytes}")

    def on_wire(self, tensor: Any) -> Any:
        """``tensor`` as it travels: a float32 or float64 one cast to the compression's type
        (float16, bfloat16), any other as it is (integers must stay exact, and a float16 or
        bfloat16 gradient is already as small)."""
        import tensorflow as tf

        if self.compression == "none" or tensor.dtype not in (tf.float32, tf.float64):
            return tensor
        return tf.cast(tensor, tf.float16 if self.compression == "fp16" else tf.bfloat16)

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
            filled += static_bytes(tensors[index])
            if filled >= self.bucket_bytes:
                found.append(current)
                current, filled = [], 0
        if current:
            found.append(current)
        return found

    def submitted(self, previous: Sequence[Any], tensors: Sequence[Any]) -> list[Any]:
        """``tensors`` as the next bucket's collective takes them: after ``previous`` (the
        results of the bucket issued before) when ``in_issue_order``, as they are otherwise."""
        return submitted_after(previous, tensors) if self.in_issue_order else list(tensors)

    def describe(self, variables: Sequence[Any], all_at_once: str = "") -> str:
        """One line for the run's log: how the gradients of ``variables`` will travel;
        ``all_at_once``: why every gradient exists before the first bucket leaves (summed over
        micro-steps first, or one XLA computation), so none overlaps the backward pass."""
        total = sum(static_bytes(v) for v in variables) / 2**20
        count = len(self.buckets(variables))
        if self.bucket_bytes == 0:
            return f"gradients: {total:.2f} MiB in one allreduce after the backward pass"
        when = (f"all at once ({all_at_once}: no overlap)" if all_at_once else
                "each sent once the one before has completed (one order on every rank)"
                if self.in_issue_order else "each sent once the backward pass has computed it")
        return (f"gradients: {total:.2f} MiB in {count} bucket(s) of about "
                f"{self.bucket_bytes / 2**20:g} MiB, {when}")


def submitted_after(previous: Sequence[Any], tensors: Sequence[Any]) -> list[Any]:
    """``tensors``, which in a ``tf.function`` exist only once ``previous`` (the results of the
    collective issued before) do: the next collective is then submitted after that one has
    completed, so every rank submits a step's collectives in the order they were issued.

    Without it TensorFlow's executor starts a bucket's allreduce as soon as its gradients
    exist, and two ranks that compute the backward pass in different orders submit buckets in
    different orders; Horovod runs a collective only once every rank has submitted it, so each
    waits for the other's submissions. With it every bucket also waits for the one issued
    before it, which holds the output layer's gradient that TensorFlow computes last (see
    hvdtrain/bench/README.md, "Submission order"): on one machine that was faster, over a
    1 Gbit/s link slower, so it is ``--bucket-order issued``, not the default. Eagerly every
    op already runs in program order, and nothing is added."""
    import tensorflow as tf

    if not previous or tf.executing_eagerly():
        return list(tensors)
    with tf.control_dependencies(list(previous)):
        return [tf.identity(tensor) for tensor in tensors]


def positions_by_dtype(tensors: Sequence[Any]) -> list[list[int]]:
    """The tensors' positions grouped by dtype (one collective carries each group)."""
    groups: dict[Any, list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(index)
    return list(groups.values())


def static_bytes(tensor: Any) -> int:
    """Bytes of a tensor or variable (TensorFlow's or Keras') whose shape is known when the
    graph is built (0 otherwise)."""
    import tensorflow as tf

    elements = tf.TensorShape(tensor.shape).num_elements()
    return 0 if elements is None else elements * tf.as_dtype(tensor.dtype).size


def variable_bytes(variables: Sequence[Any]) -> int:
    """Bytes of Keras or TensorFlow variables (or tensors) of known shapes."""
    return sum(static_bytes(v) for v in variables)


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

    def reduce_scatter_sum(self, tensors: Sequence[Any]) -> list[Any]:
        """Sum each 1-D tensor (its length a multiple of the world size) across ranks and keep
        this rank's part of the sum: the ``rank``-th of ``size`` equal pieces (graph-safe)."""

    def allgather(self, tensors: Sequence[Any]) -> list[Any]:
        """Each 1-D tensor (of one length on every rank) concatenated over the ranks, in rank
        order (graph-safe)."""

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
                scaled_rows(t, scale) if isinstance(t, tf.IndexedSlices) else t * scale
                for t in tensors]

    def reduce_scatter_sum(self, tensors: Sequence[Any]) -> list[Any]:
        return list(tensors)

    def allgather(self, tensors: Sequence[Any]) -> list[Any]:
        return list(tensors)

    def broadcast_variables(self, variables: Sequence[Any], root_rank: int = 0) -> None:
        return None

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        return obj

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def shutdown(self) -> None:
        return None


# What TensorFlow's collectives say when another rank stopped answering without ending (a
# lost node or link): its coordination service's heartbeats.
UNREACHABLE_MARKERS = ("stopped sending heartbeats",)
# What a collective's error says on this rank when another rank has left the job: Horovod's
# (the other rank shut it down), TensorFlow's (its collectives aborted by the other rank's
# report, its connection gone, or it stopped answering).
PEER_GONE_MARKERS = ("Horovod has been shut down", "Collective ops is aborted by",
                     "Socket closed", "Connection reset by peer", *UNREACHABLE_MARKERS,
                     "failed to connect to all addresses")


def peer_unreachable(error: BaseException) -> bool:
    """True for a collective's error that says another rank stopped answering rather than
    ended (``Liveness.peer_unreachable`` then ends this rank as from a stall)."""
    return any(marker in str(error) for marker in UNREACHABLE_MARKERS)


def ended_by_another_rank(error: BaseException) -> bool:
    """True for the error a collective raises on this rank when another rank has left the job
    (it failed, reported why, and shut its collectives down as its process ended): this rank
    has nothing to add to that report."""
    return any(marker in str(error) for marker in PEER_GONE_MARKERS)


def chief_decides(collectives: Collectives, decide: Callable[[], Any]) -> Any:
    """Run ``decide`` on rank 0 and give every rank its result, or raise its error everywhere.

    Rank 0 alone reads the file system for these decisions; a user error found there must stop
    every rank with the same message rather than leave the others waiting in a collective.
    """
    outcome: tuple[Any, str] = (None, "")
    if collectives.world.is_chief:
        try:
            outcome = (decide(), "")
        except UserError as error:
            outcome = (None, str(error))
    value, message = collectives.broadcast_object(outcome)
    if message:
        raise AgreedError(message)
    return value


def gathered_at_chief(collectives: Collectives, obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank 0, None elsewhere: each rank broadcasts its
    own in turn and the others drop what they receive, so a rank holds at most two ranks'
    objects at once (an allgather would hold all of them on every rank: a checkpoint's
    per-rank state, PowerSGD's error buffers among it, is as large as the gradients)."""
    kept: list[Any] = []
    for root in range(collectives.world.size):
        mine = obj if collectives.world.rank == root else None
        received = collectives.broadcast_object(mine, root_rank=root)
        if collectives.world.is_chief:
            kept.append(received)
    return kept if collectives.world.is_chief else None


def summed_across_ranks(collectives: Collectives, variables: Sequence[Any]) -> list[Any]:
    """The sum over ranks of each variable's value (one grouped allreduce)."""
    import tensorflow as tf

    return collectives.allreduce_sum([tf.convert_to_tensor(v) for v in variables])


def differentiable_sum(collectives: Collectives, tensors: Sequence[Any]) -> list[Any]:
    """Each tensor summed across ranks (one grouped allreduce), with a gradient: the sum across
    ranks of the upstream gradients. A sum that every rank's loss uses (synchronized
    batch-norm statistics) must send each rank's share of every rank's loss back to its
    inputs, which summing the upstream gradients does; a rank's own upstream alone would leave
    out the others' terms. Eagerly, in a ``tf.function`` and under Keras ``fit``; every rank
    must take the same forward and backward collectives, as with any collective."""
    import tensorflow as tf

    @tf.custom_gradient
    def summed(*values: Any) -> Any:
        def backward(*upstream: Any) -> list[Any]:
            return collectives.allreduce_sum([tf.zeros_like(v) if u is None else u
                                              for u, v in zip(upstream, values)])

        return collectives.allreduce_sum(list(values)), backward

    return list(summed(*[tf.convert_to_tensor(t) for t in tensors])) if tensors else []


def gathered_rows(collectives: Collectives, values: Any, differentiable: Any, count: Any,
                  capacity: Any) -> tuple[Any, Any]:
    """Every rank's first ``count`` rows of each tensor in ``values`` and in ``differentiable``
    (two structures), concatenated in rank order: the global batch, on every rank, in one
    all-gather (each rank's rows padded to the longest ``capacity``). ``differentiable``'s
    gradient is this rank's rows of the upstream gradient: every rank computes the same loss
    of the global batch, so the ranks' gradients, summed, are its gradient once."""
    import tensorflow as tf

    size, rank = collectives.world.size, collectives.world.rank
    facts = tf.stack([tf.cast(count, tf.int64), tf.cast(capacity, tf.int64)])
    counts, capacities = tf.unstack(tf.reshape(collectives.allgather([facts])[0], [size, 2]),
                                    axis=1)
    longest = tf.reduce_max(capacities)
    real = tf.reshape(tf.range(longest)[tf.newaxis, :] < counts[:, tf.newaxis], [-1])
    offset = tf.reduce_sum(counts[:rank])
    plain, trained = tf.nest.flatten(values), tf.nest.flatten(differentiable)

    def padded(value: Any) -> Any:
        rows = value[:count]
        pad = [[0, longest - tf.cast(tf.shape(rows)[0], tf.int64)]] + [[0, 0]] * (
            len(value.shape) - 1)
        return tf.reshape(tf.pad(rows, tf.cast(pad, tf.int32)), [-1])

    def everyone(tensors: list[Any]) -> list[Any]:
        """Each tensor's global rows (a None, an absent sample weight, stays None)."""
        present = [t for t in tensors if t is not None]
        flat = iter(collectives.allgather([padded(t) for t in present]) if present else [])
        return [None if t is None else tf.boolean_mask(tf.reshape(next(flat), tf.concat(
            [[size * longest], tf.shape(t, out_type=tf.int64)[1:]], 0)), real)
            for t in tensors]

    @tf.custom_gradient
    def gathered(*tensors: Any) -> Any:
        outputs = everyone(list(tensors))

        def backward(*upstream: Any) -> list[Any]:
            return [tf.zeros_like(t) if u is None else
                    tf.pad(u[offset:offset + tf.cast(count, tf.int64)],
                           [[0, tf.shape(t)[0] - tf.cast(count, tf.int32)]]
                           + [[0, 0]] * (len(t.shape) - 1))
                    for u, t in zip(upstream, tensors)]

        return outputs, backward

    def shaped(outputs: list[Any], tensors: list[Any]) -> list[Any]:
        """The static shapes the gather (and a custom gradient's identity) leaves unknown: the
        rows unknown, the rest each tensor's own."""
        for output, tensor in zip(outputs, tensors):
            if output is not None and tensor.shape.rank is not None:
                output.set_shape([None, *tensor.shape[1:]])
        return outputs

    global_plain = shaped(everyone(plain), plain)
    present = [t for t in trained if t is not None]
    outputs = iter(shaped(list(gathered(*present)), present) if present else [])
    global_trained = [None if t is None else next(outputs) for t in trained]
    return (tf.nest.pack_sequence_as(values, global_plain),
            tf.nest.pack_sequence_as(differentiable, global_trained))


def assign_across_ranks(collectives: Collectives, variables: Sequence[Any],
                        mean: bool = False) -> None:
    """Give each variable the sum over ranks of its value (``mean``: that sum divided by the
    world size), the same on every rank: how metric state becomes the global metric and
    batch-norm statistics the average of the ranks'."""
    totals = summed_across_ranks(collectives, variables)
    for variable, total in zip(variables, totals):
        variable.assign(total / collectives.world.size if mean else total)


def raised_here(error: BaseException) -> bool:
    """Whether an error began on this rank (the user's code, a one-rank mistake) while its
    peers may wait for it in a collective, rather than in a collective (a peer's process is
    gone: shutting Horovod down then waits on it, until Slurm kills the rank, measured) or by
    agreement of every rank (a stop, a divergence, a failed checkpoint write, a refusal all
    ranks reached together)."""
    import tensorflow as tf

    if isinstance(error, (StoppedBySignal, TrainingDiverged, CheckpointWriteFailed,
                          AgreedError)):
        return False
    return ("Horovod" not in str(error) and not ended_by_another_rank(error)
            and not isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError)))


def scaled_rows(gathered: Any, scale: float) -> Any:
    """Horovod's reduced sparse gradient: every rank's rows, concatenated in rank order, each
    index as often as it occurs. That is the gradient one process computes over the whole
    global batch, so the optimizer sees what Keras would give it there: Keras 3 optimizers
    apply ``IndexedSlices`` row by row (Adam and RMSprop square each row), and summing repeated
    rows first would change the update (measured: 1e-3 apart after one RMSprop step)."""
    import tensorflow as tf

    if scale == 1.0:
        return gathered
    return tf.IndexedSlices(gathered.values * scale, gathered.indices, gathered.dense_shape)


def tf_variables(variables: Sequence[Any]) -> list[Any]:
    """The TensorFlow variables behind Keras 3 variables (what Horovod's broadcast assigns);
    TensorFlow variables pass through."""
    import keras

    return [v.value if isinstance(v, keras.Variable) else v for v in variables]
