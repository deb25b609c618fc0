"""The uninterrupted runs that the fault tests (tests/distributed/faults) compare a stopped,
killed or requeued and then resumed run with, and the options those runs share. They are
trained once per session, when a test first asks for one, each backend's in one launch
(``case_jobs.train_together``: one TensorFlow import and collectives start for all of them,
each case training what a job of its own trains: conftest's ``uninterrupted``); a test then
asserts its resumed run equals its reference."""

from __future__ import annotations

from pathlib import Path

# Short deterministic epochs (45 steps of 2 x 16 digits): long enough to stop mid-run (a step
# checkpoint every 5 steps) and for a resumed run to cross epoch boundaries.
ARGS = ["--epochs", "3", "--deterministic", "--hidden-units", "64", "--seed", "5",
        "--batch-size", "16", "--checkpoint-every-steps", "5", "--no-tensorboard"]
# A model with dropout, without --deterministic: the resume must restore every rank's
# random-generator state (user_programs.dropout_mlp).
DROPOUT_ARGS = ["--epochs", "2", "--batch-size", "16", "--checkpoint-every-steps", "7",
                "--no-tensorboard", "--seed", "9", "--model", "user_programs:dropout_mlp"]
# A GAN with its own train_step, two optimizers and a noise generator on every rank.
GAN_ARGS = ["--model", "user_programs:gan_model", "--dataset", "user_programs:digit_images",
            "--epochs", "2", "--batch-size", "16", "--checkpoint-every-steps", "5",
            "--deterministic", "--no-tensorboard"]


def cases(backend: str, tmp: Path) -> dict[str, list[str]]:
    """The reference runs on ``backend``'s collectives: both training loops with ``ARGS``
    (named by the loop), the dropout model and the GAN (Horovod's collectives only)."""
    dropout = {"dropout": [*DROPOUT_ARGS, "--backend", backend]}
    if backend == "tensorflow":
        return dropout
    return {"fit": [*ARGS, "--loop", "fit"], "custom": [*ARGS, "--loop", "custom"], **dropout,
            "gan": GAN_ARGS}
