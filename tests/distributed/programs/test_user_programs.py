"""Users' Keras programs through ``hvdtrain.fit`` on 2 ranks, each against the same program in
one plain Keras process with twice the per-rank batch (``user_programs``: a custom
``train_step``, a GAN, a VAE, preprocessing with ``adapt()``, a Transformer text classifier,
an LSTM on a windowed series, a convnet with Keras callbacks and ``class_weight``, a user's own
``tf.data.Dataset``, ``add_loss`` and regularisers).

All programs run one after the other in one 2-rank job per backend (and the references in one
process, once for both backends), which also shows that a second ``fit`` in the same processes
starts clean. Deterministic programs (``Program.exact``) must end within 1e-5 relative of the
reference, weights and every epoch's metrics; the others (random noise drawn per rank, a dataset
that reshuffles each pass) within the tolerance stated per check.
"""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest

from conftest import BACKENDS, BIN, LAUNCHER, RANK_PYTHONPATH, launch, rank_env

from user_programs import PROGRAMS

pytestmark = pytest.mark.distributed
BATCH = 32   # per rank; the reference runs 2 x BATCH in one process
# 1,049 bytes: the programs' gradients travel in several allreduces. The default (4 MiB, one
# bucket for models this small) is the path of every other exactness test.
BUCKET_MIB = "0.001"
EXACT = ["custom_train_step", "preprocessing", "text_transformer", "lstm_timeseries",
         "convnet_callbacks", "regularised_regression", "keras_arguments", "py_dataset"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The one-process reference's records: run once for both backends (it does not depend on
    them; about 20 s on the project's 2-core VM)."""
    out = tmp_path_factory.mktemp("user-programs-keras")
    result = subprocess.run(
        [str(BIN / "python"), "-m", "user_program_ranks", "keras", str(out), str(2 * BATCH)],
        cwd=out, env=rank_env(PYTHONPATH=RANK_PYTHONPATH), text=True, capture_output=True,
        timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / "keras-0.json").read_text())


@pytest.fixture(scope="module", params=BACKENDS)
def runs(tmp_path_factory, request, reference):
    """(every rank's records under hvdtrain on one backend, the one-process reference's
    records, the hvdtrain job's directory)."""
    out = tmp_path_factory.mktemp(f"user-programs-{request.param}")
    result = launch(LAUNCHER, 2, ["hvdtrain", str(out), str(BATCH)],
                    module="user_program_ranks", timeout=420, PYTHONPATH=RANK_PYTHONPATH,
                    HVDTRAIN_BACKEND=request.param, USER_PROGRAMS_BUCKET_MIB=BUCKET_MIB)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    ranks = [json.loads((out / f"hvdtrain-{rank}.json").read_text()) for rank in (0, 1)]
    return ranks, reference, out


def weights(record: dict) -> list[np.ndarray]:
    with np.load(record["weights"]) as archive:
        return [archive[key] for key in archive.files]


def test_every_program_ends_with_identical_weights_on_both_ranks(runs):
    ranks, _, _ = runs
    assert set(ranks[0]) == set(PROGRAMS)
    for name in PROGRAMS:
        fingerprints = ranks[0][name]["fingerprints"]
        assert len(fingerprints) == 2 and len(set(fingerprints)) == 1, name
        for left, right in zip(weights(ranks[0][name]), weights(ranks[1][name])):
            np.testing.assert_array_equal(left, right, err_msg=name)


@pytest.mark.parametrize("name", EXACT)
def test_deterministic_programs_equal_one_process_with_twice_the_batch(runs, name):
    ranks, reference, _ = runs
    ours, theirs = ranks[0][name], reference[name]
    for left, right in zip(weights(ours), weights(theirs)):
        np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-6, err_msg=name)
    for metric, values in theirs["history"].items():
        assert ours["history"][metric] == pytest.approx(values, rel=1e-5, abs=1e-6), metric


def test_every_history_has_the_keys_of_one_plain_keras_process(runs):
    """hvdtrain's own columns stay out of Keras' logs and go to the run's files: the rate of
    each optimizer (a GAN's two by name) and the throughput."""
    ranks, reference, out = runs
    for name in PROGRAMS:
        assert set(ranks[0][name]["history"]) == set(reference[name]["history"]), name
    for name, rates in (("gan", ["d_optimizer_lr", "g_optimizer_lr"]), ("vae", ["lr"])):
        rows = (out / f"hvdtrain-{name}" / "run" / "metrics.jsonl").read_text().splitlines()
        assert all(list(json.loads(row))[-len(rates) - 1:] == [*rates, "examples_per_second"]
                   for row in rows), (name, rows)


