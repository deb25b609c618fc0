"""The training options and what they change: gradient accumulation equals a larger batch,
fp16 compression and Adasum change the reduction, mixed precision trains and saves float32 (2
ranks each). The learning-rate schedules, in one process: tests/unit/step/test_schedules.py."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from conftest import (BACKENDS, EXACT, assert_same_weights, final_weights, read_metrics,
                      read_summary, train)
from hvdtrain.config import DataConfig
from hvdtrain.data.load import load_source


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulation_equals_a_k_times_larger_batch(session_tmp, backend):
    accumulated = train(session_tmp, f"accumulated-{backend}", *EXACT, "--batch-size", "16",
                        "--accumulation-steps", "2", "--learning-rate", "0.05", "--backend",
                        backend)
    large = train(session_tmp, f"large-batch-{backend}", *EXACT, "--batch-size", "64",
                  "--learning-rate", "0.1", np=1)
    assert_same_weights(final_weights(accumulated), final_weights(large), atol=2e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("flag, value", [("--compression", "fp16"), ("--reduction", "adasum")])
def test_compression_and_adasum_train_and_change_the_reduction(session_tmp, exact_runs, flag,
                                                               value):
    run = train(session_tmp, f"reduction-{value}", *EXACT, "--batch-size", "16",
                "--learning-rate", "0.05", flag, value)
    summary = read_summary(run)
    exact = read_summary(exact_runs["fit", 2])
    assert summary["weights_identical"]
    assert summary["fingerprints"][0] != exact["fingerprints"][0]   # the option took effect
    if value == "fp16":   # fp16 rounding only: close to the exact reduction
        assert_same_weights(final_weights(run), final_weights(exact_runs["fit", 2]), atol=5e-3)
        assert summary["metrics"]["val_accuracy"] == pytest.approx(
            exact["metrics"]["val_accuracy"], abs=0.02)
    else:                 # Adasum keeps the single-rank rate (no linear scaling) and learns
        assert read_metrics(run)[0]["lr"] == pytest.approx(0.05)
        losses = [row["loss"] for row in read_metrics(run)]
        assert losses[-1] < losses[0] and summary["metrics"]["val_accuracy"] > 0.6


@pytest.mark.distributed
@pytest.mark.parametrize("precision, loop", [("mixed_float16", "fit"),
                                             ("mixed_float16", "custom"),
                                             ("mixed_bfloat16", "fit")])
def test_mixed_precision_trains_and_saves_float32(session_tmp, precision, loop):
    run = train(session_tmp, f"{precision}-{loop}", "--precision", precision, "--loop", loop,
                "--epochs", "4", "--hidden-units", "64")
    summary = read_summary(run)
    assert summary["weights_identical"] and summary["metrics"]["val_accuracy"] > 0.85
    model = keras.saving.load_model(run / "model.keras", safe_mode=True)
    assert model.dtype_policy.name == "float32"
    assert all(w.dtype == np.float32 for w in model.get_weights())
    x = load_source(DataConfig(), 42).val.x
    assert model.predict(x[:8], verbose=0).dtype == np.float32
