"""PowerSGD gradient compression (Vogels, Karimireddy and Jaggi, NeurIPS 2019), with error
feedback and warm start, over any backend's ``Collectives``: ``--compression powersgd``.

Why: at 1 Gbit/s an exact float32 exchange is bound by the link (issue 49); a rank-r
approximation of an n x m gradient sends (n + m) r numbers instead of n m. One round, per
step, for every compressed gradient at once: this rank's matrix M (the gradient reshaped to
``matrix_shape``, plus the error it kept from earlier steps) gives P = M Q; the P's are summed
across ranks (one grouped allreduce), orthonormalised (QR), Q = M^T P summed (another), and the
sum of the ranks' matrices is approximated by P Q^T, identically on every rank, so the update
is the same everywhere. What the approximation left out of this rank's part, M - P Q^T / N,
stays here and is added to the next step's gradient (error feedback). Q is kept for the next
step (warm start: one power iteration a step refines it), first drawn from the run's seed, the
same on every rank.

The sums are hvdtrain's: each rank's gradient is already weighted by its share of the global
batch and the step divides the summed gradients by the summed shares afterwards, so the
compressed sum stands in for the exact sum and the step's scale is kept. The result is an
approximation: N ranks x batch b no longer computes what one process with batch N b computes.

Gradients of fewer than two dimensions (biases, norms), of too few elements to pay
(``matrix_shape``), sparse ones (``IndexedSlices``) and None travel with the usual reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from hvdtrain.collectives import Collectives, GradientReduction, variable_bytes

# A gradient is compressed only where that sends at most 1/MIN_SAVING of its elements:
# n m >= MIN_SAVING (n + m) r. Below that the two extra matrix products and the error buffer
# cost more than the bytes saved (PyTorch's hook uses a factor of 2; 4 keeps small layers,
# whose exchange is latency-bound anyway, exact).
MIN_SAVING = 4


def matrix_shape(shape: Sequence[int | None], rank: int) -> tuple[int, int] | None:
    """The n x m matrix a gradient of ``shape`` is compressed as (all leading dimensions
    together by the last: a Dense kernel's inputs by outputs, a convolution's window and input
    channels by output channels), or None where it travels uncompressed."""
    if len(shape) < 2 or any(d is None for d in shape):
        return None
    n, m = int(np.prod(shape[:-1])), int(shape[-1])
    if min(n, m) <= rank or n * m < MIN_SAVING * (n + m) * rank:
        return None
    return n, m


def initial_q(m: int, rank: int, seed: int, index: int) -> np.ndarray:
    """A warm start's first Q (m x rank): standard normal from the run's seed and the variable's
    position, so every rank draws the same one."""
    return np.random.default_rng([seed, index]).standard_normal((m, rank)).astype(np.float32)


@dataclass(frozen=True)
class Slot:
    """One compressed variable's state: its matrix shape, the warm-start Q (the same on every
    rank) and this rank's error buffer."""

    n: int
    m: int
    q: tf.Variable
    error: tf.Variable


