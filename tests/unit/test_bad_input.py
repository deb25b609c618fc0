"""Every user mistake: exit code 2, one line naming the problem and what to do, no traceback
(unless --debug), and nothing already in the run directory overwritten or lost.

Each row of the "Mistakes and their messages" table (hvdtrain/README.md) has a test here, or
beside its subject: a bad option value or YAML file in test_config.py, a bad npz file in
test_data_sources.py; those only ranks find (a TFRecord file corrupt mid-run on one rank,
more ranks than examples) in tests/distributed/training/test_data_on_two_ranks.py."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import fails_with
from hvdtrain.cli import main
from hvdtrain.install.doctor import problems_in


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file's bytes, but the lock's (it names the last process that held it)."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 1-epoch mlp run to make mistakes against, trained once in this process (the
    mistakes are made in this process too: a launch would only add a Python and TensorFlow
    start). A test that changes it changes its own copy (``copy_of``)."""
    run = tmp_path_factory.mktemp("bad") / "done"
    assert main(["train", "--run-dir", str(run), "--no-progress", "--epochs", "1",
                 "--hidden-units", "16"]) == 0
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / run.name))


def test_unknown_flag_suggests_the_closest(capsys, tmp_path):
    fails_with(capsys, ["--epoch", "3"], "unrecognized arguments: --epoch 3; did you mean "
                                         "--epochs?")


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "abc"], "argument --batch-size: invalid int value: 'abc'"),
    (["--learning-rate", "-0.1"], "'learning_rate' must be greater than 0, got -0.1"),
    (["--learning-rate", "nan"], "'learning_rate' must be a finite number, got nan"),
    (["--learning-rate", "inf"], "'learning_rate' must be a finite number, got inf"),
    (["--momentum", "nan"], "'momentum' must be a finite number, got nan"),
    (["--validation-split", "nan"], "'validation_split' must be a finite number, got nan"),
    (["--stall-timeout", "nan"], "'stall_timeout' must be a finite number, got nan"),
])
def test_wrong_type_or_out_of_range_values(capsys, argv, message):
    fails_with(capsys, argv, message)


@pytest.mark.parametrize("argv, message", [
    (["--model", "vgg"], "'model' must be one of mlp, cnn, resnet or "
                         "package.module:function, got 'vgg'"),
    (["--dataset", "imagenet"], "'dataset' must be one of digits, synthetic"),
])
def test_unknown_model_or_dataset(capsys, tmp_path, argv, message):
    fails_with(capsys, [*argv, "--run-dir", str(tmp_path / "r")], message)


def test_plugin_that_fails_to_import_or_returns_a_non_model(capsys, tmp_path, monkeypatch):
    (tmp_path / "broken_plugin.py").write_text("import not_a_real_module\n")
    (tmp_path / "wrong_plugin.py").write_text("def build(shape, classes):\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fails_with(capsys, ["--model", "broken_plugin:build", "--run-dir", str(tmp_path / "a")],
               "cannot import model module 'broken_plugin' (ModuleNotFoundError")
    fails_with(capsys, ["--model", "wrong_plugin:build", "--run-dir", str(tmp_path / "b")],
               "'wrong_plugin:build' returned int, not a keras.Model")


def test_data_path_empty_or_unreadable(capsys, tmp_path):
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 3)), y=np.zeros(0, int))
    fails_with(capsys, ["--dataset", "npz", "--data-path", str(tmp_path / "empty.npz"),
                        "--run-dir", str(tmp_path / "b")], "'x' is empty")
    fails_with(capsys, ["--dataset", "tfrecord", "--data-path", str(tmp_path / "no-*"),
                        "--val-data-path", str(tmp_path / "no-*"), "--run-dir",
                        str(tmp_path / "c")], "no files match --data-path")
    np.savez(tmp_path / "whole.npz", x=np.zeros((10, 3)), y=np.zeros(10, int))
    (tmp_path / "cut.npz").write_bytes((tmp_path / "whole.npz").read_bytes()[:200])
    fails_with(capsys, ["--dataset", "npz", "--data-path", str(tmp_path / "cut.npz"),
                        "--run-dir", str(tmp_path / "d")], "is not a readable .npz file")


