"""Horovod's tensor operations that the trainer does not need (allreduce with any op and
Horovod's scaling, allgather of differing first dimensions, broadcast, reducescatter, alltoall),
over the TensorFlow backend's raw collectives, each first agreed across ranks. ``tf_ops`` gives
them Horovod's names, arguments and gradients.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from hvdtrain.collectives.tensorflow_backend import TensorFlowCollectives, on_the_wire
from hvdtrain.collectives.tf_graph_mode import eagerly, in_session_graph


class TensorOperations:
    """Horovod's tensor operations that the trainer does not need, over the TensorFlow backend's
    raw collectives. Each starts with one small all-gather of every rank's description of its
    call (operation, op or root, dtype, shape): ranks that disagree then all get the same error,
    as Horovod's coordinator gives them, instead of a hang or a silently wrong result.
    TensorFlow's CPU collectives carry int32, int64, float16, float32 and float64 only; other
    types travel converted without loss (``on_the_wire``)."""

    _OPERATIONS = ("allreduce", "allgather", "broadcast", "reducescatter", "alltoall")
    _MERGE_OPS = {"sum": "Add", "average": "Add", "min": "Min", "max": "Max", "product": "Mul"}
    _DESCRIBED_DIMS = 8      # dimensions after the first compared one by one (more: multiplied)

    def __init__(self, backend: TensorFlowCollectives) -> None:
        self._backend = backend
        self.world = backend.world

    def allreduce(self, tensor: Any, op: str = "sum", prescale: float = 1.0,
                  postscale: float = 1.0) -> Any:
        """One tensor combined across ranks (same shape and dtype on every rank): op "sum",
        "average", "min", "max" or "product"; each rank's tensor multiplied by ``prescale``
        first, the result by ``postscale`` (by ``postscale / size`` for "average"), in
        Horovod's arithmetic (``_scaled``). Eager or in a tf.function."""
        return self._reduced("allreduce", tf.convert_to_tensor(tensor), op, prescale,
                             postscale)

    def allgather(self, tensor: Any) -> Any:
        """Every rank's tensor concatenated along the first dimension, in rank order. The
        first dimension may differ between ranks, the others may not: the tensors travel
        padded to the longest and are trimmed after. A scalar is refused, as Horovod does."""
        tensor = tf.convert_to_tensor(tensor)
        self._needs_a_dimension("allgather", tensor, tf.errors.FailedPreconditionError)
        firsts = self._first_dims("allgather", tensor, same_first=False)
        return self._backend.concatenated(tensor, firsts)

    def broadcast(self, tensor: Any, root_rank: int) -> Any:
        """The root rank's tensor on every rank (same shape and dtype on every rank)."""
        tensor = tf.convert_to_tensor(tensor)
        if not 0 <= root_rank < self.world.size:
            raise ValueError(f"root_rank {root_rank} is not a rank of this job of "
                             f"{self.world.size}")
        checked = self._first_dims("broadcast", tensor, detail=root_rank)
        wire, dtype = on_the_wire(tensor)
        with tf.control_dependencies([checked]):
            received = self._backend.broadcast_tensor(wire, root_rank)
        return tf.ensure_shape(tf.cast(received, dtype), tensor.shape)

    def reducescatter(self, tensor: Any, op: str = "sum", prescale: float = 1.0,
                      postscale: float = 1.0) -> Any:
        """Combined as ``allreduce`` combines it, then each rank keeps its share of the first
        dimension, in rank order (the first ``rows % size`` ranks one row more, as Horovod
        splits it). Done as an allreduce of the whole tensor: each rank receives ``size``
        times the bytes a true reduce-scatter would send it."""
        tensor = tf.convert_to_tensor(tensor)
        self._needs_a_dimension("reducescatter", tensor, tf.errors.InvalidArgumentError)
        total = self._reduced("reducescatter", tensor, op, prescale, postscale)
        rank, size = self.world.rank, self.world.size
        rows = tf.shape(total)[0]
        base, extra = rows // size, rows % size
        start = rank * base + tf.minimum(rank, extra)
        return total[start:start + base + tf.cast(rank < extra, tf.int32)]

    def alltoall(self, tensor: Any, splits: Any = None) -> tuple[Any, Any]:
        """Rank r sends its next ``splits[d]`` rows (along the first dimension, in order) to
        rank d; returns the rows every rank sent here, in rank order, and how many came from
        each rank (int32). Without ``splits`` the first dimension is divided equally. Done
        with all-gathers (every rank's splits, then every rank's whole tensor), so each rank
        receives ``size`` times the bytes a true all-to-all would send it."""
        tensor = tf.convert_to_tensor(tensor)
        size, rank = self.world.size, self.world.rank
        self._needs_a_dimension("alltoall", tensor)
        rows = tf.shape(tensor, out_type=tf.int64)[0]
        checks = []
        if splits is None:
            checks.append(tf.debugging.assert_equal(
                rows % size, tf.constant(0, tf.int64),
                message=f"alltoall without splits: the first dimension must divide by {size}"))
            splits = tf.fill([size], rows // size)
        splits = tf.cast(tf.reshape(splits, [-1]), tf.int64)
        checks.append(tf.debugging.assert_equal(tf.size(splits), size,
                                                message=f"alltoall: splits must have {size} "
                                                        "entries"))
        checks.append(tf.debugging.assert_equal(tf.reduce_sum(splits), rows,
                                                message="alltoall: splits must add up to the "
                                                        "first dimension"))
        # (Eagerly a failed check has raised already; in a tf.function it runs first.)
        with tf.control_dependencies([check for check in checks if check is not None]):
            firsts = self._first_dims("alltoall", tensor, same_first=False)
        sent = tf.reshape(self._backend.all_gather(splits), [size, size])     # [from rank, to rank]
        everything = self._backend.concatenated(tensor, firsts)
        starts = tf.cumsum(firsts, exclusive=True) + tf.reduce_sum(sent[:, :rank], axis=1)
        counts = sent[:, rank]
        mine = tf.concat([tf.range(starts[r], starts[r] + counts[r]) for r in range(size)], 0)
        received = tf.gather(everything, mine)
        received.set_shape(tf.TensorShape([None]).concatenate(everything.shape[1:]))
        return received, tf.cast(counts, tf.int32)

    def _needs_a_dimension(self, operation: str, tensor: Any, eager_error: Any = None) -> None:
        """Horovod's refusal of a scalar: ``eager_error`` (the class Horovod raises when it runs
        the op eagerly) or ValueError (its shape check when a graph or tf.function is built;
        eagerly too where Horovod has no error of its own: its eager alltoall of a scalar
        crashes the process)."""
        if tensor.shape.rank != 0:
            return
        message = f"{operation} needs a tensor with at least one dimension, not a scalar"
        if eager_error is not None and tf.executing_eagerly():
            raise eager_error(None, None, message)
        raise ValueError(message)

    def _reduced(self, operation: str, tensor: Any, op: str, prescale: float,
                 postscale: float) -> Any:
        if op not in self._MERGE_OPS:
            raise ValueError(f"{operation} combines with sum, average, min, max or product, "
                             f"not {op}")
        checked = self._first_dims(operation, tensor, detail=list(self._MERGE_OPS).index(op))
        wire, dtype = on_the_wire(self._scaled(tensor, prescale))
        with tf.control_dependencies([checked]):
            total = self._backend.all_reduce(wire, self._MERGE_OPS[op])
        factor = postscale / self.world.size if op == "average" else postscale
        return self._scaled(tf.cast(total, dtype), factor)

    def _scaled(self, tensor: Any, factor: float) -> Any:
        """``factor * tensor`` as Horovod computes it on CPUs: in float64 for integers
        (truncated back), in float32 for 16-bit floats, in the tensor's own type otherwise."""
        if factor == 1.0:
            return tensor
        dtype = tensor.dtype
        math = (tf.float64 if dtype.is_integer or dtype == tf.bool else
                tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype)
        return tf.cast(tf.cast(tensor, math) * tf.constant(factor, math), dtype)

    def _first_dims(self, operation: str, tensor: Any, detail: int = 0,
                    same_first: bool = True) -> Any:
        """Every rank's first dimension (int64, in rank order), once every rank's call was
        found to agree with rank 0's: the same operation, op or root (``detail``), dtype and
        shape (``same_first=False``: but for the first dimension). Where they disagree every
        rank raises FailedPreconditionError, as Horovod's ranks do: eagerly when the op runs;
        in a TensorFlow 1 graph when the op is built, from the shapes the graph knows (what it
        leaves unknown is compared when the op runs, as in a tf.function, where a disagreement
        raises InvalidArgumentError)."""
        compared = [0, 1, 2, 3, *([] if not same_first else [4]),
                    *range(5, 5 + self._DESCRIBED_DIMS)]
        if in_session_graph():
            with eagerly():
                built = self._backend.all_gather(tf.constant(self._description(
                    operation, tensor, detail, when_built=True), tf.int64))
            numbers = built.numpy().reshape(self.world.size, -1)
            self._check_agreement(numbers, compared)
            if (numbers[:, compared + [4]] >= 0).all():     # every rank's shape is known
                return tf.constant(numbers[:, 4])
        described = tf.reshape(
            self._backend.all_gather(self._description(operation, tensor, detail)),
            [self.world.size, -1])
        if tf.executing_eagerly():
            self._check_agreement(described.numpy(), compared)
            return described[:, 4]
        columns = tf.gather(described, compared, axis=1)
        agree = tf.reduce_all(tf.equal(columns, columns[:1]))
        with tf.control_dependencies([tf.debugging.Assert(agree, [
                f"ranks disagree on a {operation}: operation, op or root, dtype, rank, shape "
                "of each rank:", described], summarize=-1)]):
            return tf.identity(described[:, 4])

    def _check_agreement(self, numbers: Any, compared: list[int]) -> None:
        """FailedPreconditionError naming every rank's call unless, in each compared column of
        the ranks' descriptions, the ranks that know the value (-1: not known when built) all
        have the same."""
        for column in numbers[:, compared].T:
            if len(set(column[column >= 0].tolist())) > 1:
                raise tf.errors.FailedPreconditionError(None, None, self._disagreement(numbers))

    def _description(self, operation: str, tensor: Any, detail: int,
                     when_built: bool = False) -> Any:
        """[operation, op or root, dtype, rank, first dimension, the next dimensions] (int64,
        a fixed length whatever the tensor's rank; a scalar counts as one row): from the
        tensor's shape when the op runs, or (``when_built``, a list) from the shape the graph
        knows when it is built, -1 where it does not."""
        import math

        rank, count = tensor.shape.rank, self._DESCRIBED_DIMS
        head = [self._OPERATIONS.index(operation), detail, tensor.dtype.as_datatype_enum]
        if when_built:
            if rank is None:
                return head + [-1] * (count + 2)
            dims = [-1 if dim is None else dim for dim in tensor.shape.as_list()]
            product: Callable[[list[Any]], Any] = (
                lambda part: -1 if -1 in part else math.prod(part))
        else:
            shape = tf.shape(tensor, out_type=tf.int64)
            dims, product = [shape[i] for i in range(rank)], tf.reduce_prod
        rest = dims[1:count] + ([product(dims[count:])] if rank > count else [])
        numbers = head + [rank, dims[0] if rank else 1, *rest] + [0] * (count - len(rest))
        if when_built:
            return numbers
        return tf.stack([tf.constant(n, tf.int64) if isinstance(n, int) else n
                         for n in numbers])

    def _disagreement(self, numbers: Any) -> str:
        """One line naming what each rank called (from ``_description``'s numbers)."""
        from tensorflow.python.framework import dtypes

        calls = []
        for rank, (operation, detail, dtype, dims, first, *rest) in enumerate(numbers.tolist()):
            name = self._OPERATIONS[operation]
            how = (f" from rank {detail}" if name == "broadcast" else
                   f" ({list(self._MERGE_OPS)[detail]})" if name in ("allreduce", "reducescatter")
                   else "")
            shape = (tuple(None if dim < 0 else dim for dim in [first, *rest][:dims])
                     if 0 <= dims <= self._DESCRIBED_DIMS else "(...)")
            calls.append(f"rank {rank}: {name}{how} of {dtypes.as_dtype(dtype).name} {shape}")
        return "ranks disagree on a collective: " + "; ".join(calls)
