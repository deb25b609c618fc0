"""The Keras-example set (``keras_programs``, ``keras_pipelines``: issue 27's real-program shapes;
``keras_examples``, ``keras_coupled_examples``: issue 46's) on 2 ranks, through ``hvdtrain.fit``
(on the default backend) and through the Horovod drop-in, each against the same program in one
plain Keras process with the global batch.

The program harness (``programs``) runs every program of a mode one after the other: on 2
ranks, the ``hvdtrain`` mode (with the user-program set's programs) and then, in the same
processes, the drop-in's (``import hvdtrain.keras as hvd``); in one process, the reference
(both sets). Both launches run once per session, at the same time, when a test first
needs one. (hvdtrain on TensorFlow's collectives is held to one process by other files' tests:
``test_training_distributed``, ``test_compiled_models``, ``test_zero`` and the rank checks, on
both backends.) The checks, per program and run:

* both ranks end with identical weights;
* weights and every epoch's metrics within the program's stated tolerance of one process
  (1e-5 relative where the program draws nothing at random; the drop-in's is wider where a
  rank's last batch is smaller than the other's, since its update is a mean of the ranks'
  means; see ``programs.harness.Spec``);
* the History and the batch logs (what users' callbacks see) have exactly one process's keys;
* every epoch runs as many steps as in one process, on both ranks, and a model's own
  ``train_step`` runs as often as in one process;
* every example is trained on (and validated on) as often as in one process, counted per
  example id, for the programs that say so exactly once per epoch (odd example counts, uneven
  shards, seeded, unseeded-and-refused and function-built shuffles). Why through a compiled
  metric (``programs.harness.SeenIds``, on an extra output that echoes an id input):
  hvdtrain's exact step fills a rank that runs short with real batches of its own data
  carrying loss weight zero, which a layer counting ids in the forward pass would count too,
  while compiled metrics are updated with real rows only; Keras updates them once per example
  trained on or validated on, so training and validation ids (disjoint ranges) come out of one
  counter. A model with its own ``train_step`` (the Distiller) counts in its step, which never
  sees filler. The count therefore also holds hvdtrain to updating a user's compiled metrics
  nowhere else (no probe batch, no extra evaluation);
* where a batch's rows are coupled (a loss over the batch, batch normalisation per rank;
  ``Spec.coupled``): hvdtrain is one process's to 1e-5, or rank 0 says so in one line at the
  start of each ``fit``, naming the loss (or "each rank normalises by its own batch");
* and the program-specific checks below: the unseeded shuffle's refusal, random state after
  ``fit``, ``steps_per_epoch`` beyond the data, the pre-batched pipeline's global batch,
  callbacks that write files writing each once, the drop-in keeping the user's optimizer (a
  schedule without ``get_config``).

Each launch's wall time is printed (``-s``) and its output kept under its temporary directory
(``programs.jobs``).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from programs.harness import VAL_IDS
from programs.jobs import Job, counts, shared_job, weights
from programs.sets import KERAS as PROGRAMS

pytestmark = pytest.mark.distributed
RUNS = ["hvdtrain", "dropin"]       # the distributed jobs, each against the reference
NAMES = list(PROGRAMS)
COUNTED = [name for name, spec in PROGRAMS.items() if spec.counted]
COUPLED = [name for name, spec in PROGRAMS.items() if spec.coupled]
EXACT = 1e-5


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Job:
    """One plain Keras process with the global batch."""
    return shared_job("keras", tmp_path_factory)


@pytest.fixture(scope="module", params=RUNS)
def run(request, tmp_path_factory) -> Job:
    return shared_job(request.param, tmp_path_factory)


def in_mode(job: Job, name: str) -> None:
    spec = PROGRAMS[name]
    if job.mode not in spec.modes:
        pytest.skip(f"{name} does not run under {job.mode}: {spec.skipped}")


def compared(job: Job, name: str) -> None:
    in_mode(job, name)
    if "keras" not in PROGRAMS[name].modes:
        pytest.skip(f"{name} has no one-process reference: {PROGRAMS[name].skipped}")


def epochs_trained(record: dict) -> int:
    return sum(len(fit["epoch_steps"]) for fit in record["fits"])


def within(ours: dict, theirs: dict, tolerance: float) -> bool:
    """Every epoch's metrics and the final weights within ``tolerance`` (relative; absolute a
    tenth of it) of one process's."""
    def close(left, right) -> bool:
        return np.shape(left) == np.shape(right) and np.allclose(
            left, right, rtol=tolerance, atol=tolerance / 10)

    histories = [(fit["history"], one["history"]) for fit, one in zip(ours["fits"], theirs["fits"])]
    if len(ours["fits"]) != len(theirs["fits"]) or any(
            mine.keys() != one.keys() or not all(close(mine[key], one[key]) for key in one)
            for mine, one in histories):
        return False
    theirs_weights = weights(theirs)
    return all(close(left, right) for model, arrays in weights(ours).items()
               for left, right in zip(arrays, theirs_weights[model]))


