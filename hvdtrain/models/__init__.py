"""Model registry: built-in classifiers by name, or a user's ``package.module:build_fn``.

Every built-in builder receives the input shape (without the batch axis), the number of classes
and the model config, and returns an uncompiled Keras model whose output is a softmax over the
classes, trained with hvdtrain's default objective (sparse cross-entropy, accuracy). The output
layer computes in float32 under mixed precision, so the softmax and the loss stay stable. A
user's ``package.module:build_fn`` receives ``(input_shape, num_classes)`` (``num_classes`` is
None for targets that are not class ids; ``input_shape`` is a dict for dict features) and may
return a compiled model: see ``hvdtrain.training.step.objective``.
"""

from __future__ import annotations

from typing import Any, Callable

import keras

from hvdtrain.config import ModelConfig
from hvdtrain.errors import UserError
from hvdtrain.plugins import is_plugin, load_callable


class ModelError(UserError):
    """The configured model cannot be found or built."""


def _l2(config: ModelConfig):
    return keras.regularizers.L2(config.weight_decay) if config.weight_decay > 0 else None


def _classifier(num_classes: int, config: ModelConfig) -> keras.layers.Layer:
    return keras.layers.Dense(num_classes, activation="softmax", dtype="float32",
                              kernel_regularizer=_l2(config))


def mlp(input_shape: tuple[int, ...], num_classes: int, config: ModelConfig) -> keras.Model:
    """A multilayer perceptron: flatten, ReLU hidden layers, softmax."""
    layers = [keras.Input(shape=input_shape), keras.layers.Flatten()]
    for width in config.hidden_units:
        layers.append(keras.layers.Dense(width, activation="relu",
                                         kernel_regularizer=_l2(config)))
    layers.append(_classifier(num_classes, config))
    return keras.Sequential(layers, name="mlp")


def cnn(input_shape: tuple[int, ...], num_classes: int, config: ModelConfig) -> keras.Model:
    """The classic Fashion-MNIST CNN: conv 64 and 128 (3x3), max-pool, dropout 0.5, softmax."""
    return keras.Sequential([
        keras.Input(shape=input_shape),
        keras.layers.Conv2D(64, 3, activation="relu", kernel_regularizer=_l2(config)),
        keras.layers.Conv2D(128, 3, activation="relu", kernel_regularizer=_l2(config)),
        keras.layers.MaxPooling2D(2),
        keras.layers.Dropout(0.5),
        keras.layers.Flatten(),
        _classifier(num_classes, config),
    ], name="cnn")


def _residual_block(x, filters: int, stride: int, config: ModelConfig):
    shortcut = x
    x = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                            kernel_regularizer=_l2(config))(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False,
                            kernel_regularizer=_l2(config))(x)
    x = keras.layers.BatchNormalization()(x)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False,
                                       kernel_regularizer=_l2(config))(shortcut)
        shortcut = keras.layers.BatchNormalization()(shortcut)
    return keras.layers.ReLU()(keras.layers.Add()([x, shortcut]))


def resnet(input_shape: tuple[int, ...], num_classes: int, config: ModelConfig) -> keras.Model:
    """A CIFAR-style ResNet (He et al., 2016): three stages of 16, 32 and 64 filters with
    ``resnet_blocks`` residual blocks each (3: ResNet-20), batch normalisation, global pooling.
    """
    inputs = keras.Input(shape=input_shape)
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False,
                            kernel_regularizer=_l2(config))(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(config.resnet_blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            x = _residual_block(x, filters, stride, config)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, _classifier(num_classes, config)(x), name="resnet")


Builder = Callable[[tuple[int, ...], int, ModelConfig], keras.Model]
# The built-in models by name; hvdtrain.builtin_names.MODELS holds the same names.
BUILTIN: dict[str, Builder] = {"mlp": mlp, "cnn": cnn, "resnet": resnet}


def build_model(config: ModelConfig, input_shape: Any, num_classes: int | None) -> keras.Model:
    """Build the configured model; a user builder gets ``(input_shape, num_classes)`` and may
    return a compiled model (its loss and metrics are then what the run uses)."""
    if config.model in BUILTIN:
        if num_classes is None or isinstance(input_shape, dict):
            raise ModelError(f"built-in model '{config.model}' is a classifier of one input; "
                             "for these targets or inputs give --model package.module:build_fn")
        model = BUILTIN[config.model](input_shape, num_classes, config)
    elif is_plugin(config.model):
        model = load_callable(config.model, "model")(input_shape, num_classes)
    else:
        raise ModelError(f"unknown model '{config.model}'; choose one of "
                         f"{', '.join(BUILTIN)} or give package.module:build_fn")
    if not isinstance(model, keras.Model):
        raise ModelError(f"'{config.model}' returned {type(model).__name__}, not a keras.Model; "
                         "return the model from your build function")
    return model


def check_input_shape(model: keras.Model, name: str, shape: Any) -> None:
    """Fail before training when the data's example shape cannot feed the model (checked for
    single-input models with a declared input; a multi-input or subclassed model meets its data
    at the probe batch). A dimension unknown on either side (None) fits anything."""
    if isinstance(shape, dict) or not isinstance(shape, tuple):
        return
    try:
        declared = model.input_shape
    except (AttributeError, ValueError):   # a subclassed model declares no input
        return
    expected = tuple(declared[1:]) if isinstance(declared, tuple) else None
    if expected is not None and len(expected) == len(shape) and all(
            e is None or s is None or e == s for e, s in zip(expected, shape)):
        return
    if expected is not None:
        raise ModelError(f"the data's examples have shape {shape} but model '{name}' expects "
                         f"{expected}; build the model for the data's shape")