def test_corrupt_tfrecord_file(capsys, tmp_path):
    (tmp_path / "train-0.tfrecord").write_bytes(b"this is not a tfrecord at all" * 10)
    (tmp_path / "val-0.tfrecord").write_bytes(b"nor this" * 10)
    fails_with(capsys, ["--dataset", "tfrecord", "--data-path", str(tmp_path / "train-*"),
                        "--val-data-path", str(tmp_path / "val-*"), "--feature-shape", "4",
                        "--num-classes", "2", "--run-dir", str(tmp_path / "r")],
               "train-0.tfrecord record 1 has a corrupt header (byte 0): it is not a TFRecord "
               "file, or it is damaged; regenerate it with 'hvdtrain convert'")


@pytest.fixture
def converted(tmp_path) -> Path:
    """64 training and 8 validation records written by 'hvdtrain convert' into one shard each
    (their sizes and counts in its metadata)."""
    from hvdtrain.data.convert import convert

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((64, 4)).astype(np.float32),
             y=rng.integers(0, 2, 64), x_val=np.zeros((8, 4), np.float32),
             y_val=np.zeros(8, int))
    convert(tmp_path / "d.npz", tmp_path / "rec", shards=1)
    return tmp_path / "rec"


def train_on_records(capsys, records: Path, message: str, *flags: str) -> None:
    fails_with(capsys, ["--dataset", "tfrecord", "--data-path", str(records / "train-*"),
                        "--val-data-path", str(records / "validation-*"), "--run-dir",
                        str(records.parent / "r"), "--no-progress", *flags], message)


# Records of 4 floats are 65 bytes: header 12, payload 49, footer 4.
HEADER_CUT = (65 * 9 + 5, "the header of record 10 (byte 585 of 590): the file is truncated")
PAYLOAD_CUT = (65 * 9 + 30, "record 10 (615 bytes, the record needs 650): the file is truncated")


@pytest.mark.parametrize("cut, where", [HEADER_CUT, PAYLOAD_CUT])
@pytest.mark.parametrize("metadata", [True, False])
def test_a_tfrecord_file_cut_anywhere_is_found_before_training(
        capsys, converted, cut, where, metadata):
    """A cut inside a header reads as a clean end of file in TensorFlow; inside a payload it
    fails mid-epoch. Both are found up front, with or without the converter's metadata."""
    shard = next(converted.glob("train-*"))
    shard.write_bytes(shard.read_bytes()[:cut])
    flags: tuple[str, ...] = ()
    if not metadata:
        (converted / "hvdtrain-dataset.json").unlink()
        flags = ("--feature-encoding", "float", "--feature-shape", "4", "--num-classes", "2")
    train_on_records(capsys, converted,
                     f"{shard} ends inside {where}; regenerate it with 'hvdtrain convert'",
                     *flags)


def test_a_tfrecord_file_cut_at_a_record_boundary_is_found_by_its_metadata(capsys, converted):
    shard = next(converted.glob("train-*"))
    shard.write_bytes(shard.read_bytes()[:65 * 60])
    train_on_records(capsys, converted,
                     f"{shard} holds 60 records but hvdtrain-dataset.json says 64: it changed "
                     "after conversion; regenerate it")


