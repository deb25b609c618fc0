"""Stop and resume equals an uninterrupted run for models with dropout, without
``--deterministic``: checkpoints carry every rank's random-generator state (the dropout
layers' seed generators, which ``get_weights`` leaves out), and the data plan is a function of
seed and epoch."""

from __future__ import annotations

import pytest

from conftest import REPO, train
from test_preemption import assert_same_run, stop_after_a_step_checkpoint

pytestmark = pytest.mark.distributed
ARGS = ["--epochs", "2", "--batch-size", "16", "--checkpoint-every-steps", "7",
        "--no-tensorboard", "--seed", "9"]


@pytest.mark.parametrize("model", ["cnn", "user_programs:dropout_mlp"])
def test_stop_and_resume_with_dropout_equals_an_uninterrupted_run(tmp_path, model):
    args = [*ARGS, "--model", model]
    paths = {"PYTHONPATH": str(REPO / "tests")}
    straight = train(tmp_path, "straight", *args, **paths)
    run_dir = tmp_path / "stopped"
    code, output = stop_after_a_step_checkpoint(run_dir, *args, "--resume", "auto", **paths)
    assert code == 75, output[-3000:]
    resumed = train(tmp_path, "stopped", *args, "--resume", "auto", **paths)
    assert "resuming after epoch" in resumed.with_suffix(".log").read_text()
    assert_same_run(straight, resumed)
