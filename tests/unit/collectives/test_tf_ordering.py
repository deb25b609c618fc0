"""Which TensorFlow-backend collectives a ``tf.function`` orders (``tf_ordering``): inside
``each_its_own`` the ring's collectives depend on none another, elsewhere (and on the GPU
group) each runs after the one issued before; single-process, collectives of a group of one
(the 2-rank runs: tests/distributed -k tensorflow)."""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.ops import collective_ops

from hvdtrain.collectives.tf_ordering import OrderingTokens

RING, OTHER = 1, 2


def ordered_pairs(tokens: OrderingTokens, group: int, own: bool) -> list[list[bool]]:
    """For three all-reduces issued in a tf.function, whether each has the one issued before
    it as a control input (TensorFlow's automatic control dependencies)."""
    def reduce(x):
        def issued():
            return [collective_ops.all_reduce_v2(x * i, 1, group, i, ordering_token=tokens.token(
                group)) for i in (1, 2, 3)]

        if not own:
            return issued()
        with tokens.each_its_own():
            return issued()

    graph = tf.function(reduce).get_concrete_function(tf.TensorSpec([4], tf.float32)).graph
    reduces = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    return [[before in op.control_inputs for before in reduces] for op in reduces]


def test_the_rings_collectives_inside_each_its_own_run_as_their_inputs_exist():
    tokens = OrderingTokens({RING: "CPU:0", OTHER: "CPU:0"}, ring_group=RING)
    free = [[False] * 3] * 3
    chained = [[False] * 3, [True, False, False], [False, True, False]]
    assert ordered_pairs(tokens, RING, own=True) == free
    assert ordered_pairs(tokens, RING, own=True) == free          # a second graph reuses them
    assert ordered_pairs(tokens, RING, own=False) == chained
    assert ordered_pairs(tokens, OTHER, own=True) == chained       # NCCL's one order


def test_tokens_are_made_once_per_position_and_nesting_keeps_counting():
    tokens = OrderingTokens({RING: "CPU:0"}, ring_group=RING)
    with tokens.each_its_own():
        first = [tokens.token(RING) for _ in range(2)]
        with tokens.each_its_own():
            third = tokens.token(RING)
    with tokens.each_its_own():
        again = [tokens.token(RING) for _ in range(3)]
    handles = [id(handle) for handle in (*first, third)]
    assert len(set(handles)) == 3
    assert [id(handle) for handle in again] == handles
    assert tokens.token(RING) is tokens.token(RING)      # outside: the group's one token
