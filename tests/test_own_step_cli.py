"""A model with its own ``train_step`` through the command line: the GAN of the user-program
suite (two models, two optimizers, images without labels) as ``--model module:fn`` and
``--dataset module:fn``, stopped by SIGTERM mid-epoch and resumed, ends where an uninterrupted
run ends: its step checkpoints hold both optimizers and every rank's noise generator."""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import REPO, read_summary, train
from test_preemption import stop_after_a_step_checkpoint

pytestmark = pytest.mark.distributed
TESTS = str(REPO / "tests")
ARGS = ["--model", "user_programs:gan_model", "--dataset", "user_programs:digit_images",
        "--epochs", "2", "--batch-size", "16", "--checkpoint-every-steps", "5",
        "--deterministic", "--no-tensorboard"]


def final_state(run_dir) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(weights, optimizer variables) of the run's last checkpoint (the GAN is saved as
    weights only: Keras cannot serialise a subclass without get_config)."""
    last = run_dir / "checkpoints" / "epoch-0002"
    with np.load(last / "weights.npz") as weights, np.load(last / "optimizer.npz") as slots:
        return ([weights[k] for k in sorted(weights.files)],
                [slots[k] for k in sorted(slots.files)])


def test_gan_through_the_cli_stops_and_resumes_to_the_uninterrupted_result(tmp_path):
    straight = train(tmp_path, "straight", *ARGS, PYTHONPATH=TESTS)
    log = straight.with_suffix(".log").read_text()
    assert "step: the model's own train_step (it defines train_step)" in log
    assert read_summary(straight)["weights_identical"]
    assert (straight / "model.weights.h5").exists()

    run_dir = tmp_path / "stopped"
    code, output = stop_after_a_step_checkpoint(run_dir, *ARGS, "--resume", "auto",
                                                PYTHONPATH=TESTS)
    assert code == 75, output[-3000:]
    assert re.search(r"stopped by SIG\w+ on rank [01].* at epoch \d, step \d+", output)
    resumed = train(tmp_path, "stopped", *ARGS, "--resume", "auto", PYTHONPATH=TESTS)
    assert "resuming after epoch" in resumed.with_suffix(".log").read_text()
    (ours_w, ours_o), (theirs_w, theirs_o) = final_state(resumed), final_state(straight)
    for left, right in zip(ours_w + ours_o, theirs_w + theirs_o):
        np.testing.assert_allclose(left, right, rtol=1e-6, atol=1e-7)
