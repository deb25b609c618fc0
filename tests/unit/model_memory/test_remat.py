"""``--remat``: Keras' rematerialisation modes on a user's model for the run, single process.
Each mode trains the weights no remat trains (a Dropout in the recomputed calls draws its mask
again with the same seed, a BatchNormalization's moving statistics are updated once), the log
names what recomputes, and the layers leave the run as they
came (no remat mode, their own ``call``)."""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

import hvdtrain
from hvdtrain.errors import UserError

ROWS = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")


def _model(policy: str = "float32") -> keras.Model:
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="d1"),
            keras.layers.BatchNormalization(name="bn"), keras.layers.Dropout(0.2, name="drop"),
            keras.layers.Dense(1, name="d2")])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _trained(tmp_path, name: str, remat: str, policy: str = "float32",
             caplog=None) -> list[np.ndarray]:
    model = _model(policy)
    hvdtrain.fit(model, ROWS, ROWS[:, :1], batch_size=16, epochs=1, seed=1, deterministic=True,
                 run_dir=str(tmp_path / name), progress=False, tensorboard=False, remat=remat,
                 remat_layers=["d1"], remat_threshold=8)
    assert all("call" not in vars(layer) and layer._remat_mode is None
               for layer in model.layers)
    return model.get_weights()


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_each_mode_trains_what_no_remat_trains(tmp_path, caplog, policy):
    caplog.set_level(logging.INFO, logger="hvdtrain")
    plain = _trained(tmp_path, "none", "none", policy)
    modes = ["full", "activations", "larger_than", "list_of_layers"]
    for mode in modes if policy == "float32" else ["full"]:
        for ours, theirs in zip(_trained(tmp_path, mode, mode, policy), plain):
            np.testing.assert_array_equal(ours, theirs, err_msg=mode)
    said = caplog.text
    assert "remat full: 4 layer(s) recompute their call in the backward pass" in said
    if policy == "float32":
        assert "remat list_of_layers: 1 layer(s) recompute their call" in said and "d1" in said
        assert "remat activations: 2 layer(s) recompute their activation" in said  # linear too


def test_a_layer_name_the_model_lacks_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="--remat-layers names no layer of sequential.*: nope"):
        hvdtrain.fit(_model(), ROWS, ROWS[:, :1], batch_size=16, epochs=1, remat="list_of_layers",
                     remat_layers=["nope"], run_dir=str(tmp_path / "r"), progress=False)
