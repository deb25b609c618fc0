"""What ``fit`` does to a user's program, single process: which pipelines read in a different
order on every rank (``hvdtrain.data.order``), the data built by a function the user hands
over, the random state a run puts back (``process_state``), and the placement line of a script
that used TensorFlow first."""

from __future__ import annotations

import random
import subprocess

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import BIN, REPO, RUN_TIMEOUT, rank_env
from hvdtrain.data.contract import DataError
from hvdtrain.data.datasets import PythonShuffleDraws, keras_parts
from hvdtrain.data.order import fingerprint, refusal
from hvdtrain.data.user import KerasData, built
from hvdtrain.keras_internals import keras_random_state, op_determinism_enabled, tf_random_state
from hvdtrain.data.equal_steps import Passes
from hvdtrain.training.process_state import (run_environment, seed_alike, seeded_per_rank,
                                             share_random_state)

ROWS = np.arange(101, dtype=np.int64)

# Run in a fresh process: whether a shuffle is seeded depends on TensorFlow's global seed,
# which the test process may have set.
PIPELINES = """
import numpy as np, tensorflow as tf
from hvdtrain.keras_internals import unseeded_randomness
rows = tf.data.Dataset.from_tensor_slices(np.arange(101))
found = [
    unseeded_randomness(rows.shuffle(101).batch(4)),
    unseeded_randomness(rows.shuffle(101, seed=3).batch(4)),
    unseeded_randomness(tf.data.Dataset.sample_from_datasets([rows, rows])),
    unseeded_randomness(rows.map(lambda v: v + 1, num_parallel_calls=2, deterministic=False)),
    unseeded_randomness(rows.map(lambda v: v + 1, num_parallel_calls=2)),
    unseeded_randomness(tf.data.Dataset.zip(rows, rows.shuffle(8)).batch(2)),
    unseeded_randomness(rows.interleave(lambda v: tf.data.Dataset.range(v), num_parallel_calls=2,
                                        deterministic=False)),
    unseeded_randomness(rows.flat_map(lambda v: tf.data.Dataset.range(v).shuffle(4))),
    unseeded_randomness(rows.flat_map(lambda v: tf.data.Dataset.range(v).shuffle(4, seed=1))),
]
tf.random.set_seed(5)
found.append(unseeded_randomness(rows.shuffle(101)))
print(found)
"""


