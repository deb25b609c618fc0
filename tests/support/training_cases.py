"""The training runs of tests/distributed/training/test_training_distributed.py,
test_training_options.py and test_compiled_models.py, grouped into three launches
(``case_jobs.train_together``): every 2-rank case on Horovod's collectives in one job, every
case on TensorFlow's in another, and the one-process references in one process. conftest's
``training_runs`` trains a group when a test first asks for one of its cases; each test then
asserts on its own case's run directory.

The exactness runs: 2 ranks x batch 16 at rate 0.05 (linear scaling: 0.1) against 1 rank x 32
at 0.1. 1,438 training examples do not divide into global batches of 32: the last one is short,
and the equivalence covers it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conftest import EXACT

LOOPS = ("fit", "custom")
# (backend, loop, accumulation steps, bucket order) of the several-buckets test.
BUCKETS = [("horovod", "fit", 2, "ready"), ("tensorflow", "custom", 1, "ready"),
           ("horovod", "custom", 1, "issued")]
# (backend, flag, value) of the reduction tests: each against that backend's exactness run.
REDUCTIONS = [("horovod", "--compression", "fp16"), ("horovod", "--compression", "bf16"),
              ("tensorflow", "--compression", "bf16"), ("horovod", "--reduction", "adasum")]
MIXED_PRECISION = [("mixed_float16", "fit"), ("mixed_float16", "custom"),
                   ("mixed_bfloat16", "fit")]
RESUME_COMMON = ["--momentum", "0.9", "--warmup-epochs", "1", "--seed", "3", "--hidden-units",
                 "32", "--deterministic"]
PLUGIN = """\
import keras

def build(input_shape, num_classes):
    return keras.Sequential([keras.Input(shape=input_shape),
                             keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(num_classes, activation="softmax")])
"""
# Plain SGD, fixed data order, op determinism: the update must not depend on the world size.
EXACT_REGRESSION = ["--model", "workloads:regression_model", "--dataset",
                    "workloads:regression_data", "--epochs", "3", "--optimizer", "sgd",
                    "--momentum", "0", "--warmup-epochs", "0", "--seed", "1", "--deterministic"]
# The model's jit_compile=True run: op determinism would make Keras turn XLA off, so it goes
# without --deterministic (and first in its job, as in a job of its own).
XLA_REGRESSION = [option for option in EXACT_REGRESSION if option != "--deterministic"]
XLA_REGRESSION[XLA_REGRESSION.index("workloads:regression_model")] = \
    "workloads:regression_model_xla"


def compiled_cases(group: str) -> dict[str, list[str]]:
    """test_compiled_models.py's runs of one group: a user's compiled models, arrays, pipelines
    and callbacks (tests/support/workloads.py)."""
    if group == "one":
        return {"reg-1": [*EXACT_REGRESSION, "--batch-size", "32", "--learning-rate", "0.1"]}
    two = ["--batch-size", "16", "--learning-rate", "0.05", "--backend", group]
    found = {f"reg-xla-{group}": [*XLA_REGRESSION, *two],
             f"reg-2-{group}": [*EXACT_REGRESSION, *two]}
    if group == "horovod":
        found.update({
            # Past 0.95 from epoch 7 on (0.97 at 12): the default job's 20 epochs are not
            # needed to show the logits are read as logits (as probabilities it would not learn).
            "logits": ["--model", "workloads:logits_model", "--epochs", "12"],
            "auc": ["--model", "workloads:auc_model", "--dataset", "workloads:even_digits",
                    "--epochs", "3", "--optimizer", "lamb", "--learning-rate", "0.005"],
            "towers": ["--model", "workloads:two_tower_model", "--dataset",
                       "workloads:two_tower_data", "--epochs", "3", "--optimizer",
                       "workloads:adamw", "--learning-rate", "0.002"],
            "pipeline": ["--dataset", "workloads:uneven_pipeline", "--batch-size", "16",
                         "--epochs", "6", "--callbacks", "workloads:early_stop_callbacks"]})
    return found


def plugin_data() -> dict[str, np.ndarray]:
    """A user's .npz whose validation shards differ in size and accuracy: rank 1's shard (ids
    64..100) is mostly noise, so a mean of the ranks' accuracies would not be the global one."""
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((6, 3))
    x = rng.standard_normal((400, 6)).astype(np.float32)
    x_val = rng.standard_normal((101, 6)).astype(np.float32)
    y_val = np.argmax(x_val @ teacher, axis=1)
    y_val[64:] = rng.integers(0, 3, 37)
    return {"x": x, "y": np.argmax(x @ teacher, axis=1), "x_val": x_val, "y_val": y_val}


