"""The process-wide state a run sets, and puts back when it ends: what a program does after
``hvdtrain.fit`` is what it would do after a plain ``model.fit``, and a second run in the same
process (a notebook, a test) starts clean.

That state is the random generators (Python, NumPy, TensorFlow, Keras), Keras' precision policy,
the umask (private, so run directories stay the user's on a shared cluster) and TensorFlow's op
determinism. The generators a user's code sees are rank 0's on every rank during the run
(``share_random_state``): a data function or a callback draws on every rank what it would
draw in rank 0's program run as one plain Keras process, and a dataset built in the run
shuffles the same everywhere, so its shards stay disjoint. hvdtrain's own randomness keeps off
them: a model built in the run is built under seeds of its own, per rank, so seeded layers such
as dropout draw per rank (``seeded_per_rank``), and the data's orders come from generators of
their own (``data.pipeline``, ``data.datasets``).
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Any, Callable, Iterator

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.keras_internals import (keras_random_state, op_determinism_enabled,
                                      set_keras_random_state, set_op_determinism,
                                      set_tf_random_state, tf_random_state)


def seed_alike(seed: int) -> None:
    """Every generator from ``seed``, the same on every rank: before the ``evaluate`` command
    builds its data (a process of its own, whose generators no user code sees afterwards)."""
    keras.utils.set_random_seed(seed)


# The runs under way in this process, innermost last: whether each shares rank 0's generators
# and whether it set TensorFlow's global seed for a program that had none.
_RUNS: list[dict[str, bool]] = []


def share_random_state(seed: int, allgather_object: Callable[[Any], list[Any]]) -> None:
    """Every rank's Python, NumPy, TensorFlow and Keras generators from here on are rank 0's
    (see the module doc). Where rank 0 set no TensorFlow global seed, ``seed`` is set on every
    rank, since an unseeded TensorFlow generator draws differently in every process; the run's
    end unsets it again (``run_random_state``)."""
    mine = keras_random_state()
    python, numpy, tensorflow, (keras_seed, keras_state) = allgather_object(
        (random.getstate(), np.random.get_state(), tf_random_state(), (mine[0], mine[2])))[0]
    random.setstate(python)
    np.random.set_state(numpy)
    if _RUNS:
        _RUNS[-1].update(shared=True, unseeded=tensorflow[0] is None)
    if tensorflow[0] is None:
        tf.random.set_seed(seed)
    else:
        set_tf_random_state(tensorflow)
    generator = mine[1]
    if keras_state is None:
        generator = None            # made from Python's generator (now rank 0's) when first used
    elif generator is None:
        generator = keras.random.SeedGenerator(0)    # its state is rank 0's just below
    set_keras_random_state((keras_seed, generator, keras_state))


@contextlib.contextmanager
def seeded_per_rank(seed: int, rank: int) -> Iterator[None]:
    """Build a model in the run: inside, Python, NumPy and Keras from ``seed + rank`` (seeded
    layers take their seeds from Python's generator, so ranks drop different units, as one
    process does for different rows; the weights are rank 0's after the broadcast) and
    TensorFlow's global seed from ``seed`` on every rank (a tf.data ``shuffle(seed=S)`` depends
    on it too); after it, the generators are where they were."""
    with random_state_kept():
        keras.utils.set_random_seed(seed + rank)
        tf.random.set_seed(seed)
        yield


def _random_state() -> tuple[Any, Any, Any, Any]:
    return random.getstate(), np.random.get_state(), tf_random_state(), keras_random_state()


def _put_back(state: tuple[Any, Any, Any, Any]) -> None:
    python, numpy, tensorflow, keras_state = state
    random.setstate(python)
    np.random.set_state(numpy)
    set_tf_random_state(tensorflow)
    set_keras_random_state(keras_state)


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Whatever the block does to the process's random generators is undone after it."""
    state = _random_state()
    try:
        yield
    finally:
        _put_back(state)


@contextlib.contextmanager
def run_random_state() -> Iterator[None]:
    """A run's generators at its end: where the run left them once they were shared (where one
    process's ``model.fit`` leaves them: the draws of the user's code and Keras' own are
    there), less the TensorFlow global seed given to a program that had none; before that (a
    run refused at its start), as they were."""
    state = _random_state()
    run = {"shared": False, "unseeded": False}
    _RUNS.append(run)
    try:
        yield
    finally:
        _RUNS.pop()
        if not run["shared"]:
            _put_back(state)
        elif run["unseeded"]:
            set_tf_random_state((None, None))


@contextlib.contextmanager
def run_environment(precision: str, deterministic: bool = False) -> Iterator[None]:
    """Set the process-wide state a run needs and restore all of it after (module doc)."""
    policy = keras.mixed_precision.global_policy()
    determinism = op_determinism_enabled()
    umask = os.umask(0o077)
    keras.mixed_precision.set_global_policy(precision)
    if deterministic:
        set_op_determinism(True)
    try:
        with run_random_state():
            yield
    finally:
        keras.mixed_precision.set_global_policy(policy)
        os.umask(umask)
        if deterministic and not determinism:
            set_op_determinism(False)
