"""The training options and what they change: gradient accumulation equals a larger batch,
fp16 and bf16 compression (bf16 on both backends) and Adasum change the reduction, PowerSGD
keeps the ranks identical and its state across a resume, mixed precision trains and saves float32
(2 ranks each). The learning-rate schedules, in one process:
tests/unit/training/step/test_schedules.py.
The runs are cases of the three launches of conftest's ``training_runs``
(tests/support/training_cases.py); the one-process k-times batch is trained once for both
backends' accumulation (the same command line either way)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from conftest import BACKENDS, assert_same_weights, final_weights, read_metrics, read_summary
from hvdtrain.config import DataConfig
from hvdtrain.data.load import load_source
from training_cases import MIXED_PRECISION, REDUCTIONS


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulation_equals_a_k_times_larger_batch(training_runs, backend):
    """2 ranks x 16 x 2 accumulated (--accumulation-steps 2) against 1 process x 64."""
    accumulated = training_runs(backend, f"accumulated-{backend}")
    large = training_runs("one", "large-batch")
    assert_same_weights(final_weights(accumulated), final_weights(large), atol=2e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("backend, flag, value", REDUCTIONS)
def test_compression_and_adasum_train_and_change_the_reduction(training_runs, backend, flag,
                                                               value):
    """The exactness run's options plus ``flag value``, against the exactness run itself (on
    the same backend)."""
    run = training_runs(backend, f"reduction-{value}-{backend}")
    exact_run = training_runs(backend, f"exact-fit-2-{backend}")
    summary = read_summary(run)
    exact = read_summary(exact_run)
    assert summary["weights_identical"]
    assert summary["fingerprints"][0] != exact["fingerprints"][0]   # the option took effect
    if flag == "--compression":   # rounding only: close to the exact reduction (bf16 measured
        # 1.3e-3 off in weights up to 0.7, val_loss 2e-5 off, 2026-11-29)
        assert_same_weights(final_weights(run), final_weights(exact_run), atol=5e-3)
        assert summary["metrics"]["val_loss"] == pytest.approx(exact["metrics"]["val_loss"],
                                                               abs=1e-3)
        assert summary["metrics"]["val_accuracy"] == pytest.approx(
            exact["metrics"]["val_accuracy"], abs=0.02)
    else:                 # Adasum keeps the single-rank rate (no linear scaling) and learns
        assert read_metrics(run)[0]["lr"] == pytest.approx(0.05)
        losses = [row["loss"] for row in read_metrics(run)]
        assert losses[-1] < losses[0] and summary["metrics"]["val_accuracy"] > 0.6


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_powersgd_keeps_ranks_identical_learns_and_resumes_exactly(training_runs, backend):
    """--compression powersgd on 2 ranks: weights identical on both, the loss goes down, the
    result near the exact reduction's, and 1 epoch + 1 resumed ends where 2 epochs do (the
    error buffers and Q matrices come back from the checkpoint: without them it does not)."""
    run = training_runs(backend, f"powersgd-{backend}")
    training_runs(backend, f"powersgd-continued-{backend}")
    resumed = training_runs(backend, f"powersgd-half-{backend}")
    exact = read_summary(training_runs(backend, f"exact-fit-2-{backend}"))
    summary = read_summary(run)
    assert summary["weights_identical"] and read_summary(resumed)["weights_identical"]
    losses = [row["loss"] for row in read_metrics(run)]
    assert losses[-1] < losses[0]
    assert summary["metrics"]["val_accuracy"] == pytest.approx(
        exact["metrics"]["val_accuracy"], abs=0.05)
    assert_same_weights(final_weights(resumed), final_weights(run), atol=1e-6)
    assert summary["fingerprints"] == read_summary(resumed)["fingerprints"]
    gan = training_runs(backend, f"powersgd-gan-{backend}")   # a model's own train_step
    assert read_summary(gan)["weights_identical"]
    assert "PowerSGD rank 2: 2 of 8 gradients compressed" in (gan / "hvdtrain.log").read_text()


@pytest.mark.distributed
@pytest.mark.parametrize("precision, loop", MIXED_PRECISION)
def test_mixed_precision_trains_and_saves_float32(training_runs, precision, loop):
    run = training_runs("horovod", f"{precision}-{loop}")
    summary = read_summary(run)
    assert summary["weights_identical"] and summary["metrics"]["val_accuracy"] > 0.85
    model = keras.saving.load_model(run / "model.keras", safe_mode=True)
    assert model.dtype_policy.name == "float32"
    assert all(w.dtype == np.float32 for w in model.get_weights())
    x = load_source(DataConfig(), 42).val.x
    assert model.predict(x[:8], verbose=0).dtype == np.float32