def test_a_csv_cell_that_is_not_a_number_is_named_by_file_line_and_column(capsys, tmp_path):
    def write(bad_row: int, bad: str) -> None:
        for name in ("train", "val"):
            (tmp_path / f"{name}.csv").write_text("a,b,label\n" + "".join(
                (bad if (name, i) == ("train", bad_row) else f"{i / 10},{i},{i % 2}") + "\n"
                for i in range(20)))

    argv = ["--dataset", "csv", "--data-path", str(tmp_path / "train.csv"), "--val-data-path",
            str(tmp_path / "val.csv"), "--run-dir", str(tmp_path / "r")]
    write(5, "0.5,x7,1")
    fails_with(capsys, argv, f"{tmp_path / 'train.csv'}: line 7, column 'b': 'x7' is not a "
                             "number; every cell must be a number (fix or remove the row)")
    write(7, "0.5,1")
    fails_with(capsys, argv, f"{tmp_path / 'train.csv'}: line 9 has 2 columns, the header 3; "
                             "every row needs every column")


def test_features_that_do_not_fit_the_model(capsys, tmp_path, monkeypatch):
    (tmp_path / "fixed_plugin.py").write_text(textwrap.dedent("""
        import keras

        def build(shape, classes):
            return keras.Sequential([keras.Input(shape=(10,)),
                                     keras.layers.Dense(classes, activation="softmax")])
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    fails_with(capsys, ["--model", "fixed_plugin:build", "--run-dir", str(tmp_path / "r")],
               "the data's examples have shape (8, 8, 1) but model 'fixed_plugin:build' "
               "expects (10,)")


def test_labels_outside_the_class_range(capsys, tmp_path):
    np.savez(tmp_path / "l.npz", x=np.zeros((10, 2)), y=np.arange(10) - 1)
    fails_with(capsys, ["--dataset", "npz", "--data-path", str(tmp_path / "l.npz"),
                        "--run-dir", str(tmp_path / "a")], "labels must lie in [0, 8]")
    for name in ("train", "val"):
        (tmp_path / f"{name}.csv").write_text("a,label\n" + "".join(
            f"{i / 10},{i % 3}\n" for i in range(40)))
    fails_with(capsys, ["--dataset", "csv", "--data-path", str(tmp_path / "train.csv"),
                        "--val-data-path", str(tmp_path / "val.csv"), "--num-classes", "2",
                        "--run-dir", str(tmp_path / "b"), "--no-progress"],
               "a label lies outside [0, 1] for 2 classes")


def test_resume_with_another_model_or_an_unreadable_checkpoint(capsys, finished_run, tmp_path):
    finished_run = copy_of(finished_run, tmp_path)
    before = snapshot(finished_run)
    fails_with(capsys, ["--run-dir", str(finished_run), "--resume", "--model", "cnn"],
               "was trained with model 'mlp', not 'cnn'; resume with the same --model")
    fails_with(capsys, ["--run-dir", str(finished_run), "--epochs", "2"],
               "already holds a run; pass --resume to continue it")
    assert snapshot(finished_run) == before              # nothing overwritten
    state = next((finished_run / "checkpoints").glob("epoch-*")) / "state.json"
    state.write_text("{not json")
    fails_with(capsys, ["--run-dir", str(finished_run), "--resume", "--epochs", "2",
                        "--hidden-units", "16"], "is unreadable")
    state.write_text(json.dumps({"epoch": 1, "model": "mlp"}))
    weights = state.parent / "weights.npz"
    weights.write_bytes(b"garbage")
    fails_with(capsys, ["--run-dir", str(finished_run), "--resume", "--epochs", "2",
                        "--hidden-units", "16"], "does not fit this model or is unreadable")


def test_resume_without_a_checkpoint(capsys, tmp_path):
    fails_with(capsys, ["--run-dir", str(tmp_path / "fresh"), "--resume"],
               "--resume: no checkpoint in")


def test_run_dir_not_writable(capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    fails_with(capsys, ["--run-dir", str(tmp_path / "a-file" / "run")],
               "is not writable (Not a directory); choose another --run-dir")


@pytest.mark.parametrize("command", ["evaluate", "predict"])
def test_output_into_a_missing_directory(capsys, finished_run, tmp_path, command):
    np.save(tmp_path / "x.npy", np.zeros((2, 64), np.float32))
    inputs = ["--input", str(tmp_path / "x.npy")] if command == "predict" else []
    fails_with(capsys, [command, str(finished_run), *inputs, "--output",
                        str(tmp_path / "missing" / "out")],
               "does not exist; create it or choose another path")


def test_debug_shows_the_traceback(capsys):
    assert main(["--batch-size", "0", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith(
        "hvdtrain: error: 'batch_size' must be at least 1, got 0")


@pytest.mark.parametrize("horovod, message", [
    ({"error": "ImportError: No module named 'horovod'"}, "Horovod cannot be used"),
    ({"version": "0.28.1", "controllers": {"MPI": False, "Gloo": True},
      "tensor_ops": {}}, "Horovod was built without MPI"),
    ({"error": "Horovod's TensorFlow extension does not load (undefined symbol)"},
     "run launch/setup.sh (it rebuilds Horovod against this TensorFlow)"),
])
def test_doctor_says_how_to_fix_a_broken_horovod(horovod, message):
    report = {"horovod": horovod, "mpi": "Open MPI v4.1.4", "size": 2}
    problems = problems_in(report, launched=True)
    assert any(message in p for p in problems), problems


def test_resume_never_mixes_runs(capsys, caplog, tmp_path, finished_run):
    """A checkpoint records what it trained: another dataset, optimizer or setting is refused
    with one line naming the difference, unless --accept-changes; another model or input shape
    always (another --model: test_resume_with_another_model_or_an_unreadable_checkpoint)."""
    run = copy_of(finished_run, tmp_path)
    same = ["--run-dir", str(run), "--resume", "--hidden-units", "16", "--no-progress"]
    before = snapshot(run)
    fails_with(capsys, [*same, "--dataset", "synthetic", "--synthetic-shape", "8", "8", "1"],
               "was trained with other data or settings (--dataset 'digits' -> 'synthetic';")
    fails_with(capsys, [*same, "--dataset", "synthetic", "--synthetic-shape", "4", "4", "1"],
               "was trained with example shape [8, 8, 1], not [4, 4, 1]; resume with the same "
               "model, or start a new --run-dir")
    fails_with(capsys, [*same, "--optimizer", "adam"],
               "was trained with other data or settings (optimizer {'optimizer': 'SGD'} -> "
               "{'optimizer': 'Adam'}); pass --accept-changes to continue with the new ones, "
               "or start a new --run-dir")
    fails_with(capsys, [*same, "--learning-rate", "0.01"],
               "(--learning-rate None -> 0.01); pass --accept-changes")
    fails_with(capsys, ["--run-dir", str(run), "--resume", "--hidden-units", "32"],
               "was trained with --hidden-units [16], not [32]: another model; start a new "
               "--run-dir")
    assert snapshot(run) == before
    assert main([*same, "--epochs", "2", "--learning-rate", "0.01", "--optimizer", "adam",
                 "--accept-changes"]) == 0
    out = caplog.text   # hvdtrain's lines: to pytest's handlers, the program's logging here
    assert ("continuing" in out and "with changed data or settings (optimizer {'optimizer': "
            "'SGD'} -> {'optimizer': 'Adam'}; --learning-rate None -> 0.01)") in out
    assert "resuming after epoch 1" in out


@pytest.mark.parametrize("module, argv, message", [
    ("compare", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    ("compare", ["--comm-repeats", "-1"], "argument --comm-repeats: must be 0 (skip) or more"),
    ("scaling", ["--hosts", "a:1", "--steps", "0"], "argument --steps: must be at least 1"),
    ("comm", ["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    ("overlap", ["--np", "0"], "argument --np: must be at least 1, got 0"),
])
def test_the_measurement_tools_refuse_counts_that_leave_nothing_to_time(
        capsys, module, argv, message):
    """Zero steps, repeats or rounds once ended in a StatisticsError traceback after minutes
    of running; now the parser names the option."""
    import importlib

    with pytest.raises(SystemExit) as ended:
        importlib.import_module(f"hvdtrain.bench.{module}").main(argv)
    assert ended.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
