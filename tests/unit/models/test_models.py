"""The built-in models: the CNN keeps the classic Keras MNIST layout (one process). The ResNet
on 2 ranks: tests/distributed/training/test_models_on_ranks.py."""

from __future__ import annotations

from hvdtrain.config import ModelConfig
from hvdtrain.models import build_model


def test_cnn_matches_the_classic_layout():
    model = build_model(ModelConfig(model="cnn"), (28, 28, 1), 10)
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == ["Conv2D", "Conv2D", "MaxPooling2D", "Dropout", "Flatten", "Dense"]
    assert [model.layers[0].filters, model.layers[1].filters] == [64, 128]
    assert model.layers[3].rate == 0.5 and model.output_shape == (None, 10)