def two_ranks(backend: str) -> list[str]:
    return [*EXACT, "--batch-size", "16", "--learning-rate", "0.05", "--backend", backend]


def bucket_case(backend: str, loop: str, accumulation: int, order: str) -> str:
    return f"buckets-{backend}-{loop}-{accumulation}"


def powersgd_cases(group: str, tmp: Path) -> dict[str, list[str]]:
    """The exactness run's options with --compression powersgd: 2 epochs; 1 epoch, then
    continued to 2 (--resume), which must end with the same weights; and a GAN's own
    train_step (two optimizers) for one epoch."""
    options = [*two_ranks(group), "--compression", "powersgd"]
    return {f"powersgd-{group}": options,
            f"powersgd-gan-{group}": ["--model", "user_programs:gan_model", "--dataset",
                                      "user_programs:digit_images", "--epochs", "1",
                                      "--batch-size", "16", "--deterministic",
                                      "--no-tensorboard", "--compression", "powersgd",
                                      "--backend", group],
            f"powersgd-half-{group}": [*options, "--epochs", "1"],
            f"powersgd-continued-{group}": [*options, "--run-dir",
                                            str(tmp / f"powersgd-half-{group}"), "--resume"]}


def cases(group: str, tmp: Path) -> dict[str, list[str]]:
    """``name: options`` of one group ("horovod", "tensorflow" or "one"), in training order."""
    if group == "one":
        return {**compiled_cases(group),
                **{f"exact-{loop}-1": [*EXACT, "--loop", loop, "--batch-size", "32",
                                       "--learning-rate", "0.1"] for loop in LOOPS},
                "large-batch": [*EXACT, "--batch-size", "64", "--learning-rate", "0.1"]}
    found = compiled_cases(group)
    found.update({f"exact-{loop}-2-{group}": [*two_ranks(group), "--loop", loop]
                  for loop in LOOPS})
    for backend, loop, accumulation, order in BUCKETS:
        if backend == group:
            found[bucket_case(backend, loop, accumulation, order)] = [
                *EXACT, "--loop", loop, "--batch-size", str(16 // accumulation),
                "--accumulation-steps", str(accumulation), "--learning-rate", "0.05",
                "--bucket-mib", "0.001", "--backend", backend, "--bucket-order", order]
    found[f"accumulated-{group}"] = [*EXACT, "--batch-size", "16", "--accumulation-steps", "2",
                                     "--learning-rate", "0.05", "--backend", group]
    for backend, flag, value in REDUCTIONS:
        if backend == group:
            found[f"reduction-{value}-{group}"] = [*two_ranks(group), flag, value]
    found.update(powersgd_cases(group, tmp))
    if group != "horovod":
        return found
    for precision, loop in MIXED_PRECISION:
        found[f"{precision}-{loop}"] = ["--precision", precision, "--loop", loop, "--epochs",
                                        "4", "--hidden-units", "64"]
    np.savez(tmp / "mine.npz", **plugin_data())
    (tmp / "my_models.py").write_text(PLUGIN)
    # Ranks seeded differently agree after the first step (80 examples, 20% held out: one step
    # of 2 x 32); under horovodrun: the test's own launch.
    found["broadcast-mpirun"] = ["--dataset", "synthetic", "--synthetic-examples", "80",
                                 "--epochs", "1", "--batch-size", "32"]
    found["plugin"] = ["--dataset", "npz", "--data-path", str(tmp / "mine.npz"), "--model",
                       "my_models:build", "--epochs", "6", "--batch-size", "64"]
    # An uninterrupted run; one of 2 of its 4 epochs, then continued to 4 (--resume).
    found["straight"] = ["--epochs", "4", *RESUME_COMMON]
    found["resumed"] = ["--epochs", "2", *RESUME_COMMON]
    found["resumed-continued"] = ["--epochs", "4", *RESUME_COMMON, "--run-dir",
                                  str(tmp / "resumed"), "--resume"]
    return found
