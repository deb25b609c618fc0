"""Users' Keras programs through ``hvdtrain.fit`` on 2 ranks, each against the same program in
one plain Keras process with twice the per-rank batch (the user-program set: ``user_programs``,
``user_data_programs``: a custom ``train_step``, a GAN, a VAE, preprocessing with ``adapt()``, a
Transformer text classifier, an LSTM on a windowed series, a convnet with Keras callbacks and
``class_weight``, a user's own ``tf.data.Dataset``, ``add_loss`` and regularisers).

The program harness (``programs``) runs them one after the other in the ``hvdtrain`` job it
shares with the Keras-example set (after that set's programs: so a later ``fit`` in the same
processes starts clean), on the default backend, and in the one-process reference. Their
gradients travel in buckets of 1,049 bytes, several allreduces per step. They are not run on
TensorFlow's collectives as well: what they vary (data forms, callbacks, a model's own step,
preprocessing) sits above the collectives, whose TensorFlow implementation is held to
Horovod's and to one process by the rank checks (``collective_rank_checks``,
``dropin_rank_checks``: sparse gradients, broadcast objects), the exactness tests
(``test_training_distributed``: several buckets; ``test_zero``: a model's own step with two
optimizers) and the stop tests, on both backends. Deterministic programs (``Spec.tolerance``)
must end within 1e-5 relative of the reference, weights and every epoch's metrics; the others
(random noise drawn per rank, a dataset that reshuffles each pass) within the tolerance stated
per program (``Spec.loss_tolerance``).
"""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest

from programs.jobs import Job, counts, shared_job, weights
from programs.sets import USER as PROGRAMS

pytestmark = pytest.mark.distributed
EXACT = [name for name, spec in PROGRAMS.items() if spec.tolerance is not None]
OWN_STEP = ("custom_train_step", "gan", "vae")


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Job:
    """One plain Keras process with the global batch (shared with the Keras-example set)."""
    return shared_job("keras", tmp_path_factory)


@pytest.fixture(scope="session")
def run(tmp_path_factory) -> Job:
    """hvdtrain on 2 ranks (shared with the Keras-example set)."""
    return shared_job("hvdtrain", tmp_path_factory)


def history(job: Job, name: str, rank: int = 0) -> dict[str, list[float]]:
    """The History of the program's one ``fit``."""
    fits = job.record(name, rank)["fits"]
    assert len(fits) == 1, (name, len(fits))
    return fits[0]["history"]


def test_every_program_ends_with_identical_weights_on_both_ranks(run):
    for name in PROGRAMS:
        fingerprints = run.record(name)["fits"][0]["fingerprints"]
        assert len(fingerprints) == 2 and len(set(fingerprints)) == 1, name
        first, second = (weights(run.record(name, rank)) for rank in (0, 1))
        for left, right in zip(first["model"], second["model"]):
            np.testing.assert_array_equal(left, right, err_msg=name)


@pytest.mark.parametrize("name", EXACT)
def test_deterministic_programs_equal_one_process_with_twice_the_batch(run, reference, name):
    for left, right in zip(weights(run.record(name))["model"],
                           weights(reference.record(name))["model"]):
        np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-6, err_msg=name)
    ours = history(run, name)
    for metric, values in history(reference, name).items():
        assert ours[metric] == pytest.approx(values, rel=1e-5, abs=1e-6), metric


def test_every_history_has_the_keys_of_one_plain_keras_process(run, reference):
    """hvdtrain's own columns stay out of Keras' logs and go to the run's files: the rate of
    each optimizer (a GAN's two by name) and the throughput."""
    for name in PROGRAMS:
        assert set(history(run, name)) == set(history(reference, name)), name
    for name, rates in (("gan", ["d_optimizer_lr", "g_optimizer_lr"]), ("vae", ["lr"])):
        rows = (run.directory(name) / "run-1" / "metrics.jsonl").read_text().splitlines()
        assert all(list(json.loads(row))[-len(rates) - 1:] == [*rates, "examples_per_second"]
                   for row in rows), (name, rows)


def test_own_train_steps_sent_their_gradients_in_several_buckets(run):
    """The models' own train_steps (a custom step, a GAN's two optimizers, a VAE) were
    configured to split their gradients into several allreduces: the run's log line says how
    many buckets the model's trainable variables make (each optimizer of the GAN sends its
    share of them), and the checks in this file hold the results to one process's."""
    for name in OWN_STEP:
        said = "\n".join(run.record(name)["fits"][0]["said"])
        assert "the model's own train_step" in said, (name, said)
        buckets = re.search(r"gradients: [\d.]+ MiB in (\d+) bucket", said)
        assert buckets and int(buckets.group(1)) >= 2, (name, said)


