"""How gradients are split into buckets (``GradientReduction.buckets``): the last tensors
first, each bucket closed once it holds ``bucket_bytes``, one bucket for 0; single-process,
no collectives."""

from __future__ import annotations

import keras
import pytest
import tensorflow as tf

from hvdtrain.collectives import GradientReduction
from hvdtrain.config import OptimConfig


def floats(*sizes: int) -> list[tf.Tensor]:
    return [tf.zeros([n], tf.float32) for n in sizes]


def test_buckets_fill_from_the_last_tensor_and_close_at_the_size():
    tensors = floats(300, 10, 1000, 5, 200)          # 1200, 40, 4000, 20, 800 bytes
    assert GradientReduction(bucket_bytes=1000).buckets(tensors) == [[2, 3, 4], [0, 1]]
    assert GradientReduction(bucket_bytes=800).buckets(tensors) == [[4], [2, 3], [0, 1]]
    assert GradientReduction(bucket_bytes=1).buckets(tensors) == [[4], [3], [2], [1], [0]]
    assert GradientReduction(bucket_bytes=10**9).buckets(tensors) == [[0, 1, 2, 3, 4]]


def test_zero_bytes_is_one_bucket_and_every_tensor_is_in_exactly_one():
    tensors = floats(7, 1, 64, 3)
    assert GradientReduction().buckets(tensors) == [[0, 1, 2, 3]]
    assert GradientReduction().buckets([]) == []
    for size in (1, 8, 30, 256, 300):
        found = GradientReduction(bucket_bytes=size).buckets(tensors)
        assert sorted(i for bucket in found for i in bucket) == [0, 1, 2, 3]
        assert all(bucket == sorted(bucket) for bucket in found)


def test_bytes_follow_the_dtype_and_keras_variables_count_like_tensors():
    assert GradientReduction(bucket_bytes=16).buckets(
        [tf.zeros([8], tf.float16), tf.zeros([4], tf.float64), tf.zeros([4], tf.float16)]) \
        == [[1, 2], [0]]
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32),
                              keras.layers.Dense(10)])
    reduction = GradientReduction(bucket_bytes=1000)   # kernels 8,192 and 1,280 bytes
    assert reduction.buckets(model.trainable_variables) == [[2, 3], [0, 1]]
    assert "in 2 bucket(s)" in reduction.describe(model.trainable_variables)
    assert "one allreduce" in GradientReduction().describe(model.trainable_variables)


def test_bucket_mib_becomes_bytes_and_a_negative_size_is_refused():
    assert OptimConfig(bucket_mib=0.5).bucket_bytes == 2**19
    assert OptimConfig(bucket_mib=0).bucket_bytes == 0
    with pytest.raises(ValueError, match="bucket_bytes"):
        GradientReduction(bucket_bytes=-1)
