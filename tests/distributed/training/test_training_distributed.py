"""The trainer core, proven with real ranks started by launch/mpirun.sh (and horovodrun).

The training runs these tests read (and test_training_options.py's and
test_compiled_models.py's) are trained in three launches, one per backend and one process for
the references (conftest's ``training_runs``, tests/support/training_cases.py): each run is the
command line it was as a job of its own, in ranks that had trained other cases before it (a run
restores the process-wide state it set; Keras' session is cleared between cases)."""

from __future__ import annotations

import math
import re

import keras
import numpy as np
import pytest

from conftest import (BACKENDS, LAUNCHER, assert_partition, assert_same_weights, final_weights,
                      launch, probe_shards, read_metrics, read_summary, train)
from hvdtrain.config import ModelConfig
from hvdtrain.models import build_model
from training_cases import BUCKETS, bucket_case, plugin_data

pytestmark = pytest.mark.distributed


def exact(training_runs, loop: str, ranks: int, backend: str = "horovod"):
    """The exactness run of ``loop`` on 2 ranks of ``backend``, or its one-process reference."""
    if ranks == 1:
        return training_runs("one", f"exact-{loop}-1")
    return training_runs(backend, f"exact-{loop}-2-{backend}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_two_ranks_compute_what_one_process_with_twice_the_batch_does(training_runs, loop,
                                                                      backend):
    two = final_weights(exact(training_runs, loop, 2, backend))
    one = final_weights(exact(training_runs, loop, 1))
    assert_same_weights(two, one, atol=2e-5)
    # The tolerance is far below how far training moved the weights from their start.
    keras.utils.set_random_seed(1)
    start = build_model(ModelConfig(hidden_units=[32], weight_decay=0.001), (8, 8, 1),
                        10).get_weights()
    assert max(np.abs(a - b).max() for a, b in zip(one, start)) > 0.05
    assert read_summary(exact(training_runs, loop, 2, backend))["weights_identical"]
    log = exact(training_runs, loop, 2, backend).with_suffix(".log").read_text()
    assert f"backend: {backend} (as asked)" in log


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_both_backends_end_with_the_same_weights(training_runs, loop):
    """The same deterministic run on Horovod's collectives and on TensorFlow's: the sums are
    taken in the same order (two ranks), so the weights agree bit for bit or within 1e-6."""
    assert_same_weights(final_weights(exact(training_runs, loop, 2, "horovod")),
                        final_weights(exact(training_runs, loop, 2, "tensorflow")), atol=1e-6)


@pytest.mark.parametrize("backend, loop, accumulation, order", BUCKETS)
def test_gradients_in_several_buckets_compute_what_one_process_does(training_runs, backend, loop,
                                                                    accumulation, order):
    """--bucket-mib 0.001 (1,049 bytes) sends the MLP's gradients in several allreduces, the
    loss and the stop votes riding in the first, submitted as each is ready or (``--bucket-order
    issued``) each after the one before: 2 ranks x b (x k accumulated) still make the update of
    one process with the whole batch, and the same as one group (within 1e-6 on the same
    backend and loop). Submitted as ready, one update at a time, the first 16 steps time the
    buckets against one group and the run keeps one (``--bucket-choice measured``): a switch
    of the traced step mid-epoch that changes no update."""
    run = training_runs(backend, bucket_case(backend, loop, accumulation, order))
    log = run.with_suffix(".log").read_text()
    buckets = re.search(r"gradients: [\d.]+ MiB in (\d+) bucket", log)
    assert buckets and int(buckets.group(1)) >= 2
    # Both backends run the buckets in issue order only when asked (the line describes the
    # step's own reduction). Accumulated, every bucket leaves at once.
    in_order = "each sent once the one before has completed (one order on every rank)"
    assert (in_order in log) == (accumulation == 1 and order == "issued"), log[-2000:]
    assert ("kept for the run" in log) == (accumulation == 1 and order == "ready"), log[-2000:]
    assert_same_weights(final_weights(run), final_weights(exact(training_runs, loop, 1)),
                        atol=2e-5)
    if accumulation == 1:
        assert_same_weights(final_weights(run),
                            final_weights(exact(training_runs, loop, 2, backend)), atol=1e-6)
    assert read_summary(run)["weights_identical"]


def test_fit_and_custom_loop_give_the_same_result(training_runs):
    fit, custom = exact(training_runs, "fit", 2), exact(training_runs, "custom", 2)
    assert_same_weights(final_weights(fit), final_weights(custom), atol=1e-6)
    fit, custom = read_metrics(fit), read_metrics(custom)
    for a, b in zip(fit, custom):
        assert a["val_accuracy"] == pytest.approx(b["val_accuracy"], abs=1e-9)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


