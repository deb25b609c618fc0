"""The benchmark's models as ``--model package.module:function`` builders, so that the trainer
(and ``--autotune``) can run them on any data: ``--model hvdtrain.bench.plugin_models:resnet50
--dataset synthetic --synthetic-shape 32 32 3`` is the scaling study's ResNet-50 (its 94 MB
gradient at a compute a CPU finishes in a fraction of a second)."""

from __future__ import annotations

from typing import Sequence

import keras

from hvdtrain.bench.benchmark import build_benchmark_model


def resnet50(input_shape: Sequence[int], num_classes: int) -> keras.Model:
    """Keras' ResNet-50, random weights, at the data's input shape and classes."""
    return build_benchmark_model("resnet50", tuple(input_shape), num_classes)