@pytest.mark.slow   # a fresh Python and TensorFlow: make test runs it, make test-fast not
def test_unseeded_randomness_is_found_without_reading_the_data():
    result = subprocess.run([str(BIN / "python"), "-c", PIPELINES], cwd=REPO, env=rank_env(),
                            text=True, capture_output=True, timeout=RUN_TIMEOUT,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == str([
        "an unseeded shuffle", None, "an unseeded Dataset.random or sample_from_datasets",
        "a parallel map with deterministic=False", None, "an unseeded shuffle",
        "ParallelInterleaveDatasetV4 with deterministic=False",
        "an unseeded shuffle inside a flat_map or interleave", None, None])


def test_a_dataset_whose_options_let_order_follow_timing_is_read_in_order():
    """Keras' TFRecord example sets ``deterministic = False`` in the options: hvdtrain reads
    the dataset in order (every rank one order) and says so."""
    from hvdtrain.data.datasets import DatasetSplit

    options = tf.data.Options()
    options.deterministic = False
    split = DatasetSplit(tf.data.Dataset.from_tensor_slices(ROWS).with_options(options))
    assert split.reordered and split.source.options().deterministic is True
    assert "its options say deterministic=False; hvdtrain reads it in order" in (
        split.order_note("training"))
    assert DatasetSplit(tf.data.Dataset.from_tensor_slices(ROWS)).order_note("training") is None


def test_the_fingerprint_follows_the_targets_not_a_random_augmentation():
    """Features augmented differently on every rank move no example to another rank: the
    fingerprint reads the targets; an order that differs changes it."""
    def pipeline(noise: float, order: np.ndarray) -> tf.data.Dataset:
        x = (ROWS[order] + noise).astype(np.float32)
        return tf.data.Dataset.from_tensor_slices((x, ROWS[order]))

    same = np.arange(101)
    assert (fingerprint(pipeline(0.0, same), False, keras_parts)
            == fingerprint(pipeline(0.5, same), False, keras_parts))
    assert (fingerprint(pipeline(0.0, same), False, keras_parts)
            != fingerprint(pipeline(0.0, same[::-1]), False, keras_parts))


def test_the_refusal_names_what_differs_and_both_fixes():
    assert refusal("training", [(None, "a"), (None, "a")]) is None
    seeded = refusal("training", [("an unseeded shuffle", None), ("an unseeded shuffle", None)])
    assert seeded.startswith("the training dataset's order differs on every rank (an unseeded "
                             "shuffle, built before hvdtrain.fit)")
    drawn = refusal("validation", [(None, "a"), (None, "b")])
    assert "validation dataset's first elements differ across ranks (already sharded" in drawn
    assert "give every rank the whole dataset (hvdtrain shards it)" in drawn
    for line in (seeded, drawn):
        assert "seed=" in line and "x=make_dataset" in line and "\n" not in line


def test_data_given_as_a_function_is_built_in_the_run():
    made = built(KerasData(lambda: tf.data.Dataset.from_tensor_slices(ROWS),
                           validation_data=lambda: (ROWS, ROWS)))
    assert isinstance(made.x, tf.data.Dataset) and made.validation_data[0] is ROWS
    dataset = tf.data.Dataset.from_tensor_slices(ROWS)
    assert built(KerasData(dataset)).x is dataset                    # data stays as given
    with pytest.raises(DataError, match="the function given as x returned NoneType"):
        built(KerasData(lambda: None))


def _draws() -> tuple:
    return (random.random(), float(np.random.rand()), float(tf.random.uniform(())),
            float(keras.random.uniform(())))


@pytest.mark.parametrize("examples, fraction", [(177, 0.2), (100, 0.3), (10, 0.25), (7, 0.5)])
def test_validation_split_holds_out_what_keras_does(examples, fraction):
    """The last examples Keras' ``train_validation_split`` holds out (training keeps the floor
    of examples x (1 - fraction)), not int(examples x fraction): 177 x 0.2 is 141 + 36."""
    from keras.src.trainers.data_adapters.array_slicing import train_validation_split

    from hvdtrain.config import DataConfig
    from hvdtrain.data.user import user_bundle

    x = np.arange(examples, dtype=np.float32)[:, None]
    kept, held = train_validation_split((x, x[:, 0]), validation_split=fraction)
    bundle = user_bundle(KerasData(x, x[:, 0], validation_split=fraction), DataConfig(), 0)
    assert (bundle.train.num_examples, bundle.val.num_examples) == (len(kept[0]), len(held[0]))
    np.testing.assert_array_equal(bundle.val.x, held[0])


def test_a_run_refused_before_sharing_puts_every_random_generator_and_op_determinism_back():
    """What the program draws after a run that ends before its generators are shared is what it
    would draw had the run not been there, whatever the run seeded."""
    keras.utils.set_random_seed(11)
    _draws()
    expected = _draws()
    keras.utils.set_random_seed(11)
    _draws()
    before = op_determinism_enabled()
    with run_environment("float32", deterministic=True):
        assert op_determinism_enabled()
        seed_alike(42)
        _draws()
    assert op_determinism_enabled() == before
    assert _draws() == expected


def _seeded_state(seed: int) -> tuple:
    """A program's generators after ``keras.utils.set_random_seed(seed)``, as a rank sends
    them to the others."""
    keras.utils.set_random_seed(seed)
    return (random.getstate(), np.random.get_state(), tf_random_state(),
            keras_random_state()[::2])


def test_a_run_continues_from_rank_zeros_generators_and_leaves_them_where_its_draws_did():
    """Inside a run, after the sharing, every generator draws rank 0's sequence (here a program
    seeded 11 while this rank was seeded 5); a model built with per-rank seeds leaves them as
    they were; at the end they stay where the run's draws left them, as one process's fit."""
    rank_zero = _seeded_state(11)
    one_process = [_draws() for _ in range(3)]
    keras.utils.set_random_seed(5)
    with run_environment("float32"):
        share_random_state(42, lambda mine: [rank_zero, mine])
        with seeded_per_rank(42, 1):
            keras.layers.Dropout(0.5)
            _draws()
        assert [_draws() for _ in range(2)] == one_process[:2]
    assert _draws() == one_process[2]


def test_a_program_without_a_tensorflow_seed_gets_one_alike_inside_a_run_and_none_after():
    """An unseeded TensorFlow generator draws differently in every process: inside the run it
    is seeded from the run's seed on every rank, and unseeded again after."""
    tf.random.set_seed(None)
    with run_environment("float32"):
        share_random_state(42, lambda mine: [mine, mine])
        inside = float(tf.random.uniform(()))
        tf.random.set_seed(42)
        assert inside == float(tf.random.uniform(()))
    assert tf_random_state()[0] is None


def test_a_shuffled_pydatasets_python_draw_is_made_on_the_first_step_of_every_pass():
    """Keras shuffles a PyDataset's batch indices with Python's generator when a pass begins;
    hvdtrain makes that draw over one process's batch count (the steps of a pass) at the first
    step's end, epochs split by steps_per_epoch included (passes of 6 steps, epochs of 4)."""
    draws = PythonShuffleDraws(Passes(6, steps_per_epoch=4))
    random.seed(3)
    for epoch, steps in enumerate([4, 2, 4, 2]):
        draws.on_epoch_begin(epoch)
        for batch in range(steps):
            draws.on_train_batch_end(batch)
    ours = random.random()
    random.seed(3)
    for _ in range(2):
        random.shuffle(list(range(6)))
    assert ours == random.random()


PLACEMENT = """
import tensorflow as tf
from hvdtrain.collectives import place_devices, World
tf.constant(1.0)                                  # the script used TensorFlow first
print(place_devices(World(0, 2, 0, 2)))
"""


@pytest.mark.slow   # a fresh process whose TensorFlow starts before hvdtrain
def test_the_placement_line_says_when_tensorflow_started_first():
    """A script that built its model before ``fit``: the line says TensorFlow's own placement
    stands and how to get hvdtrain's (no "earlier run" that never was)."""
    result = subprocess.run([str(BIN / "python"), "-c", PLACEMENT], cwd=REPO, env=rank_env(),
                            text=True, capture_output=True, timeout=RUN_TIMEOUT,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("CPU, TensorFlow's own") and "earlier run" not in line, line
    assert "TensorFlow had started before hvdtrain could place this rank" in line
    assert "call hvdtrain.init() at the top of the script" in line


def test_other_libraries_reasons_are_quoted_as_whole_sentences():
    """Keras' reason for not saving a subclass whole spans lines; the note quotes its first
    sentence whole (it was cut to "Object Distiller was created by passing")."""
    from hvdtrain.errors import first_sentence

    reason = ("Object Distiller was created by passing\nnon-serializable argument values in "
              "`__init__()`, and therefore the object must override `get_config()` in order "
              "to be serializable. Please implement `get_config()`.")
    assert first_sentence(reason) == (
        "Object Distiller was created by passing non-serializable argument values in "
        "`__init__()`, and therefore the object must override `get_config()` in order to be "
        "serializable.")
    assert first_sentence("no full stop here") == "no full stop here"
    wrapped = ("Exception encountered when calling Sequential.call().\n\n\x1b[1mInput 0 of "
               "layer 'dense' is incompatible with the layer: expected axis -1 of input shape "
               "to have value 4, but received input with shape (2, 3)\x1b[0m\n\nArguments "
               "received by Sequential.call():\n  • inputs=tf.Tensor(shape=(2, 3))")
    assert first_sentence(wrapped) == (
        "Input 0 of layer 'dense' is incompatible with the layer: expected axis -1 of input "
        "shape to have value 4, but received input with shape (2, 3)")


class _FailsAtThirdStep(keras.layers.Layer):
    """A user's layer whose check fails on the third training batch (ids 64 and up)."""

    def call(self, inputs):
        tf.debugging.assert_less(inputs[:, :1], 64.0, message="an id the layer refuses")
        return inputs


def test_a_failing_step_says_which_rank_epoch_step_and_batch(tmp_path):
    import hvdtrain

    x = np.arange(96, dtype=np.float32)[:, None]
    model = keras.Sequential([keras.Input((1,)), _FailsAtThirdStep(), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        hvdtrain.fit(model, x, np.zeros(96, np.int64), batch_size=32, shuffle=False, epochs=1,
                     run_dir=str(tmp_path / "run"), progress=False, tensorboard=False)
    notes = getattr(raised.value, "__notes__", [])
    assert notes == ["hvdtrain: rank 0 failed in epoch 1, step 3, on batch 3 of this rank's "
                     "pass 1 over the training data, as given"], notes


BROADCASTS = """
import keras
from hvdtrain.collectives.horovod_backend import HorovodCollectives
collectives = HorovodCollectives()
for units in range(1, 8):   # every fit broadcasts another model's variables
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units)])
    collectives.broadcast_variables(model.weights)
print("broadcast 7 times")
"""


@pytest.mark.slow   # a fresh process: TensorFlow counts the traces of its own lifetime
def test_many_fits_in_one_process_print_no_retracing_warning():
    """Horovod traces its broadcast function again for every new list of variables; from the
    sixth, TensorFlow warned about retracing, as if the user's code were at fault."""
    result = subprocess.run([str(BIN / "python"), "-c", BROADCASTS], capture_output=True,
                            text=True, timeout=RUN_TIMEOUT, env=rank_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "broadcast 7 times" in result.stdout
    assert "retracing" not in result.stderr, result.stderr[-2000:]