def test_the_models_own_train_step_ran_on_every_rank_as_often_as_in_one_process(run, reference):
    """Models with their own train_step count its calls: each rank ran it once per global
    step, as many times as the one process with the global batch ran it."""
    for name in OWN_STEP:
        expected = reference.record(name)["own_steps"]
        assert expected > 0
        assert [run.record(name, rank)["own_steps"] for rank in (0, 1)] == [expected] * 2, name


def test_gan_and_vae_losses_stay_near_one_process(run, reference):
    """Their noise is drawn per rank (the user seeded one generator), so they are close, not
    equal: every epoch's losses within 10% of the reference's."""
    for name, metrics in (("gan", ("d_loss", "g_loss")),
                          ("vae", ("total_loss", "reconstruction_loss", "kl_loss"))):
        assert PROGRAMS[name].loss_tolerance == 0.1
        for metric in metrics:
            assert history(run, name)[metric] == pytest.approx(
                history(reference, name)[metric], rel=0.1), (name, metric)


def test_every_example_of_an_odd_sized_dataset_is_trained_once_per_epoch(run, reference):
    """Counted by a compiled metric (``user_dataset``): every example once per epoch, so
    neither filler rows nor a batch that updates the metrics outside training may count."""
    epochs = len(history(reference, "user_dataset")["loss"])
    examples = run.record("user_dataset")["notes"]["examples"]
    assert examples == 1001
    own = [counts(run.record("user_dataset", rank)) for rank in (0, 1)]
    seen = Counter(own[0]) + Counter(own[1])
    expected = {example: epochs for example in range(1, examples + 1)}   # ids start at 1
    wrong = {example: seen.get(example, 0) for example in set(seen) | set(expected)
             if seen.get(example, 0) != expected.get(example, 0)}
    assert not wrong, (
        f"{len(wrong)} ids not seen {epochs} times: {dict(sorted(wrong.items())[:10])}")
    trained = [len(rank_counts) for rank_counts in own]
    assert sorted(trained) == [1000, 1001] or sum(trained) >= 1001      # both ranks trained
    assert history(run, "user_dataset")["loss"] == pytest.approx(
        history(reference, "user_dataset")["loss"], rel=PROGRAMS["user_dataset"].loss_tolerance)


def test_keras_callbacks_decide_as_in_one_process_and_write_once(run, reference):
    """EarlyStopping and ReduceLROnPlateau act at the same epochs as in one process (the
    logs they see are exact and the same on every rank); ModelCheckpoint and CSVLogger write
    from rank 0 only."""
    ours, theirs = history(run, "convnet_callbacks"), history(reference, "convnet_callbacks")
    assert len(ours["loss"]) == len(theirs["loss"]) < 12
    assert ours["learning_rate"] == pytest.approx(theirs["learning_rate"])
    assert min(theirs["learning_rate"]) < max(theirs["learning_rate"])
    assert history(run, "convnet_callbacks", rank=1) == ours
    written = run.directory("convnet_callbacks")
    log = (written / "log.csv").read_text().splitlines()
    assert len(log) == 1 + len(ours["loss"])        # a header, one row per epoch
    assert (written / "best.keras").stat().st_size > 0
    assert len(list((written / "tensorboard" / "train").glob("events.out.tfevents.*"))) == 1


def test_keras_arguments_and_a_rate_scheduler_behave_as_in_one_process(run, reference):
    """validation_split takes the same last quarter, validation runs after epochs 2 and 4
    only, training starts at initial_epoch 1, and the scheduler's halved rates are used."""
    ours, theirs = history(run, "keras_arguments"), history(reference, "keras_arguments")
    assert len(ours["loss"]) == len(theirs["loss"]) == 3
    assert len(ours["val_loss"]) == len(theirs["val_loss"]) == 2


def test_rank_dependent_adapt_ends_with_rank_0s_vocabulary_everywhere(run, reference):
    vocabularies = [run.record("preprocessing", rank)["notes"]["lookups"] for rank in (0, 1)]
    assert vocabularies[0] == vocabularies[1] == reference.record("preprocessing")["notes"][
        "lookups"]
