"""``hvdtrain.fit`` as a script or notebook uses it, with real ranks (``fit_api_checks``): a
failure on one rank leaves no rank waiting and the next ``fit`` works; Keras'
``BackupAndRestore`` continues an interrupted run exactly; a user pipeline shards without
overlap; synchronized batch normalisation trains as one process with the global batch;
Keras' console and its callbacks' messages show once, from rank 0."""

from __future__ import annotations

import json
import re

import pytest

from conftest import LAUNCHER, RANK_PYTHONPATH, launch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[list[dict], str]:
    """What every rank saw, and what the job printed (both ranks' stdout)."""
    out = tmp_path_factory.mktemp("fit-api")
    result = launch(LAUNCHER, 2, [str(out)], module="fit_api_checks", cwd=out, timeout=300,
                    PYTHONPATH=RANK_PYTHONPATH)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "checks.json").read_text()), result.stdout


@pytest.fixture(scope="module")
def checks(launched) -> list[dict]:
    return launched[0]


def test_an_error_on_one_rank_ends_both_at_once_and_the_next_fit_works(checks):
    rank0, rank1 = (rank["failure"] for rank in checks)
    assert rank1["failure"] == "RuntimeError: the user's callback failed on rank 1"
    assert rank0["failure"].startswith("PeerFailed: another rank ended with an error")
    assert rank0["failed_after_s"] < 30 and rank1["failed_after_s"] < 30
    assert len(set(rank0["again_fingerprints"])) == 1
    assert rank0["again_fingerprints"] == rank1["again_fingerprints"]


def test_keras_console_and_callback_messages_show_once_with_the_exact_values(launched):
    """``verbose=2``: Keras' line per epoch, from rank 0 alone, ending with the exact global
    values the History holds (Keras' order); ``EarlyStopping`` and ``ReduceLROnPlateau`` with
    ``verbose=1`` say their one message once, not once per rank."""
    checks, output = launched
    history = checks[0]["failure"]["again_history"]
    assert history == checks[1]["failure"]["again_history"]
    assert list(history) == ["accuracy", "loss", "learning_rate"]
    assert output.count("Epoch 2/2") == 1
    lines = re.findall(r"\d+/\d+ - \d+s - [^\n]*", output)
    assert len(lines) == 2, output[-3000:]
    for epoch, line in enumerate(lines):
        assert (f"- accuracy: {history['accuracy'][epoch]:.4f} - loss: "
                f"{history['loss'][epoch]:.4f} - learning_rate: ") in line, line
    assert output.count("Epoch 2: early stopping") == 1
    assert output.count("Epoch 2: ReduceLROnPlateau reducing learning rate") == 1


def test_backup_and_restore_continues_an_interrupted_run_exactly(checks):
    for rank in checks:
        backup = rank["backup"]
        assert backup["interrupted"] == "interrupted"
        assert backup["resumed_epochs"] == 2           # epochs 3 and 4 of 4
        assert backup["difference"] == 0.0             # the uninterrupted run's weights
        assert not backup["backup_left"]               # Keras deletes it when training ends


def test_a_pipeline_shuffled_with_the_shards_seed_then_sharded_trains_each_example_once(checks):
    """The README's pipeline: shuffle(seed=shard.seed + shard.epoch), then shard. TensorFlow's
    global seed is the same on every rank, so both ranks shuffle alike and their shards are
    disjoint: over 2 epochs every one of the 1,797 examples is seen exactly twice in all."""
    import numpy as np

    counts = np.add(*(np.array(rank["pipeline"]["counts"]) for rank in checks))
    assert counts[0] == 0 and np.all(counts[1:] == 2) and len(counts) == 1798


def test_synchronized_batch_norm_on_two_ranks_equals_one_process_with_the_global_batch(checks):
    """A ``BatchNormalization(synchronized=True)`` and a plain one under
    ``sync_batch_norm=True``: 2 ranks x 16 end within 1e-5 of Keras' own ``fit`` of 1 x 32
    (unsynchronized, they end 0.1 apart), and each layer is as it was after the run."""
    for rank in checks:
        found = rank["batch_norm"]
        assert found["difference"] < 1e-5 and found["left_as_they_were"], found


def test_the_command_line_shows_a_one_rank_error_once(tmp_path):
    """The failing rank shows its traceback; the other ends at once, quietly, exit 1."""
    result = launch(LAUNCHER, 2, ["--callbacks", "fit_api_checks:failing_on_rank_1",
                                  "--epochs", "3", "--run-dir", str(tmp_path / "r"),
                                  "--no-progress"], cwd=tmp_path,
                    PYTHONPATH=RANK_PYTHONPATH)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("Traceback (most recent call last)") == 1, output[-3000:]
    assert "RuntimeError: the user's callback failed on rank 1" in output
    assert "hvdtrain: error" not in output