def test_sharding_is_a_partition_with_equal_steps(tmp_path):
    # 1,001 examples, 2 ranks x 16: 32 steps, the last global batch holds 9 examples.
    [records] = probe_shards(tmp_path, ("arrays", "1001", 16))
    assert_partition(records, 1001, steps=32)


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_ranks_seeded_differently_agree_after_the_first_step(session_tmp, training_runs,
                                                             launcher):
    """Each launcher's rank variables seed the ranks differently. The mpirun run is a case of
    the Horovod job (launch/mpirun.sh); horovodrun's is a launch of its own."""
    # 80 synthetic examples, 20% held out: 64 to train = one step of 2 x 32.
    if launcher == "mpirun":
        run = training_runs("horovod", "broadcast-mpirun")
    else:
        run = train(session_tmp, f"broadcast-{launcher}", "--dataset", "synthetic",
                    "--synthetic-examples", "80", "--epochs", "1", "--batch-size", "32",
                    launcher=launcher)
    summary = read_summary(run)
    before = summary["fingerprints_before_broadcast"]
    assert len(before) == 2 and before[0] != before[1]     # the seeds really differ per rank
    assert summary["weights_identical"] and len(set(summary["fingerprints"])) == 1
    assert [row["epoch"] for row in read_metrics(run)] == [1]


def test_user_model_and_npz_train_and_eval_is_exact(training_runs):
    """Validation shards of unequal size and accuracy: the reported accuracy is the global one
    (the model plugin and the .npz: tests/support/training_cases.py)."""
    data = plugin_data()
    x_val, y_val = data["x_val"], data["y_val"]
    run = training_runs("horovod", "plugin")
    model = keras.saving.load_model(run / "model.keras", safe_mode=True)
    correct = np.argmax(model.predict(x_val, verbose=0), axis=1) == y_val
    shard_means = correct[:64].mean(), correct[64:].mean()
    reported = read_summary(run)["metrics"]["val_accuracy"]
    # The global value to float32 resolution (Keras keeps metric state in float32).
    assert reported == pytest.approx(correct.mean(), abs=1e-6)
    assert abs(np.mean(shard_means) - correct.mean()) > 0.02   # a mean of means would differ
    assert correct[:64].mean() > 0.8                            # the plugin model learned


@pytest.fixture(scope="module")
def resume_runs(training_runs):
    """An uninterrupted 4-epoch run, and one of 2 epochs continued to 4 with --resume."""
    straight = training_runs("horovod", "straight")
    resumed = training_runs("horovod", "resumed")
    training_runs("horovod", "resumed-continued")
    return straight, resumed


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(resume_runs):
    straight, resumed = resume_runs
    assert_same_weights(final_weights(straight), final_weights(resumed), atol=1e-6)
    assert [row["epoch"] for row in read_metrics(resumed)] == [1, 2, 3, 4]
    for a, b in zip(read_metrics(straight), read_metrics(resumed)):
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-6)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)


def test_logged_learning_rate_follows_scaling_and_warmup(resume_runs):
    straight, _ = resume_runs
    steps = math.ceil(1438 / 64)             # digits train split, 2 ranks x 32
    base, target = 0.05, 0.05 * 2            # linear scaling for 2 ranks
    expected = [base + (target - base) * min(1.0, (epoch * steps - 1) / steps)
                for epoch in (1, 2, 3, 4)]
    assert [row["lr"] for row in read_metrics(straight)] == pytest.approx(expected, rel=1e-6)
    assert read_metrics(straight)[0]["lr"] < target


def test_run_directory_holds_what_a_user_needs(resume_runs):
    straight, _ = resume_runs
    names = {p.name for p in straight.iterdir()}
    assert {"config.yaml", "metrics.jsonl", "metrics.csv", "model.keras", "summary.json",
            "checkpoints", "tensorboard", "curves.png"} <= names
    assert [p.name for p in sorted((straight / "checkpoints").iterdir())] == [
        "epoch-0002", "epoch-0003", "epoch-0004"]
    header = (straight / "metrics.csv").read_text().splitlines()[0]
    assert header == "epoch,loss,accuracy,val_loss,val_accuracy,lr,examples_per_second"
    assert oct(straight.stat().st_mode & 0o777) == "0o700"


def test_starting_over_an_existing_run_is_refused(resume_runs):
    straight, _ = resume_runs
    before = (straight / "metrics.jsonl").read_text()
    result = launch(LAUNCHER, 2, ["--run-dir", str(straight), "--epochs", "1"])
    assert result.returncode != 0
    assert "already holds a run; pass --resume" in result.stderr
    assert (straight / "metrics.jsonl").read_text() == before


def test_embedded_default_reaches_the_stated_accuracy(session_tmp):
    """The README's main command: the default MLP on digits, 2 ranks, 20 epochs."""
    run_dir = session_tmp / "default"
    result = launch("horovodrun", 2, ["--run-dir", str(run_dir)], cwd=session_tmp)
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy >= 0.95
    assert accuracy == pytest.approx(read_summary(run_dir)["metrics"]["val_accuracy"], abs=1e-4)
    assert "epoch 20/20" in result.stdout and "ex/s" in result.stdout
    summary = read_summary(run_dir)
    assert 0 < summary["setup_seconds"] < summary["first_step_seconds"] < 600
    assert "startup: the first training step ended" in result.stdout
