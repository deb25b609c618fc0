"""What a finished run leaves and serves, on the ResNet run of conftest's ``resnet_run``:
TensorBoard events and the curves plot for every epoch, ``evaluate`` on 2 ranks exactly equal
to the run's own validation metrics, and ``predict`` printing classes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

from conftest import LAUNCHER, launch, read_summary


@pytest.mark.distributed
def test_tensorboard_events_and_curves_png(resnet_run):
    events = list((resnet_run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    seen: dict[str, list[int]] = {}
    for event in tf.compat.v1.train.summary_iterator(str(events[0])):
        for value in event.summary.value:
            seen.setdefault(value.tag, []).append(event.step)
    for tag in ("loss", "accuracy", "val_loss", "val_accuracy", "lr", "examples_per_second"):
        assert seen[tag] == [1, 2, 3], tag
    import matplotlib.image

    png = resnet_run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(png).shape[:2]
    assert width > 3 * height > 600


@pytest.mark.distributed
def test_evaluate_is_exact_on_two_ranks_and_predict_prints_classes(resnet_run, tmp_path):
    report = tmp_path / "evaluation.json"
    result = launch(LAUNCHER, 2, ["evaluate", str(resnet_run), "--output", str(report)])
    assert result.returncode == 0, result.stdout + result.stderr
    reported = json.loads(report.read_text())
    summary = read_summary(resnet_run)["metrics"]
    assert (reported["examples"], reported["ranks"]) == (64, 2)
    assert reported["accuracy"] == pytest.approx(summary["val_accuracy"], abs=1e-9)
    assert reported["loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    np.save(tmp_path / "inputs.npy", np.zeros((3, 16, 16, 3), np.float32))
    result = launch("none", 1, ["predict", str(resnet_run), "--input",
                                str(tmp_path / "inputs.npy"), "--output",
                                str(tmp_path / "p.npy")])
    assert result.returncode == 0, result.stderr
    assert [line.split(":")[0] for line in result.stdout.splitlines()[:3]] == ["0", "1", "2"]
    assert np.load(tmp_path / "p.npy").shape == (3, 10)
