"""The built-in models on real ranks: the ResNet trained on 2 ranks (conftest's ``resnet_run``)
ends with batch-norm moving statistics that agree across the ranks and are all updated. The
layouts in one process: tests/unit/models/test_models.py."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from conftest import read_summary
from hvdtrain.config import ModelConfig
from hvdtrain.models import build_model
from hvdtrain.training.run import weight_fingerprint


@pytest.mark.distributed
def test_resnet_batch_norm_statistics_agree_across_ranks(resnet_run):
    summary = read_summary(resnet_run)
    assert summary["weights_identical"], summary["fingerprints"]
    model = keras.saving.load_model(resnet_run / "model.keras", safe_mode=True)
    # What the ranks agreed on is the saved model, moving statistics included.
    assert weight_fingerprint(model.weights) == summary["fingerprints"][0]
    norms = [layer for layer in model.layers
             if isinstance(layer, keras.layers.BatchNormalization)]
    built = build_model(ModelConfig(model="resnet", resnet_blocks=1), (16, 16, 3),
                        model.output_shape[-1])
    assert len(norms) == len([layer for layer in built.layers
                              if isinstance(layer, keras.layers.BatchNormalization)]) >= 7
    # Training updated every layer's statistics: none is left at its start (mean 0, variance 1;
    # the first layer's means stay near 0 on the synthetic images, but not at 0).
    for layer in norms:
        assert np.count_nonzero(layer.moving_mean.numpy()) > 0, layer.name
        assert np.count_nonzero(layer.moving_variance.numpy() - 1.0) > 0, layer.name
    assert any(np.abs(layer.moving_mean.numpy()).max() > 1e-3 for layer in norms)