def test_own_train_steps_sent_their_gradients_in_several_buckets(runs):
    """The models' own train_steps (a custom step, a GAN's two optimizers, a VAE) were
    configured to split their gradients into several allreduces: the run's log line says how
    many buckets the model's trainable variables make (each optimizer of the GAN sends its
    share of them), and the checks in this file hold the results to one process's."""
    ranks, _, _ = runs
    for name in ("custom_train_step", "gan", "vae"):
        said = "\n".join(ranks[0][name]["said"])
        assert "the model's own train_step" in said, (name, said)
        buckets = re.search(r"gradients: [\d.]+ MiB in (\d+) bucket", said)
        assert buckets and int(buckets.group(1)) >= 2, (name, said)


def test_the_models_own_train_step_ran_on_every_rank_as_often_as_in_one_process(runs):
    """Models with their own train_step count its calls: each rank ran it once per global
    step, as many times as the one process with the global batch ran it."""
    ranks, reference, _ = runs
    for name in ("custom_train_step", "gan", "vae"):
        expected = reference[name]["steps"]
        assert expected > 0
        assert [ranks[0][name]["steps"], ranks[1][name]["steps"]] == [expected, expected], name


def test_gan_and_vae_losses_stay_near_one_process(runs):
    """Their noise is drawn per rank (the user seeded one generator), so they are close, not
    equal: every epoch's losses within 10% of the reference's."""
    ranks, reference, _ = runs
    for name, metrics in (("gan", ("d_loss", "g_loss")),
                          ("vae", ("total_loss", "reconstruction_loss", "kl_loss"))):
        for metric in metrics:
            assert ranks[0][name]["history"][metric] == pytest.approx(
                reference[name]["history"][metric], rel=0.1), (name, metric)


def test_every_example_of_an_odd_sized_dataset_is_trained_once_per_epoch(runs):
    """Counted by a compiled metric (``user_dataset``): every example once per epoch, so
    neither filler rows nor a batch that updates the metrics outside training may count."""
    ranks, reference, _ = runs
    epochs = len(reference["user_dataset"]["history"]["loss"])
    seen = np.add(*(np.array(r["user_dataset"]["notes"]["counts"]) for r in ranks))
    assert ranks[0]["user_dataset"]["notes"]["examples"] == 1001
    wrong = {int(i): int(seen[i]) for i in np.flatnonzero(seen != epochs) if i}
    assert seen[0] == 0 and not wrong, (   # ids start at 1
        f"{len(wrong)} ids not seen {epochs} times: {dict(list(wrong.items())[:10])}")
    own = [np.count_nonzero(r["user_dataset"]["notes"]["counts"]) for r in ranks]
    assert sorted(own) == [1000, 1001] or sum(own) >= 1001      # both ranks trained
    assert ranks[0]["user_dataset"]["history"]["loss"] == pytest.approx(
        reference["user_dataset"]["history"]["loss"], rel=0.05)


def test_keras_callbacks_decide_as_in_one_process_and_write_once(runs):
    """EarlyStopping and ReduceLROnPlateau act at the same epochs as in one process (the
    logs they see are exact and the same on every rank); ModelCheckpoint and CSVLogger write
    from rank 0 only."""
    ranks, reference, out = runs
    ours, theirs = ranks[0]["convnet_callbacks"], reference["convnet_callbacks"]
    assert len(ours["history"]["loss"]) == len(theirs["history"]["loss"]) < 12
    assert ours["history"]["learning_rate"] == pytest.approx(theirs["history"]["learning_rate"])
    assert min(theirs["history"]["learning_rate"]) < max(theirs["history"]["learning_rate"])
    assert ranks[1]["convnet_callbacks"]["history"] == ours["history"]
    written = out / "hvdtrain-convnet_callbacks"
    log = (written / "log.csv").read_text().splitlines()
    assert len(log) == 1 + len(ours["history"]["loss"])        # a header, one row per epoch
    assert (written / "best.keras").stat().st_size > 0
    assert len(list((written / "tensorboard" / "train").glob("events.out.tfevents.*"))) == 1


def test_keras_arguments_and_a_rate_scheduler_behave_as_in_one_process(runs):
    """validation_split takes the same last quarter, validation runs after epochs 2 and 4
    only, training starts at initial_epoch 1, and the scheduler's halved rates are used."""
    ranks, reference, _ = runs
    ours, theirs = ranks[0]["keras_arguments"], reference["keras_arguments"]
    assert len(ours["history"]["loss"]) == len(theirs["history"]["loss"]) == 3
    assert len(ours["history"]["val_loss"]) == len(theirs["history"]["val_loss"]) == 2


def test_rank_dependent_adapt_ends_with_rank_0s_vocabulary_everywhere(runs):
    ranks, reference, _ = runs
    vocabularies = [r["preprocessing"]["notes"]["lookups"] for r in ranks]
    assert vocabularies[0] == vocabularies[1] == reference["preprocessing"]["notes"]["lookups"]
