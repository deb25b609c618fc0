"""The built-in models: the CNN keeps the classic Keras MNIST layout (one process), and the
ResNet trained on 2 ranks ends with batch-norm moving statistics that agree across the ranks
(conftest's ``resnet_run``)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from conftest import read_summary
from hvdtrain.config import ModelConfig
from hvdtrain.models import build_model


def test_cnn_matches_the_classic_layout():
    model = build_model(ModelConfig(model="cnn"), (28, 28, 1), 10)
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == ["Conv2D", "Conv2D", "MaxPooling2D", "Dropout", "Flatten", "Dense"]
    assert [model.layers[0].filters, model.layers[1].filters] == [64, 128]
    assert model.layers[3].rate == 0.5 and model.output_shape == (None, 10)


@pytest.mark.distributed
def test_resnet_batch_norm_statistics_agree_across_ranks(resnet_run):
    summary = read_summary(resnet_run)
    assert summary["weights_identical"], summary["fingerprints"]
    model = keras.saving.load_model(resnet_run / "model.keras", safe_mode=True)
    norms = [layer for layer in model.layers
             if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) >= 7
    assert any(np.abs(layer.moving_mean.numpy()).max() > 1e-3 for layer in norms)