# --- every program -------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_both_ranks_end_with_identical_weights(run, name):
    in_mode(run, name)
    first, second = (weights(run.record(name, rank)) for rank in (0, 1))
    assert first.keys() == second.keys()
    for model in first:
        for left, right in zip(first[model], second[model]):
            np.testing.assert_array_equal(left, right, err_msg=f"{name}: {model}")
    for fit in run.record(name)["fits"]:
        assert len(set(fit.get("fingerprints", ["dropin"]))) == 1, name


@pytest.mark.parametrize("name", NAMES)
def test_weights_and_metrics_equal_one_process(run, reference, name):
    """Within the program's stated tolerance (``programs.harness.Spec``)."""
    compared(run, name)
    spec = PROGRAMS[name]
    tolerance = spec.dropin_tolerance if run.mode == "dropin" else spec.tolerance
    ours, theirs = run.record(name), reference.record(name)
    assert len(ours["fits"]) == len(theirs["fits"])
    for fit, (mine, one) in enumerate(zip(ours["fits"], theirs["fits"])):
        if tolerance is None:
            assert mine["history"]["loss"] == pytest.approx(
                one["history"]["loss"], rel=spec.loss_tolerance), (name, fit)
            continue
        for metric, values in one["history"].items():
            averaged = spec.rank_averaged.get(metric) if run.mode == "dropin" else None
            got = mine["history"].get(metric)
            if averaged == "count":           # the mean of the ranks' counts
                got = None if got is None else [value * 2 for value in got]
            expected = (pytest.approx(values, abs=0.01) if averaged == "ratio" else
                        pytest.approx(values, rel=tolerance, abs=tolerance / 10))
            assert got == expected, (name, fit, metric)
    if tolerance is None:
        return
    theirs_weights = weights(theirs)
    for model, arrays in weights(ours).items():
        for left, right in zip(arrays, theirs_weights[model]):
            np.testing.assert_allclose(left, right, rtol=tolerance, atol=tolerance / 10,
                                       err_msg=f"{name}: {model}")


@pytest.mark.parametrize("name", NAMES)
def test_history_and_batch_logs_have_exactly_one_process_keys(run, reference, name):
    """What users' callbacks and ``History`` see: one process's logs, nothing more (no
    ``examples_per_second``, no ``lr``) and nothing less, at epoch ends and at batch ends."""
    compared(run, name)
    theirs = reference.record(name)["fits"]
    for rank in (0, 1):
        ours = run.record(name, rank)["fits"]
        assert [sorted(fit["history"]) for fit in ours] == [
            sorted(fit["history"]) for fit in theirs], (name, rank)
        assert [fit["batch_keys"] for fit in ours] == [fit["batch_keys"] for fit in theirs], (
            name, rank)


@pytest.mark.parametrize("name", NAMES)
def test_every_epoch_runs_one_process_steps_on_both_ranks(run, reference, name):
    """The batches Keras' callbacks saw, per epoch of every fit, and the calls of a model's
    own ``train_step``."""
    compared(run, name)
    expected = [fit["epoch_steps"] for fit in reference.record(name)["fits"]]
    own = reference.record(name)["own_steps"]
    for rank in (0, 1):
        record = run.record(name, rank)
        assert [fit["epoch_steps"] for fit in record["fits"]] == expected, (name, rank)
        assert record["own_steps"] == own, (name, rank)


