"""The helper of ``horovod.tensorflow.util`` that Horovod scripts and tests import."""

import tensorflow as tf


def _executing_eagerly() -> bool:
    """Whether TensorFlow executes eagerly here (False in a TensorFlow 1 graph or while a
    tf.function is traced)."""
    return tf.executing_eagerly()
