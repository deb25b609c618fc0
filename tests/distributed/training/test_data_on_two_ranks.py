"""File data on 2 real ranks: TFRecord files sharded by file or by element are a partition of
the examples, TFRecord and CSV data train to the same weights on every rank, and the mistakes
only ranks find: a TFRecord payload corrupt mid-run on one rank (one line from that rank), and
more ranks than training examples. The loaders in one process: tests/unit/data/test_data_sources.py;
every other mistake: tests/unit/test_bad_input.py."""

from __future__ import annotations

import csv
import re

import numpy as np
import pytest

from case_jobs import train_together
from conftest import LAUNCHER, assert_partition, launch, probe_shards, read_metrics, read_summary
from hvdtrain.data.convert import convert


def _id_dataset(tmp_path, n: int, shards: int):
    """TFRecords whose labels are the example ids, so a probe can check the partition."""
    rng = np.random.default_rng(1)
    x = (rng.random((n, 4, 4, 1)) * 255).astype(np.uint8)
    np.savez(tmp_path / "ids.npz", x=x, y=np.arange(n))
    convert(tmp_path / "ids.npz", tmp_path / f"ids-{shards}", shards)
    return str(tmp_path / f"ids-{shards}")      # its train-* files


SHARDINGS = [(5, "file", 11), (1, "element", 9)]


@pytest.fixture(scope="module")
def tfrecord_probes(tmp_path_factory) -> dict[int, list[dict]]:
    """Per number of files: the probe's records of 203 ids as that many TFRecord files, both
    probes in one launch."""
    tmp = tmp_path_factory.mktemp("tfrecord-probes")
    shard_counts = [shards for shards, _, _ in SHARDINGS]
    records = probe_shards(tmp, *[("tfrecord", _id_dataset(tmp, 203, shards), 12)
                                  for shards in shard_counts])
    return dict(zip(shard_counts, records))


@pytest.mark.distributed
@pytest.mark.parametrize("shards, mode, steps", SHARDINGS)
def test_tfrecord_sharding_is_a_partition_in_both_modes(tfrecord_probes, shards, mode, steps):
    # 203 records, 2 ranks x 12. File mode: shards of 41, 41, 41, 41, 39; the largest share a
    # rank can draw is 3 files = 123 records -> 11 steps. Element mode: 102 -> 9 steps.
    records = tfrecord_probes[shards]
    assert {r["mode"] for r in records} == {mode}
    assert_partition(records, 203, steps=steps)


@pytest.mark.distributed
def test_tfrecord_and_csv_train_on_two_ranks(tmp_path):
    """The same examples as TFRecord files and as CSV files, both trained in one launch."""
    rng = np.random.default_rng(2)
    teacher = rng.standard_normal((5, 3))
    x = rng.standard_normal((400, 5)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1)
    np.savez(tmp_path / "t.npz", x=x[:300], y=y[:300], x_val=x[300:], y_val=y[300:])
    convert(tmp_path / "t.npz", tmp_path / "rec", shards=1)    # 1 file < 2 ranks: by element
    for name, rows in (("train", range(300)), ("val", range(300, 400))):
        with open(tmp_path / f"{name}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["a", "b", "label", "c", "d", "e"])
            for i in rows:
                writer.writerow([*x[i, :2], y[i], *x[i, 2:]])
    runs = train_together(tmp_path, {
        "tfrecord": ["--dataset", "tfrecord", "--data-path", str(tmp_path / "rec" / "train-*"),
                     "--val-data-path", str(tmp_path / "rec" / "validation-*"), "--epochs",
                     "8", "--cache", "--lr-schedule", "step", "--lr-decay-epochs", "3",
                     "--lr-decay-factor", "0.5", "--warmup-epochs", "0"],
        "csv": ["--dataset", "csv", "--data-path", str(tmp_path / "train.csv"),
                "--val-data-path", str(tmp_path / "val.csv"), "--epochs", "8"]})
    run = runs["tfrecord"]
    assert "sharding 1 file(s) across 2 rank(s) by element" in run.with_suffix(".log").read_text()
    assert read_summary(run)["metrics"]["val_accuracy"] > 0.8
    # 150 records per rank / 32 = 5 steps an epoch; x0.5 every 15 steps, after linear scaling.
    assert [row["lr"] for row in read_metrics(run)] == pytest.approx(
        [0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025])
    run = runs["csv"]
    assert read_summary(run)["metrics"]["val_accuracy"] > 0.8
    assert read_summary(run)["weights_identical"]


@pytest.mark.distributed
def test_corrupt_tfrecord_found_mid_run_on_one_rank(tmp_path):
    """A damaged payload keeps the file's size and framing: TensorFlow's payload checksum finds
    it while a rank reads it. That rank names the file and the record; the other, left waiting
    in a collective, leaves without a line of its own."""
    from hvdtrain.data.convert import convert

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((400, 4)).astype(np.float32),
             y=rng.integers(0, 2, 400), x_val=np.zeros((8, 4), np.float32),
             y_val=np.zeros(8, int))
    convert(tmp_path / "d.npz", tmp_path / "rec", shards=2)
    shard = sorted((tmp_path / "rec").glob("train-*"))[1]
    data = bytearray(shard.read_bytes())
    data[65 * 150 + 20] ^= 0xFF     # records of 4 floats are 65 bytes: in record 151's payload
    shard.write_bytes(bytes(data))
    result = launch(LAUNCHER, 2, ["--dataset", "tfrecord", "--data-path",
                                  str(tmp_path / "rec" / "train-*"), "--val-data-path",
                                  str(tmp_path / "rec" / "validation-*"), "--run-dir",
                                  str(tmp_path / "r"), "--no-progress"], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert re.findall(r"hvdtrain: error: .*", output) == [
        f"hvdtrain: error: {shard}: record 151 is corrupt (its checksum does not match); "
        "regenerate the file with 'hvdtrain convert'"], output[-3000:]
    assert "Traceback" not in output


@pytest.mark.distributed
def test_more_ranks_than_examples(tmp_path):
    np.savez(tmp_path / "one.npz", x=np.zeros((1, 2)), y=np.zeros(1, int),
             x_val=np.zeros((1, 2)), y_val=np.zeros(1, int))
    result = launch(LAUNCHER, 2, ["--dataset", "npz", "--data-path",
                                  str(tmp_path / "one.npz"), "--run-dir",
                                  str(tmp_path / "r")])
    assert result.returncode != 0
    assert "2 ranks but only 1 training examples: every rank needs at least one; launch " \
           "fewer ranks" in result.stderr
    assert "Traceback" not in result.stderr
