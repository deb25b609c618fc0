"""Horovod's reduction ops and compression for the drop-in where Horovod is not loaded (the
TensorFlow backend), and their translation into hvdtrain's words on either backend.

A script written for Horovod names ``hvd.Sum`` or ``hvd.Compression.fp16``, so they must exist
without Horovod. ``ReduceOp`` is an ``IntEnum`` with Horovod's values, so comparing or mixing
them with Horovod's gives the same answers; the compressors have Horovod's interface, and the
translation also accepts Horovod's own. Imports neither Horovod nor TensorFlow when loaded.
"""

from __future__ import annotations

import enum
from typing import Any


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops, with Horovod's values (``horovod/common/message.h``)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


def op_name(op: Any) -> str:
    """"average", "sum", "adasum", "min", "max" or "product" for Horovod's op or ours."""
    try:
        return ReduceOp(op).name.lower()
    except (ValueError, TypeError):
        raise ValueError(f"unknown reduction op {op!r}: use hvd.Average, hvd.Sum, hvd.Min, "
                         "hvd.Max, hvd.Product or hvd.Adasum") from None


class NoneCompressor:
    """No compression: the tensor travels as it is (the default)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, context: Any) -> Any:
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 and come back in their own type; others as
    they are (Horovod's ``FP16Compressor``)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        import tensorflow as tf

        if tensor.dtype.is_floating:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: Any, context: Any) -> Any:
        import tensorflow as tf

        return tf.cast(tensor, context) if context.is_floating else tensor


class Compression:
    """Horovod's ``Compression`` namespace: ``none`` (the default) or ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


# Horovod's compressor classes, recognised by where they are defined (so Horovod need not be
# imported to recognise them).
_HOROVOD_COMPRESSORS = {("horovod.tensorflow.compression", "NoneCompressor"): "none",
                        ("horovod.tensorflow.compression", "FP16Compressor"): "fp16"}


def compression_name(compression: Any) -> str:
    """"none" or "fp16" for our compressors or Horovod's; ValueError for any other."""
    if compression is NoneCompressor:
        return "none"
    if compression is FP16Compressor:
        return "fp16"
    key = (getattr(compression, "__module__", None), getattr(compression, "__name__", None))
    if key in _HOROVOD_COMPRESSORS:
        return _HOROVOD_COMPRESSORS[key]
    raise ValueError("compression must be hvd.Compression.none or hvd.Compression.fp16")
