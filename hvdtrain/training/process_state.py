"""The process-wide state a run sets, and puts back when it ends: what a program does after
``hvdtrain.fit`` is what it would do after a plain ``model.fit``, and a second run in the same
process (a notebook, a test) starts clean.

That state is the random generators (Python, NumPy, TensorFlow, Keras), Keras' precision policy,
the umask (private, so run directories stay the user's on a shared cluster) and TensorFlow's op
determinism. The generators are seeded alike on every rank before the data is built, so a
dataset built in the run shuffles the same everywhere and its shards stay disjoint, then per
rank before the model, so seeded layers such as dropout draw per rank.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Iterator

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.keras_internals import (keras_random_state, op_determinism_enabled,
                                      set_keras_random_state, set_op_determinism,
                                      set_tf_random_state, tf_random_state)


def seed_alike(seed: int) -> None:
    """Every generator from ``seed``, the same on every rank (see the module doc)."""
    keras.utils.set_random_seed(seed)


def seed_per_rank(seed: int, rank: int) -> None:
    """Python, NumPy and Keras from ``seed + rank``; TensorFlow's global seed from ``seed`` on
    every rank (see the module doc)."""
    keras.utils.set_random_seed(seed + rank)
    tf.random.set_seed(seed)


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Whatever the block does to the process's random generators is undone after it."""
    python, numpy = random.getstate(), np.random.get_state()
    tensorflow, keras_state = tf_random_state(), keras_random_state()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        set_tf_random_state(tensorflow)
        set_keras_random_state(keras_state)


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
        with random_state_kept():
            yield
    finally:
        keras.mixed_precision.set_global_policy(policy)
        os.umask(umask)
        if deterministic and not determinism:
            set_op_determinism(False)