class PowerSGD:
    """The compression state of ``variables`` (created outside any ``tf.function``) and the
    step's compressed reduction (``reduce``)."""

    def __init__(self, variables: Sequence[Any], rank: int, seed: int) -> None:
        self.rank = rank
        self._slots: dict[int, Slot] = {}
        with tf.init_scope():
            for index, variable in enumerate(variables):
                shape = matrix_shape(tuple(variable.shape), rank)
                if shape is None:
                    continue
                n, m = shape
                self._slots[id(variable)] = Slot(
                    n, m, tf.Variable(initial_q(m, rank, seed, index), trainable=False,
                                      name="hvdtrain_powersgd_q"),
                    tf.Variable(tf.zeros((n, m), tf.float32), trainable=False,
                                name="hvdtrain_powersgd_error"))

    @property
    def slots(self) -> list[Slot]:
        return list(self._slots.values())

    @property
    def q_variables(self) -> list[tf.Variable]:
        """The Q matrices: the same on every rank."""
        return [slot.q for slot in self.slots]

    @property
    def error_variables(self) -> list[tf.Variable]:
        """The error buffers: this rank's own."""
        return [slot.error for slot in self.slots]

    def state_bytes(self) -> int:
        """What this rank keeps for the compression: its error buffers and the Q matrices."""
        return variable_bytes(self.q_variables + self.error_variables)

    def describe(self, variables: Sequence[Any]) -> str:
        """One line for the run's log: what is compressed, the bytes on the wire, the memory."""
        kept = [v for v in variables if id(v) in self._slots]
        sent = sum((slot.n + slot.m) * self.rank for slot in self.slots) * 4
        whole = variable_bytes(kept)
        return (f"PowerSGD rank {self.rank}: {len(kept)} of {len(variables)} gradients "
                f"compressed ({whole / 2**20:.2f} MiB travel as {sent / 2**20:.3f} MiB, "
                f"{whole / max(sent, 1):.0f}x fewer bytes), the others "
                f"({variable_bytes(variables) - whole:,} bytes) uncompressed; per rank "
                f"{self.state_bytes() / 2**20:.2f} MiB of error buffers and Q matrices; "
                "approximate: not one process's update")

    def compressed(self, gradients: Sequence[Any], variables: Sequence[Any]) -> list[int]:
        """The positions of ``gradients`` (of ``variables``) that travel compressed."""
        return [i for i, (gradient, variable) in enumerate(zip(gradients, variables))
                if id(variable) in self._slots and gradient is not None
                and not isinstance(gradient, tf.IndexedSlices)]

    def reduced(self, collectives: Collectives, gradients: Sequence[Any],
                variables: Sequence[Any], reduction: GradientReduction,
                scalars: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """The step's exchange: (the gradients summed across ranks, those at ``compressed``
        positions approximated, the float32 ``scalars`` summed). The uncompressed gradients
        travel as ``reduction`` says, in its buckets, the scalars in the first; the compressed
        ones after them, in the two allreduces of ``reduce``."""
        positions = set(self.compressed(gradients, variables))
        plain = [None if i in positions else g for i, g in enumerate(gradients)]
        exact = collectives.reduce_gradients([*plain, *scalars], reduction)
        approximated = self.reduce(collectives, gradients, variables)
        return ([exact_one if one is None else one
                 for one, exact_one in zip(approximated, exact)], exact[len(gradients):])

    def reduce(self, collectives: Collectives, gradients: Sequence[Any],
               variables: Sequence[Any]) -> list[Any | None]:
        """The sum across ranks of each gradient at a ``compressed`` position, approximated
        (the same on every rank) in its shape, None at the others (``reduced`` reduces those);
        the error buffers and Q's updated (graph-safe)."""
        positions = self.compressed(gradients, variables)
        reduced: list[Any] = [None] * len(gradients)
        if not positions:
            return reduced
        slots = [self._slots[id(variables[i])] for i in positions]
        matrices = [tf.reshape(tf.cast(gradients[i], tf.float32), (slot.n, slot.m)) + slot.error
                    for i, slot in zip(positions, slots)]
        ps = collectives.allreduce_sum([tf.matmul(matrix, slot.q)
                                        for matrix, slot in zip(matrices, slots)])
        ps = [tf.linalg.qr(p)[0] for p in ps]   # orthonormal columns, identical on every rank
        qs = collectives.allreduce_sum([tf.matmul(matrix, p, transpose_a=True)
                                        for matrix, p in zip(matrices, ps)])
        size = float(collectives.world.size)
        for index, slot, matrix, p, q in zip(positions, slots, matrices, ps, qs):
            approximation = tf.matmul(p, q, transpose_b=True)   # of the ranks' summed matrices
            slot.error.assign(matrix - approximation / size)
            slot.q.assign(q / size)
            reduced[index] = tf.cast(tf.reshape(approximation, variables[index].shape),
                                     gradients[index].dtype)
        return reduced

    def rank_values(self) -> list[np.ndarray]:
        """This rank's state for a checkpoint: the Q matrices, then the error buffers."""
        return [v.numpy() for v in self.q_variables + self.error_variables]

    def load(self, every_rank: Sequence[Sequence[np.ndarray]], rank: int, size: int) -> str:
        """Take back a checkpoint's state (``every_rank``: each rank's ``rank_values``, in rank
        order): the Q matrices from rank 0 (they were the same on every rank), this rank's
        error buffers where the checkpoint had ``size`` ranks, as this run has; otherwise
        every rank's start at zero (an error buffer is one rank's remainder of its own
        gradients: there is no exact way to share N of them among M ranks). Returns the line
        for the log ("" when everything was restored)."""
        count = len(self.slots)
        shapes = [tuple(v.shape) for v in self.q_variables + self.error_variables]
        if not every_rank or any([tuple(np.shape(a)) for a in values] != shapes
                                 for values in every_rank):
            return ("PowerSGD: the checkpoint holds no compression state of this model's "
                    "shapes; error buffers start at zero and Q from the seed")
        for variable, value in zip(self.q_variables, every_rank[0][:count]):
            variable.assign(value)
        if len(every_rank) != size:
            for variable in self.error_variables:
                variable.assign(tf.zeros_like(variable))
            return (f"PowerSGD: the checkpoint's {len(every_rank)} ranks' error buffers are "
                    f"dropped (this run has {size}); Q matrices restored")
        for variable, value in zip(self.error_variables, every_rank[rank][count:]):
            variable.assign(value)
        return ""
