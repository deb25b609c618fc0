"""The TensorFlow backend's collectives inside a TensorFlow 1 graph (``tf.compat.v1`` graph mode,
run by a ``Session``), where Horovod scripts and Horovod's own tests still build them.

A session is a runtime of its own that cannot reach the backend's cluster (TensorFlow's eager
context), so each collective becomes a graph node that runs it eagerly when the session runs it
(``session_node``). Each node waits in a thread of its own (a session's few inter-op threads,
all blocked in different collectives, would hang), and gets a collective group of its own
numbered in build order, since a collective key reused with another shape aborts. The ranks
must build their graphs' collectives in the same order. Private TensorFlow API used here:
``map_op._MapDataset`` (for ``use_inter_op_parallelism``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Callable, Iterator

# Collective group keys for session nodes start here (the eager groups are 1 and 2).
FIRST_NODE_GROUP = 1000


@contextlib.contextmanager
def eagerly() -> Iterator[None]:
    """Run what follows eagerly wherever it is called: inside a TensorFlow 1 graph, or while a
    ``tf.function`` is traced. For what must exist once per process whatever graph is current
    (the cluster, its ordering tokens) and for what a Python caller needs as a value now (the
    object exchanges, the check of a graph's collectives when it is built)."""
    from tensorflow.python.eager import context
    from tensorflow.python.framework import ops

    with ops.init_scope(), context.eager_mode():
        yield


def in_session_graph() -> bool:
    """True while a TensorFlow 1 graph is being built (also inside a function defined in it):
    ops built now run in a ``Session``, not on the eager context."""
    from tensorflow.python.framework import ops

    return not ops.executing_eagerly_outside_functions()


class SessionNodes:
    """Builds the graph nodes that run one collective eagerly each time a session runs them."""

    def __init__(self) -> None:
        self._groups = itertools.count(FIRST_NODE_GROUP)

    def node(self, run: Callable[[Any, int, int], Any], value: Any, shape: Any) -> Any:
        """A tensor of ``value``'s dtype and ``shape`` computed by ``run(value, group_key,
        instance_key)`` (eagerly, on this node's own group, the n-th run with key n) whenever
        the session runs it."""
        import tensorflow as tf
        from tensorflow.python.data.ops import map_op

        group = next(self._groups)
        runs = itertools.count(1)
        lock = threading.Lock()

        def run_eagerly(eager_value: Any) -> Any:
            with lock:
                key = next(runs)
            return run(eager_value, group, key)

        dataset = map_op._MapDataset(
            tf.data.Dataset.from_tensors(value),
            lambda element: tf.py_function(run_eagerly, [element], value.dtype),
            use_inter_op_parallelism=False)
        result = dataset.get_single_element()
        result.set_shape(shape)
        return result