@pytest.mark.parametrize("name", COUNTED)
def test_every_example_is_seen_as_often_as_in_one_process(run, reference, name):
    """Summed over the ranks: the training examples as often as one process trains on them
    (once per epoch for programs that say so: odd counts, uneven shards, shuffles); the
    validation examples (ids from ``VAL_IDS``) as often as one process validates on them, on
    each rank for the drop-in (every rank validates on all of it)."""
    in_mode(run, name)
    spec = PROGRAMS[name]
    records = [run.record(name, rank) for rank in (0, 1)]
    if records[0]["notes"].get("refused"):
        return                                      # nothing trained: the refusal test
    seen = [counts(record) for record in records]
    assert all(seen), f"{name}: a rank trained on nothing"
    total: dict[int, int] = {}
    for rank_counts in seen:
        for example, times in rank_counts.items():
            if example < VAL_IDS or run.mode != "dropin":
                total[example] = total.get(example, 0) + times
            else:
                assert rank_counts[example] == times
                total[example] = times
    if "keras" in spec.modes:
        expected = counts(reference.record(name))
    else:                                  # hvdtrain only: the 301 examples of the program
        expected = {example: epochs_trained(records[0]) for example in range(301)}
    if spec.counted == "once per epoch":
        trained = {e: t for e, t in expected.items() if e < VAL_IDS}
        assert set(trained.values()) == {epochs_trained(records[0])}, name
    wrong = {e: (total.get(e, 0), expected.get(e, 0)) for e in set(total) | set(expected)
             if total.get(e, 0) != expected.get(e, 0)}
    assert not wrong, (f"{name}: {len(wrong)} example ids seen a wrong number of times "
                       f"(seen, expected): {dict(sorted(wrong.items())[:10])}")


@pytest.mark.parametrize("name", COUPLED)
def test_coupled_rows_are_exact_or_said_in_one_line_on_rank_0(run, reference, name):
    """A loss over the batch's rows, or batch normalisation: hvdtrain computes one process's
    values (1e-5), or rank 0 says at the start of each ``fit``, in one line naming the loss (or
    "each rank normalises by its own batch"), that it does not; rank 1 says nothing. (The
    comparison within the program's looser tolerance is the test above.)"""
    if run.mode != "hvdtrain":
        pytest.skip("hvdtrain's promise")
    compared(run, name)
    if within(run.record(name), reference.record(name), EXACT):
        return
    words = PROGRAMS[name].coupled
    for rank in (0, 1):
        for fit in run.record(name, rank)["fits"]:
            lines = [line for line in fit["said"] + fit["warnings"]
                     if any(word in line for word in words)]
            assert len(lines) == (1 if rank == 0 else 0), (
                f"{name} is not one process's to {EXACT}, and rank {rank} said "
                f"{len(lines)} line(s) with {words}: {lines}")


# --- what some programs are about -------------------------------------------------------

def test_an_unseeded_shuffle_built_before_fit_is_refused_in_one_line_on_every_rank(run):
    """Its order differs on every rank, so shards taken from it overlap: ``hvdtrain.fit``
    raises a ``UserError`` subclass on every rank, one line naming both fixes (seed the
    shuffle, or pass a function that builds the dataset)."""
    in_mode(run, "unseeded_shuffle_refused")
    for rank in (0, 1):
        refused = run.record("unseeded_shuffle_refused", rank)["notes"]["refused"]
        assert refused, f"rank {rank} trained on an unseeded shuffle built before fit"
        assert refused["user_error"], refused
        message = refused["message"]
        assert "\n" not in message.strip(), message
        for word in ("shuffle", "seed", "function"):
            assert word in message, (word, message)


def test_random_state_after_fit_is_one_processes(run, reference):
    """Draws of Python's, NumPy's, TensorFlow's and Keras' generators after a first fit, and a
    second model's initial weights, equal one process's exactly on both ranks."""
    name = "second_model_after_fit"
    expected = reference.record(name)["notes"]
    for rank in (0, 1):
        notes = run.record(name, rank)["notes"]
        assert notes["draws"] == expected["draws"], rank
        for ours, theirs in zip(notes["second_initial"], expected["second_initial"]):
            np.testing.assert_array_equal(np.array(ours), np.array(theirs))


