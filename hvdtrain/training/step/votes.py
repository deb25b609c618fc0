"""The ranks' agreement to stop, carried by the step's own reduction.

Two requests can stop a run mid-epoch: a stop request on some rank (a signal, a stall:
``liveness``), and a callback that sets ``model.stop_training`` from a batch hook. Each rank
casts its votes; the step sums them across ranks with its loss and shares, in the first bucket
of its gradients where it reduces in buckets (else in that one small allreduce), so every rank
learns after the same step that some rank asked, and every rank stops there. The step owns one
``StopVotes``; the loops and callbacks cast and read the votes through it.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf


def _scalar() -> tf.Variable:
    return tf.Variable(0.0, trainable=False, dtype=tf.float32)


class StopVotes:
    """This rank's two votes (a stop request, a batch callback's stop) and their sums over the
    ranks as the last step delivered them. The step sends ``to_reduce()`` with its scalars and
    hands the sums to ``take_reduced`` (both graph-safe)."""

    def __init__(self) -> None:
        self._stop = _scalar()
        self._stops = _scalar()
        self._callback_stop = _scalar()
        self._callback_stops = _scalar()

    def to_reduce(self) -> list[tf.Tensor]:
        """This rank's votes, in the order ``take_reduced`` expects their sums."""
        return [tf.identity(self._stop), tf.identity(self._callback_stop)]

    def take_reduced(self, summed: Sequence[tf.Tensor]) -> None:
        """The sums over ranks of what ``to_reduce`` gave, as the step's reduction returns
        them."""
        stops, callback_stops = summed
        self._stops.assign(stops)
        self._callback_stops.assign(callback_stops)

    def request_stop(self) -> None:
        """This rank asks every rank to stop; the next step carries the vote."""
        if not self._stop.numpy():
            self._stop.assign(1.0)

    def stop_requested(self) -> bool:
        """Whether this rank has asked to stop."""
        return bool(self._stop.numpy())

    def stop_agreed(self) -> bool:
        """Whether some rank's stop request reached every rank with the last step (reading it
        waits for that step's last collective)."""
        return float(self._stops.numpy()) > 0

    def request_callback_stop(self) -> None:
        """A batch callback on this rank stopped training; the next step carries the vote."""
        self._callback_stop.assign(1.0)

    def callback_stop_requested(self) -> bool:
        """Whether this rank's callback stop is cast and not yet delivered."""
        return bool(self._callback_stop.numpy())

    def callback_stop_agreed(self) -> bool:
        """Whether some rank's callback stop reached every rank with the last step."""
        return float(self._callback_stops.numpy()) > 0

    def callback_stop_delivered(self) -> None:
        """The callback stop took effect: neither this rank's vote nor the sum counts again."""
        self._callback_stop.assign(0.0)
        self._callback_stops.assign(0.0)

    def carry_callback_stop(self, previous: StopVotes) -> None:
        """A callback stop cast with ``previous`` (an elastic job's last world's step) and not
        yet delivered is cast again here, so a world change loses no stop."""
        self._callback_stop.assign(previous._callback_stop)
