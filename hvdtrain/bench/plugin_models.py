"""The benchmark's models as ``--model package.module:function`` builders, so that the trainer
(and ``--autotune``) can run them on any data: ``--model hvdtrain.bench.plugin_models:resnet50
--dataset synthetic --synthetic-shape 32 32 3`` is the scaling study's ResNet-50 (its 94 MB
gradient at a compute a CPU finishes in a fraction of a second); ``--model
hvdtrain.bench.plugin_models:residual_mlp --dataset synthetic --synthetic-shape 2048`` is ZeRO's
deep model, as wide as its input (a builder is given only the data's shape, so the width travels
as the synthetic data's)."""

from __future__ import annotations

from typing import Sequence

import keras

from hvdtrain.bench.benchmark import build_benchmark_model

# Deep enough that its largest layer (one block's Dense kernel) is 1/48 of the whole: the case
# ZeRO stage 3 is for, where gathering one layer at a time holds a small share of the weights.
RESIDUAL_BLOCKS = 24


def resnet50(input_shape: Sequence[int], num_classes: int) -> keras.Model:
    """Keras' ResNet-50, random weights, at the data's input shape and classes."""
    return build_benchmark_model("resnet50", tuple(input_shape), num_classes)


def residual_mlp(input_shape: Sequence[int], num_classes: int) -> keras.Model:
    """``RESIDUAL_BLOCKS`` pre-norm residual blocks (LayerNormalization, Dense with ReLU, Dense,
    added to the block's input) as wide as the input's last axis, a final LayerNormalization and
    a softmax over the classes (float32 under mixed precision, as the built-in models')."""
    width = int(input_shape[-1])
    inputs = keras.Input(shape=tuple(input_shape))
    x = inputs
    for _ in range(RESIDUAL_BLOCKS):
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(width, activation="relu")(h)
        h = keras.layers.Dense(width)(h)
        x = keras.layers.Add()([x, h])
    x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs, name=f"residual_mlp_{RESIDUAL_BLOCKS}x{width}")


def residual_mlp_parameters(width: int, num_classes: int) -> int:
    """``residual_mlp``'s parameter count at a flat input of ``width`` (without building it:
    the benchmark names the sizes of runs that did not fit)."""
    block = 2 * width + 2 * (width * width + width)
    return RESIDUAL_BLOCKS * block + 2 * width + width * num_classes + num_classes