def test_random_draws_during_fit_are_one_processes_on_every_rank(run, reference):
    """A user's callback drawing from Python's, NumPy's, TensorFlow's and Keras' generators at
    each epoch's end of a fit on a shuffled PyDataset (which Keras shuffles with Python's
    generator each epoch), and the draws after that fit: one process's exactly, on both ranks."""
    name = "random_draws_during_fit"
    in_mode(run, name)
    expected = reference.record(name)["notes"]
    for rank in (0, 1):
        notes = run.record(name, rank)["notes"]
        assert notes["draws"] == expected["draws"], rank
        assert notes["after"] == expected["after"], rank


def test_steps_per_epoch_beyond_the_data_ends_each_epoch_with_the_pass(run, reference):
    """steps_per_epoch computed from the raw row count (13 per rank's batch, 7 in one process)
    is beyond a pass of 6 batches: every epoch ends with the pass, as in one process, and
    Keras' warning is said on rank 0 alone (hvdtrain). Then steps_per_epoch=4: the data is one
    stream across epochs, 4, 2 (the pass ends), 4, 2."""
    name, keras_steps = "steps_beyond_the_data", [[6, 6], [4, 2, 4, 2]]
    assert [fit["epoch_steps"] for fit in reference.record(name)["fits"]] == keras_steps
    for rank in (0, 1):
        record = run.record(name, rank)
        assert [fit["epoch_steps"] for fit in record["fits"]] == keras_steps, rank
    if run.mode != "hvdtrain":
        return
    for rank in (0, 1):
        for fit in run.record(name, rank)["fits"]:
            said = "\n".join(fit["said"] + fit["warnings"])
            assert ("ran out of data" in said) == (rank == 0), (rank, said[-2000:])


def test_a_prebatched_pipelines_log_states_the_real_global_batch(run):
    """Batches of 16 per rank on 2 ranks: rank 0's log says global batch 32 (2 x 16, the
    dataset's own batches), not twice hvdtrain's default batch size (64)."""
    if run.mode != "hvdtrain":
        pytest.skip("hvdtrain's log")
    said = [line for line in run.record("prebatched_pipeline")["fits"][0]["said"]
            if "global batch" in line]
    stated = re.findall(r"global batch (?:\d+ x \d+ = )?(\d+)", "\n".join(said))
    assert stated and set(stated) == {str(2 * PROGRAMS["prebatched_pipeline"].batch)}, said


def test_callbacks_that_write_files_write_each_file_once(run):
    """ModelCheckpoint after every epoch and a CSVLogger (the drop-in user gives them to rank 0
    alone; hvdtrain.fit gets them on every rank and writes from rank 0): one model file per
    epoch and one CSV row per epoch under a header."""
    record = run.record("augmented_images")
    epochs = len(record["fits"][0]["epoch_steps"])
    directory = Path(record["weights"]["model"]).parent / f"{run.mode}-augmented_images"
    assert sorted(path.name for path in directory.glob("save_at_*.keras")) == [
        f"save_at_{epoch}.keras" for epoch in range(1, epochs + 1)]
    rows = (directory / "log.csv").read_text().splitlines()
    assert rows[0].startswith("epoch,") and [row.split(",")[0] for row in rows[1:]] == [
        str(epoch) for epoch in range(epochs)], rows


def test_the_dropins_distributed_optimizer_keeps_the_users_optimizer(run, reference):
    """``hvd.DistributedOptimizer(AdamW(WarmUpCosine(...)))`` with a schedule that has no
    ``get_config``: the user's optimizer object is the one that trains, and the schedule ends at
    one process's step and rate."""
    if run.mode != "dropin":
        pytest.skip("the drop-in's DistributedOptimizer")
    name = "warmup_cosine_schedule"
    expected = reference.record(name)["notes"]
    for rank in (0, 1):
        notes = run.record(name, rank)["notes"]
        assert notes["user_optimizer_kept"], rank
        assert notes["iterations"] == expected["iterations"]
        assert notes["final_rate"] == pytest.approx(expected["final_rate"], rel=1e-6)
