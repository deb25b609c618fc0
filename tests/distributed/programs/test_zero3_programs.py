"""ZeRO stage 3 on programs written the way keras.io's examples are (``zero3_programs``: a
Transformer text classifier, the same over frozen embeddings, a model with its own
``train_step``, ``test_step`` and metric trackers; and the Keras-example set's convnet with
batch normalisation), each on 2 ranks at stage 3 against the same program at stage 0 on 2
ranks. They run in the ``hvdtrain`` job the program harness shares with the Keras-example and
user sets (``programs.jobs``): no launch of their own. Each must end where stage 0 ends (every
weight, batch normalisation's moving statistics included, and every epoch's metrics,
validation's included, within 1e-5 relative), or be refused on every rank in one line that
names the variable and a fix. On the default backend (Horovod) only: a launch on TensorFlow's
collectives would add to the suite's time (run by hand there, the three that train were exact
too)."""

from __future__ import annotations

import numpy as np
import pytest

from programs.jobs import Job, shared_job, weights
from zero3_programs import STAGE_0_OF

pytestmark = pytest.mark.distributed
EXACT = 1e-5
# Stage 3 refuses a sparse gradient (a trainable Embedding's) as stages 1 and 2 do: the
# words its one line must hold.
REFUSED = {"transformer_text@3": ("--zero-stage", "sparse gradient",
                                  "token_and_position_embedding", "embeddings",
                                  "--zero-stage 0")}
TRAINED = [name for name in STAGE_0_OF if name not in REFUSED]


@pytest.fixture(scope="session")
def run(tmp_path_factory) -> Job:
    """hvdtrain on 2 ranks (shared with the Keras-example and user sets)."""
    return shared_job("hvdtrain", tmp_path_factory)


@pytest.mark.parametrize("name", TRAINED)
def test_stage_3_ends_where_stage_0_ends(run, name):
    stage_0 = run.record(STAGE_0_OF[name])
    for rank in (0, 1):
        record = run.record(name, rank)
        assert not record["notes"].get("refused"), (name, rank, record["notes"]["refused"])
        ours, theirs = weights(record), weights(stage_0)
        for model, arrays in theirs.items():
            assert [a.shape for a in ours[model]] == [a.shape for a in arrays], (name, model)
            for index, (left, right) in enumerate(zip(ours[model], arrays)):
                np.testing.assert_allclose(left, right, rtol=EXACT, atol=EXACT / 10,
                                           err_msg=f"{name}: {model} weight {index}")
    fits = run.record(name)["fits"]
    assert len(fits) == len(stage_0["fits"])
    for mine, one in zip(fits, stage_0["fits"]):
        assert mine["history"].keys() == one["history"].keys(), name
        for metric, values in one["history"].items():
            assert mine["history"][metric] == pytest.approx(
                values, rel=EXACT, abs=EXACT / 10), (name, metric)


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_stage_3_cannot_shard_is_refused_in_one_line_on_every_rank(run, name):
    """Raised while the first step is traced, as a ``UserError``; the next program in the same
    processes trains (the job's order)."""
    for rank in (0, 1):
        refused = run.record(name, rank)["notes"]["refused"]
        assert refused, f"rank {rank} trained {name} at stage 3"
        assert refused["user_error"], (rank, refused)
        message = refused["message"].strip()
        assert "\n" not in message, message
        for words in REFUSED[name]:
            assert words in message, (words, message)


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refused_model_keeps_its_initial_weights_whole(run, name):
    for rank in (0, 1):
        refused = run.record(name, rank)["notes"]["refused"]
        assert refused and refused["weights_kept"], (rank, refused and refused["shapes"][0])
