"""Model registry: built-in classifiers by name, or a user's ``package.module:build_fn``.

Every builder receives the input shape (without the batch axis), the number of classes and the
model config, and returns a Keras model whose output is a softmax over the classes.
"""

from __future__ import annotations

import importlib
from typing import Callable

import keras

from hvdtrain.config import ModelConfig
from hvdtrain.errors import UserError


class ModelError(UserError):
    """The configured model cannot be found or built."""


def _l2(config: ModelConfig):
    return keras.regularizers.L2(config.weight_decay) if config.weight_decay > 0 else None


def mlp(input_shape: tuple[int, ...], num_classes: int, config: ModelConfig) -> keras.Model:
    """A multilayer perceptron: flatten, ReLU hidden layers, softmax."""
    layers = [keras.Input(shape=input_shape), keras.layers.Flatten()]
    for width in config.hidden_units:
        layers.append(keras.layers.Dense(width, activation="relu",
                                         kernel_regularizer=_l2(config)))
    layers.append(keras.layers.Dense(num_classes, activation="softmax",
                                     kernel_regularizer=_l2(config)))
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
        keras.layers.Dense(num_classes, activation="softmax", kernel_regularizer=_l2(config)),
    ], name="cnn")


Builder = Callable[[tuple[int, ...], int, ModelConfig], keras.Model]
BUILTIN: dict[str, Builder] = {"mlp": mlp, "cnn": cnn}


def _user_builder(path: str) -> Callable[..., object]:
    module_name, _, function_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's to fix
        raise ModelError(f"cannot import model module '{module_name}' ({type(error).__name__}: "
                         f"{error}); check the name and that it is on PYTHONPATH") from error
    builder = getattr(module, function_name, None)
    if not callable(builder):
        raise ModelError(f"module '{module_name}' has no function '{function_name}'; "
                         "give --model package.module:build_fn")
    return builder


def build_model(config: ModelConfig, input_shape: tuple[int, ...],
                num_classes: int) -> keras.Model:
    """Build the configured model; a user builder gets ``(input_shape, num_classes)``."""
    if config.model in BUILTIN:
        model = BUILTIN[config.model](input_shape, num_classes, config)
    elif ":" in config.model:
        model = _user_builder(config.model)(input_shape, num_classes)
    else:
        raise ModelError(f"unknown model '{config.model}'; choose one of "
                         f"{', '.join(BUILTIN)} or give package.module:build_fn")
    if not isinstance(model, keras.Model):
        raise ModelError(f"'{config.model}' returned {type(model).__name__}, not a keras.Model; "
                         "return the model from your build function")
    return model
