"""The process-wide state a run sets, and puts back when it ends: what a program does after
``hvdtrain.fit`` is what it would do after a plain ``model.fit`` (which leaves all of this as
it found it), and a second run in the same process (a notebook, a test) starts clean.

* **Random state**: Python's ``random``, NumPy's global generator, TensorFlow's global seed
  and the counter it draws operation seeds from, Keras' global seed and seed generator.
  Inside the run hvdtrain seeds them twice: alike on every rank before the data is built
  (``seed_alike``: a function that builds the dataset, ``x=make_dataset``, shuffles and draws
  the same on every rank, so its shards stay disjoint), then per rank before the model is built
  (``seed_per_rank``: a model built in the run starts from different weights on every rank,
  which the broadcast from rank 0 must make agree, and its dropout and other seeded layers
  draw per rank); TensorFlow's global seed stays alike, for pipelines built later.
* **Keras' precision policy** (the run's ``--precision``).
* **The umask**: a private one, so run directories and checkpoints stay the user's on a shared
  cluster.
* **TensorFlow's op determinism** (``--deterministic`` turns it on for the run).
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
