"""How a tensor travels on TensorFlow's collective ops: as which dtype (``on_the_wire``) and in
how many messages (``piece_lengths``).

Why pieces: on CPUs TensorFlow's collectives move each message through gRPC inside a protocol
buffer (``RecvBufRespExtra``), so it is copied whole on both sides (into the protocol buffer
and gRPC's buffers at the sender, gRPC's buffers and the parsed protocol buffer at the
receiver) before it lands in the result. A rank's peak memory therefore grows by several times
its largest message (one 640 MiB broadcast: by 2.6-2.9 GB on both ranks), and part of it stays
with the allocator afterwards. This backend used to send the whole model's weights and
optimizer state as one broadcast and a layer's gradient as one message: on
``python -m hvdtrain.bench.zero --backend tensorflow --ranks 2 --stages 0`` (55.2M parameters,
Adam) its ranks peaked at 4,121-4,522 MiB where Horovod's peaked at 2,232-2,325, and at
2,432-2,469 once messages were cut to ``MESSAGE_BYTES`` (the bench README has the run). So a
tensor larger than that travels as consecutive pieces of about equal size, one collective each,
in order, and several tensors as batches of about that size, never as one concatenation of
everything.
"""

from __future__ import annotations

from typing import Any, Sequence

from hvdtrain.collectives.base import GradientReduction, positions_by_dtype

# A probe (2 ranks on one host, 2026-11-28, load 9-14): 640 MiB of float32 all-reduced eagerly
# as separate tensors of 1, 4, 8, 64 MiB and as one: peak resident memory grew by 0.02, 0.07,
# 0.12, 0.40 and 3.3 GB a rank, in 2.2-2.8, 1.5-2.5, 1.6-2.3, 5.3-8.1 and 12-25 s. 8 MiB: twice
# the default gradient bucket, so a default bucket (closed once it holds 4 MiB) whose tensors
# are each under 4 MiB travels as one message.
MESSAGE_BYTES = 8 * 2**20


def piece_lengths(elements: int, itemsize: int) -> list[int]:
    """Element counts of the consecutive pieces, each of at most ``MESSAGE_BYTES`` and of about
    equal size, that a flat tensor of ``elements`` items of ``itemsize`` bytes travels in;
    ``[elements]`` when it fits in one message."""
    count = max(1, -(-elements * itemsize // MESSAGE_BYTES))
    base, extra = divmod(elements, count)
    return [base + 1] * extra + [base] * (count - extra)


def message_batches(tensors: Sequence[Any], on_the_ring: bool = True) -> list[list[int]]:
    """The positions of ``tensors`` in batches that each travel as one concatenation (in
    pieces where it is over ``MESSAGE_BYTES``): one dtype, closed once it holds
    ``MESSAGE_BYTES`` (the gradient buckets' rule). Not one concatenation of everything: that
    copy, its pieces' results and their joining would each be as large as all of it. Not
    ``on_the_ring`` (a GPU's NCCL, which copies no message into a protocol buffer and is faster
    with large ones; not measured here): one batch per dtype."""
    bounded = GradientReduction(bucket_bytes=MESSAGE_BYTES if on_the_ring else 0)
    return [[indices[i] for i in batch] for indices in positions_by_dtype(tensors)
            for batch in bounded.buckets([tensors[i] for i in indices])]


def on_the_wire(tensor: Any) -> tuple[Any, Any]:
    """(the tensor as it travels, its own dtype): 8- and 16-bit integers and bool travel
    as int32, uint32 as int64, bfloat16 as float32 (each exact, and sums, products, minima
    and maxima of 8- and 16-bit integers wrap back as Horovod's do)."""
    import tensorflow as tf

    dtype = tensor.dtype
    if dtype in (tf.int32, tf.int64, tf.float16, tf.float32, tf.float64):
        return tensor, dtype
    wire = {tf.uint8: tf.int32, tf.int8: tf.int32, tf.uint16: tf.int32, tf.int16: tf.int32,
            tf.bool: tf.int32, tf.uint32: tf.int64, tf.bfloat16: tf.float32}.get(dtype)
    if wire is None:
        raise TypeError(f"TensorFlow's collectives cannot carry {dtype.name} tensors")
    return tf.cast(tensor, wire), dtype
