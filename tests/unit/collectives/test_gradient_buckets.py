"""How gradients are split into buckets (``GradientReduction.buckets``): the last tensors
first, each bucket closed once it holds ``bucket_bytes``, one bucket for 0; how compressed
gradients travel (``on_wire``) and what compression refuses; single-process, no collectives."""

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


SUBMISSION_ORDER = """
import tensorflow as tf
from hvdtrain.collectives import GradientReduction
from hvdtrain.collectives.horovod_backend import HorovodCollectives

collectives = HorovodCollectives()                  # a world of one: Horovod without a launcher
sizes = [300, 10, 1000, 5, 200]                     # buckets of 800 bytes: [4], [2, 3], [0, 1]
for in_issue_order in (False, True):
    reduce = tf.function(lambda *grads: collectives.reduce_gradients(
        list(grads), GradientReduction(bucket_bytes=800, in_issue_order=in_issue_order)))
    graph = reduce.get_concrete_function(
        *[tf.TensorSpec([n], tf.float32) for n in sizes]).graph
    producer = {output.name: op for op in graph.get_operations() for output in op.outputs}

    def upstream(op, seen):
        for parent in [producer[t.name] for t in op.inputs] + list(op.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                upstream(parent, seen)
        return seen

    groups = [op for op in graph.get_operations() if op.type == "HorovodGroupedAllreduce"]
    print([len(op.inputs) for op in groups])
    print([[other.name in upstream(op, set()) for other in groups] for op in groups])
"""


@pytest.mark.slow   # a fresh process: Horovod initialised as a world of one
def test_issue_order_submits_each_bucket_after_the_one_before_has_completed():
    """``--bucket-order issued``: on the Horovod backend each bucket's grouped allreduce depends
    on the previous bucket's (control dependencies), so every rank submits a step's buckets in
    the order they are issued, the last layers' first; the first depends on none. The default
    (``ready``) adds no dependency: each bucket leaves once its own gradients exist."""
    import subprocess

    from conftest import BIN, REPO, RUN_TIMEOUT, rank_env

    result = subprocess.run([str(BIN / "python"), "-c", SUBMISSION_ORDER], cwd=REPO,
                            env=rank_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert result.returncode == 0, result.stderr[-2000:]
    ready_sizes, ready, issued_sizes, issued = result.stdout.strip().splitlines()[-4:]
    assert ready_sizes == issued_sizes == "[1, 2, 2]"
    assert ready == "[[False, False, False], [False, False, False], [False, False, False]]"
    assert issued == "[[False, False, False], [True, False, False], [True, True, False]]"
    line = GradientReduction(bucket_bytes=800, in_issue_order=True).describe(floats(300, 200))
    assert "each sent once the one before has completed (one order on every rank)" in line


def test_compressed_gradients_travel_rounded_and_other_types_as_they_are():
    """``on_wire``: float32 and float64 as float16 (fp16) or bfloat16 (bf16), rounded to the
    type's mantissa; integers and half-precision floats unchanged; "none" changes nothing."""
    third = tf.constant([1 / 3, 1e30], tf.float32)
    bf16 = GradientReduction(compression="bf16").on_wire(third)
    assert bf16.dtype == tf.bfloat16
    assert float(bf16[0]) == pytest.approx(1 / 3, rel=2**-8) and float(bf16[0]) != 1 / 3
    assert float(bf16[1]) == pytest.approx(1e30, rel=2**-8)   # float32's range: no overflow
    assert GradientReduction(compression="bf16").on_wire(tf.cast(third, tf.float64)).dtype \
        == tf.bfloat16
    assert GradientReduction(compression="fp16").on_wire(third).dtype == tf.float16
    for kept in (tf.constant([3], tf.int32), tf.constant([0.5], tf.float16)):
        assert GradientReduction(compression="bf16").on_wire(kept).dtype == kept.dtype
    assert GradientReduction().on_wire(third) is third


def test_compression_refusals_name_the_problem():
    """bf16 with Adasum (Horovod's Adasum takes no bfloat16) and an unknown compression are
    refused; so is bfloat16 in Horovod's reducescatter (``--zero-stage``), before Horovod sees
    it."""
    from hvdtrain.collectives import HorovodCollectives
    from hvdtrain.errors import UserError

    with pytest.raises(ValueError, match="bf16 cannot travel with adasum"):
        GradientReduction("adasum", "bf16")
    with pytest.raises(ValueError, match="compression must be one of none, fp16, bf16, not fp8"):
        GradientReduction(compression="fp8")
    uninitialised = HorovodCollectives.__new__(HorovodCollectives)
    with pytest.raises(UserError, match="^--compression bf16 with --zero-stage needs the "
                                        "TensorFlow backend"):
        uninitialised.reduce_scatter_sum([tf.zeros([4], tf.bfloat16)])
