"""Which of the TensorFlow backend's collectives a ``tf.function`` runs in program order: their
ordering tokens.

Why tokens: in a ``tf.function`` TensorFlow's automatic control dependencies run the ops that
use one resource in program order, and also every stateful op that uses none (an all-reduce
without a token included), so each collective needs a token to be ordered or left free. With
one token per group, every collective of the group ran after the one issued before it: the
gradient buckets ran one after another after the backward pass, because the first bucket
issued holds the output layer's kernel gradient, which TensorFlow computes last (its profile in
hvdtrain/bench/README.md). So inside ``each_its_own`` every collective on the CPU ring takes a
token of its own and runs as soon as its input exists, beside the others.

Why that cannot deadlock on the ring: its ops are asynchronous (no executor thread waits in
one), each runs on a thread of the collective executor's unbounded queue, and the ranks pair a
collective by its instance key, drawn at call time in program order whatever order the ops run
in: a rank that starts another bucket first only waits for its peer to reach it. The rest keep
their group's token: messages cut from one large broadcast or gather must not all be in flight
at once (gRPC copies each several times: ``tf_messages``), and NCCL (the GPU group) needs one
order on every rank.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Mapping

from hvdtrain.collectives.tf_graph_mode import eagerly


class OrderingTokens:
    """The groups' shared tokens, and the ring's own tokens handed out inside
    ``each_its_own`` (the n-th collective issued there takes the n-th; every graph reuses
    them, as ops of two graphs are never ordered against each other)."""

    def __init__(self, devices: Mapping[int, str], ring_group: int) -> None:
        """``devices``: each group's device; ``ring_group``: the group whose collectives may
        run out of program order. Made eagerly even inside a TensorFlow 1 graph or a trace:
        a token in that graph would die with it, and every later collective with it."""
        self._devices = dict(devices)
        self._ring = ring_group
        self._shared = {group: self._made(device) for group, device in self._devices.items()}
        self._own: list[Any] = []
        self._issued = threading.local()

    @staticmethod
    def _made(device: str) -> Any:
        import tensorflow as tf
        from tensorflow.python.ops import resource_variable_ops

        with eagerly(), tf.device(device):
            return resource_variable_ops.ResourceVariable(0.0)

    def token(self, group: int) -> Any:
        """The token (a resource handle) for the collective of ``group`` issued now."""
        position = getattr(self._issued, "count", None)
        if position is None or group != self._ring:
            return self._shared[group].handle
        self._issued.count = position + 1
        while len(self._own) <= position:
            self._own.append(self._made(self._devices[group]))
        return self._own[position].handle

    @contextlib.contextmanager
    def each_its_own(self) -> Iterator[None]:
        """Inside: every collective on the ring is issued with a token of its own."""
        if getattr(self._issued, "count", None) is not None:     # already inside
            yield
            return
        self._issued.count = 0
        try:
            yield
        finally:
            self._issued.count = None
