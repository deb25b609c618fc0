"""How tensors are cut into the TensorFlow backend's messages (``tf_messages``): pieces of at
most ``MESSAGE_BYTES`` and of about equal size, batches of one dtype closed at that size;
single-process, no collectives (the 2-rank results: ``dropin_rank_checks``)."""

from __future__ import annotations

import tensorflow as tf

from hvdtrain.collectives import tf_messages
from hvdtrain.collectives.tf_messages import MESSAGE_BYTES, message_batches, piece_lengths


def test_a_tensor_that_fits_is_one_piece_and_a_larger_one_equal_pieces_under_the_limit():
    per = MESSAGE_BYTES // 4
    assert piece_lengths(0, 4) == [0]
    assert piece_lengths(per, 4) == [per]
    assert piece_lengths(per + 1, 4) == [per // 2 + 1, per // 2]
    lengths = piece_lengths(5 * per + 3, 4)
    assert len(lengths) == 6 and sum(lengths) == 5 * per + 3
    assert max(lengths) - min(lengths) <= 1 and max(lengths) * 4 <= MESSAGE_BYTES


def test_batches_hold_one_dtype_and_close_once_they_hold_the_size(monkeypatch):
    monkeypatch.setattr(tf_messages, "MESSAGE_BYTES", 100)
    tensors = [tf.zeros([10]), tf.zeros([5], tf.int32), tf.zeros([10]), tf.zeros([100]),
               tf.zeros([3]), tf.zeros([5], tf.int32)]        # float32: 40, 40, 400, 12 bytes
    assert message_batches(tensors) == [[3, 4], [0, 2], [1, 5]]
    assert message_batches(tensors, on_the_ring=False) == [[0, 2, 3, 4], [1, 5]]   # NCCL's
