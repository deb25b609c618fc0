"""A user's compiled Keras models with real ranks (regression, logits, binary with AUC and
Precision, two inputs and two outputs), with the user's arrays and tf.data pipeline, optimizers
and callbacks, through the command line and the Python API under horovodrun; an uncompiled
logits model is refused with one line.

The training runs are cases of the three launches of conftest's ``training_runs`` (one per
backend and one process for the references; their command lines in
tests/support/training_cases.py); ``evaluate``, ``predict``, the Python API and the refusal are
launches of their own."""

from __future__ import annotations

import json
import subprocess

import keras
import numpy as np
import pytest

from conftest import (BACKENDS, BIN, LAUNCHER, RANKS, RANK_PYTHONPATH, final_weights, launch,
                      read_metrics, read_summary)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def regression_one_process(training_runs):
    """The regression model trained by one process on the 2-rank run's global batch: the
    exactness tests' reference and the model the predict test serves."""
    return training_runs("one", "reg-1")


@pytest.mark.parametrize("backend", BACKENDS)
def test_jit_compile_true_on_two_ranks_equals_one_process_with_twice_the_batch(
        training_runs, regression_one_process, backend):
    """The model's ``jit_compile=True`` is honoured (XLA for the forward and backward pass; the
    run log says so) and changes no number beyond float32 rounding. Op determinism would make
    Keras turn XLA off, so this run goes without ``--deterministic`` (training_cases'
    ``XLA_REGRESSION``)."""
    two = training_runs(backend, f"reg-xla-{backend}")
    assert "XLA: on for the forward and backward pass" in (two / "hvdtrain.log").read_text()
    for a, b in zip(final_weights(two), final_weights(regression_one_process)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_regression_two_ranks_equal_one_process_with_twice_the_batch(
        training_runs, regression_one_process, backend):
    two = training_runs(backend, f"reg-2-{backend}")
    one = regression_one_process
    for a, b in zip(final_weights(two), final_weights(one)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    ours, theirs = read_summary(two)["metrics"], read_summary(one)["metrics"]
    assert set(ours) == {"val_loss", "val_mae"}
    for name in ours:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-5)
    assert read_metrics(two)[-1]["loss"] < read_metrics(two)[0]["loss"]


def test_logits_model_compiled_from_logits_reaches_the_default_accuracy(training_runs):
    run = training_runs("horovod", "logits")
    assert read_summary(run)["metrics"]["val_accuracy"] >= 0.95


def test_auc_and_precision_on_two_ranks_equal_one_process_over_the_same_set(training_runs):
    """Named optimizer (lamb), AUC and Precision from the compiled model: the 2-rank values are
    the metric over the whole validation set, computed here in one process."""
    run = training_runs("horovod", "auc")
    from workloads import even_digits

    data = even_digits()
    model = keras.saving.load_model(run / "model.keras", safe_mode=True)
    predictions = model.predict(data.x_val, batch_size=1000, verbose=0)
    reported = read_summary(run)["metrics"]
    for metric in (keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision")):
        metric.update_state(data.y_val, predictions)
        assert reported[f"val_{metric.name}"] == pytest.approx(float(metric.result()), abs=1e-5)
    assert 0.8 < reported["val_auc"] <= 1.0
    assert {"auc", "precision", "val_auc", "val_precision"} <= set(read_metrics(run)[-1])


def test_two_inputs_two_outputs_train_evaluate_and_name_their_metrics(training_runs):
    """Dict features, dict targets, loss_weights and sample weights, a user optimizer factory;
    every per-output metric reaches the metrics files, the curves and ``evaluate``."""
    run = training_runs("horovod", "towers")
    rows = read_metrics(run)
    for name in ("loss", "digit_loss", "ink_loss", "digit_accuracy", "ink_mae",
                 "val_digit_accuracy", "val_ink_mae"):
        assert name in rows[-1], name
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["val_digit_accuracy"] > 0.8
    assert (run / "curves.png").stat().st_size > 0
    report = run.parent / "towers-eval.json"
    result = launch(LAUNCHER, 2, ["evaluate", str(run), "--output", str(report)],
                    PYTHONPATH=RANK_PYTHONPATH)
    assert result.returncode == 0, result.stdout + result.stderr
    evaluated = json.loads(report.read_text())
    assert evaluated["digit_accuracy"] == pytest.approx(
        read_summary(run)["metrics"]["val_digit_accuracy"], abs=1e-6)


def test_regression_predict_prints_values(regression_one_process, tmp_path):
    run = regression_one_process
    np.savez(tmp_path / "x.npz", x=np.ones((3, 5), np.float32))
    result = launch("none", 1, ["predict", str(run), "--input", str(tmp_path / "x.npz"),
                                "--output", str(tmp_path / "y.npy")])
    assert result.returncode == 0, result.stderr
    assert np.load(tmp_path / "y.npy").shape == (3, 1)
    assert "class" not in result.stdout and result.stdout.startswith("0: [")


def test_uneven_user_pipeline_finishes_with_equal_steps_and_user_callbacks(training_runs):
    """Rank 0's pipeline yields 63 batches, rank 1's 32: both run 63 steps (no hang); the
    user's callback stops training on every rank at the same epoch."""
    run = training_runs("horovod", "pipeline")
    log = run.with_suffix(".log").read_text()
    assert "63 steps/epoch" in log
    summary = read_summary(run)
    assert summary["weights_identical"] and summary["metrics"]["val_accuracy"] > 0.5
    assert len(read_metrics(run)) < 6          # stopped early by the user's callback


def test_python_api_under_horovodrun(session_tmp):
    out = session_tmp / "api.json"
    command = [str(BIN / "horovodrun"), "-np", "2", str(BIN / "python"),
               str(RANKS / "api_script.py"), str(out), str(session_tmp / "api-run")]
    from conftest import rank_env

    result = subprocess.run(command, cwd=session_tmp, env=rank_env(PYTHONPATH=RANK_PYTHONPATH),
                            text=True, capture_output=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2 and ranks[0]["metrics"] == ranks[1]["metrics"]
    assert set(ranks[0]["metrics"]) == {"val_loss", "val_rmse"}
    assert ranks[0]["metrics"]["val_rmse"] == pytest.approx(ranks[0]["metrics"]["val_loss"] ** 0.5,
                                                            rel=1e-4)
    assert len(set(ranks[0]["fingerprints"])) == 1
    assert ranks[0]["again"] and ranks[0]["policy"] == "float32"
    assert (session_tmp / "api-run" / "model.keras").exists()


def test_uncompiled_logits_model_gets_one_line_not_silent_training(tmp_path):
    result = launch("none", 1, ["train", "--run-dir", str(tmp_path / "r"), "--model",
                                "workloads:uncompiled_logits_model", "--epochs", "1"],
                    PYTHONPATH=RANK_PYTHONPATH)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stdout + result.stderr
    assert lines[-1].startswith("hvdtrain: error: the model's output is not a probability "
                                "distribution") and "from_logits=True" in lines[-1]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "r" / "checkpoints").exists()
