"""What ``hvdtrain.fit`` and the command line cannot honour as written is refused with one line
naming why and the fix, before training (single process); the model is never trained with an
objective or optimizer other than its own without saying so."""

from __future__ import annotations

import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvdtrain
from conftest import fails_with
from hvdtrain.errors import UserError

GAN = ["--model", "user_programs:gan_model", "--dataset", "user_programs:digit_images",
       "--epochs", "1", "--no-progress"]


def test_a_model_with_its_own_step_refuses_hvdtrains_optimizer_and_padding(capsys, tmp_path):
    fails_with(capsys, [*GAN, "--optimizer", "adam", "--run-dir", str(tmp_path / "a")],
               "--optimizer/--learning-rate choose hvdtrain's optimizer, but this model trains "
               "with its own step (it defines train_step) and its own optimizers; drop them")
    fails_with(capsys, [*GAN, "--remainder", "pad", "--zero-stage", "1",
                        "--run-dir", str(tmp_path / "b")],
               "--remainder pad cannot be exact for the model's own step (it defines "
               "train_step): under --zero-stage or Adasum its optimizers combine the ranks' "
               "gradients unweighted, so a rank's short last batch would count as much as a "
               "whole one; use --remainder drop (or auto)")


def test_steps_per_execution_is_refused(capsys, tmp_path, monkeypatch):
    (tmp_path / "batched_steps.py").write_text(textwrap.dedent("""
        import keras

        def build(shape, classes):
            model = keras.Sequential([keras.Input(shape), keras.layers.Flatten(),
                                      keras.layers.Dense(classes, activation="softmax")])
            model.compile(loss="sparse_categorical_crossentropy", steps_per_execution=4)
            return model
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    fails_with(capsys, ["--model", "batched_steps:build", "--epochs", "1",
                        "--run-dir", str(tmp_path / "r")],
               "the model was compiled with steps_per_execution=4; hvdtrain needs every step "
               "to reach its callbacks (stop votes, checkpoints): compile with "
               "steps_per_execution=1")


def _model() -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy")
    return model


@pytest.mark.parametrize("arguments, message", [
    ({"y": np.zeros(8)}, "a dataset yields its own targets and sample weights; do not also "
                         "give y or sample_weight"),
    ({"validation_split": 0.2}, "validation_split needs arrays; give the dataset's validation "
                                "part as validation_data"),
])
def test_arguments_a_dataset_cannot_take(tmp_path, arguments, message):
    rows = tf.data.Dataset.from_tensor_slices((np.zeros((8, 3), np.float32), np.zeros(8)))
    with pytest.raises(UserError, match=message):
        hvdtrain.fit(_model(), rows, run_dir=str(tmp_path / "r"), epochs=1, progress=False,
                     **arguments)


def test_a_dataset_that_repeats_forever_needs_steps_per_epoch(tmp_path):
    rows = tf.data.Dataset.from_tensor_slices((np.zeros((8, 3), np.float32),
                                               np.zeros(8))).repeat()
    with pytest.raises(UserError, match="the training dataset repeats forever; give "
                                        "steps_per_epoch"):
        hvdtrain.fit(_model(), rows, run_dir=str(tmp_path / "r"), epochs=1, progress=False)
    result = hvdtrain.fit(_model(), rows, steps_per_epoch=3, epochs=2, batch_size=4,
                          run_dir=str(tmp_path / "s"), progress=False, tensorboard=False)
    assert len(result.history.history["loss"]) == 2
