"""File sources (TFRecord, CSV): sharded by file or by element, read with parallel interleave.

With at least as many files as ranks each rank reads its own files of a seeded per-epoch
permutation (``file``); with fewer, every rank reads all and keeps records r, r+N, ...
(``element``). Either way every record is read by one rank per epoch, and every rank runs the
same number of steps, fixed from the record counts: a short rank fills with a real record at
weight zero (``data.equal_steps``). Records shuffle in seeded blocks of ``shuffle_buffer``;
``cache`` keeps each rank's parsed records in memory after the first epoch.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from hvdtrain.config import DataConfig
from hvdtrain.data import METADATA_FILE
from hvdtrain.data.equal_steps import first_element
from hvdtrain.data.pipeline import ShardSpec
from hvdtrain.data.records import DamagedRecordFile, count_records, damaged_record_at
from hvdtrain.errors import UserError, first_sentence


Parser = Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]]
LABEL_RANGE_MESSAGE = "hvdtrain: label out of range"


class FileDataError(UserError):
    """Files are missing, empty, corrupt or do not match the configured feature spec."""


@dataclass(frozen=True)
class FileSplit:
    """A set of record files with their counts, and how to read and parse one record."""

    files: tuple[str, ...]
    counts: tuple[int, ...]
    reader: Callable[[tf.Tensor], tf.data.Dataset]
    parse: Parser
    input_shape: tuple[int, ...]
    shuffle_buffer: int = 4096
    cache: bool = False
    label_shape: tuple[int, ...] = ()
    label_dtype: tf.DType = tf.int64
    normalised: bool = True

    @property
    def num_examples(self) -> int:
        return sum(self.counts)

    def mode(self, world_size: int) -> str:
        return "file" if len(self.files) >= world_size else "element"

    def rank_capacity(self, world_size: int, largest: bool) -> int:
        """The most (or fewest) records any one rank can be given in an epoch."""
        n = self.num_examples
        if self.mode(world_size) == "element":
            return math.ceil(n / world_size) if largest else n // world_size
        ordered = sorted(self.counts, reverse=largest)
        share = math.ceil(len(ordered) / world_size) if largest else len(ordered) // world_size
        return sum(ordered[:share])

    def steps_per_epoch(self, spec: ShardSpec) -> int:
        group = spec.batch_size * spec.accumulation_steps
        if spec.remainder == "pad" and not self.cache:
            updates = math.ceil(self.rank_capacity(spec.world.size, True) / group)
        elif spec.remainder == "pad":
            updates = math.ceil(self._cached_counts(spec.world.size).max() / group)
        else:
            updates = self.rank_capacity(spec.world.size, False) // group
        return updates * spec.accumulation_steps

    def _cached_counts(self, world_size: int) -> np.ndarray:
        """Records per rank when the file assignment is fixed (epoch 0's, for caching)."""
        if self.mode(world_size) == "element":
            n = self.num_examples
            return np.array([len(range(r, n, world_size)) for r in range(world_size)])
        return np.array([sum(self.counts[r::world_size]) for r in range(world_size)])

    def _assignment(self, spec: ShardSpec, epoch: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """(this rank's files, records per rank) for an epoch."""
        size, rank = spec.world.size, spec.world.rank
        files = tf.constant(self.files)
        counts = tf.constant(self.counts, tf.int64)
        if self.mode(size) == "element":
            n = self.num_examples
            per_rank = tf.constant([len(range(r, n, size)) for r in range(size)], tf.int64)
            return files, per_rank
        order = tf.range(len(self.files), dtype=tf.int64)
        if spec.shuffle and not self.cache:
            seed = tf.stack([tf.constant(spec.seed, tf.int64), tf.cast(epoch, tf.int64)])
            order = tf.random.experimental.stateless_shuffle(order, seed=seed)
        owner = tf.range(len(self.files), dtype=tf.int64) % size
        per_rank = tf.math.unsorted_segment_sum(tf.gather(counts, order), owner, size)
        return tf.gather(files, order[rank::size]), per_rank

    def _records(self, spec: ShardSpec, files: tf.Tensor) -> tf.data.Dataset:
        size, rank = spec.world.size, spec.world.rank
        if self.mode(size) == "element":
            records = tf.data.Dataset.from_tensor_slices(files).flat_map(self.reader)
            records = records.shard(size, rank)
        else:
            records = tf.data.Dataset.from_tensor_slices(files).interleave(
                self.reader, cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True)
        return records.map(self.parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def _block_shuffle(self, records: tf.data.Dataset, spec: ShardSpec,
                       epoch: tf.Tensor) -> tf.data.Dataset:
        """Shuffle within blocks, seeded by (seed, epoch, rank, block): reproducible, and
        different every epoch."""
        base = tf.stack([tf.constant(spec.seed, tf.int64), tf.cast(epoch, tf.int64)])

        def shuffle_block(index, block):
            seed = base + tf.stack([tf.constant(spec.world.rank, tf.int64) * 1_000_003, index])
            order = tf.random.experimental.stateless_shuffle(
                tf.range(tf.shape(block[1])[0]), seed=seed)
            return tf.data.Dataset.from_tensor_slices(
                (tf.gather(block[0], order), tf.gather(block[1], order)))

        return records.batch(self.shuffle_buffer).enumerate().flat_map(shuffle_block)

    def dataset(self, spec: ShardSpec, first_epoch: int = 0,
                end_epoch: int = 1) -> tf.data.Dataset:
        """(features, labels, sample weights, loss weights) batches for epochs
        ``[first_epoch, end_epoch)``."""
        if not spec.equal_steps:
            return self._unpadded(spec)
        steps, batch = self.steps_per_epoch(spec), spec.batch_size
        group = batch * spec.accumulation_steps
        cached = None
        if self.cache:
            cached = self._records(spec, self._assignment(spec, 0)[0]).cache()
        # What fills a rank's short share: a real record (the first one) at weight 0.
        holder = next(name for name, count in zip(self.files, self.counts) if count)
        first_x, first_y = first_element(self.reader(tf.constant(holder)).map(self.parse))
        filler = (first_x, first_y, tf.constant(0.0))

        def epoch_batches(epoch: tf.Tensor) -> tf.data.Dataset:
            files, per_rank = self._assignment(spec, epoch)
            if cached is not None:
                per_rank = tf.constant(self._cached_counts(spec.world.size), tf.int64)
            records = cached if cached is not None else self._records(spec, files)
            if spec.shuffle:
                records = self._block_shuffle(records, spec, epoch)
            slots = steps * batch
            mine = tf.minimum(per_rank[spec.world.rank], slots)
            real = records.take(slots).map(lambda x, y: (x, y, tf.constant(1.0)))
            padding = tf.data.Dataset.from_tensors(filler).repeat(slots - mine)
            batches = real.concatenate(padding).batch(batch, drop_remainder=True)
            starts = tf.range(steps, dtype=tf.int64) // spec.accumulation_steps * group
            if spec.remainder == "pad":
                in_update = tf.clip_by_value(per_rank[:, tf.newaxis] - starts[tf.newaxis, :],
                                             0, group)
                per_update = tf.cast(tf.reduce_sum(in_update, axis=0), tf.float32)
            else:
                per_update = tf.fill([steps], float(group * spec.world.size))
            scale = tf.data.Dataset.from_tensor_slices(1.0 / tf.maximum(per_update, 1.0))
            return tf.data.Dataset.zip(batches, scale).map(
                lambda element, inverse: (element[0], element[1], tf.ones_like(element[2]),
                                          element[2] * inverse))

        epochs = tf.data.Dataset.range(first_epoch, end_epoch)
        return epochs.flat_map(epoch_batches).prefetch(tf.data.AUTOTUNE)

    def _unpadded(self, spec: ShardSpec) -> tf.data.Dataset:
        """This rank's records once, in file order, unpadded (evaluation under a model's own
        ``test_step``)."""
        records = self._records(spec, self._assignment(spec, 0)[0])

        def with_weights(x: tf.Tensor, y: tf.Tensor) -> tuple:
            ones = tf.ones([tf.shape(x)[0]], tf.float32)
            return x, y, ones, ones

        return records.batch(spec.batch_size).map(with_weights).prefetch(tf.data.AUTOTUNE)


def expand(pattern: str, what: str) -> tuple[str, ...]:
    """The sorted files matching a glob; a one-line error when there are none."""
    files = tuple(sorted(p for p in glob.glob(pattern) if Path(p).is_file()))
    if not files:
        raise FileDataError(f"no files match {what} '{pattern}'; check the path")
    return files


def read_metadata(files: tuple[str, ...]) -> dict:
    """The converter's metadata beside the files, if there is one."""
    path = Path(files[0]).parent / METADATA_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def count_tfrecords(files: tuple[str, ...], metadata: dict) -> tuple[int, ...]:
    """Records per file. The converter's metadata holds each file's count and size: a file of
    that size is taken at its count without reading it. Any other file is scanned
    (``records.count_records``), so a file damaged anywhere, even cut inside a header (which
    TensorFlow's reader takes for a clean end), is refused here instead of trained around."""
    known, sizes = metadata.get("counts", {}), metadata.get("bytes", {})
    counts = []
    for name in files:
        base = Path(name).name
        if base in known and sizes.get(base) == Path(name).stat().st_size:
            counts.append(int(known[base]))
            continue
        try:
            count = count_records(name)
        except DamagedRecordFile as damage:
            raise FileDataError(f"{name} {damage}; regenerate it with 'hvdtrain convert'") \
                from None
        if base in known and count != int(known[base]):
            raise FileDataError(f"{name} holds {count} records but {METADATA_FILE} says "
                                f"{known[base]}: it changed after conversion; regenerate it "
                                "with 'hvdtrain convert'")
        counts.append(count)
    if sum(counts) == 0:
        raise FileDataError(f"the files {files[0]}... hold no records")
    return tuple(counts)


def corrupt_record_message(splits: Sequence[object], detail: str) -> str:
    """The line for a record that failed TensorFlow's checksum mid-run (``detail``: its
    DataLossError), naming the file and the record when the files show which one it was."""
    found = None
    offset = re.search(r"corrupted record at (\d+)", detail)
    if offset is not None:
        files = [name for split in splits if isinstance(split, FileSplit)
                 for name in split.files]
        found = damaged_record_at(files, int(offset.group(1)))
    if found is None:
        return (f"a TFRecord file is corrupt ({first_sentence(detail)}); regenerate it "
                "with 'hvdtrain convert'")
    return (f"{found[0]}: record {found[1]} is corrupt (its checksum does not match); "
            "regenerate the file with 'hvdtrain convert'")


def tfrecord_parser(config: DataConfig, shape: tuple[int, ...], encoding: str) -> Parser:
    """Parse one serialized tf.train.Example into (float32 features, label: int64 class id or
    float32 target of ``--label-shape``)."""
    if encoding == "float":
        feature = tf.io.FixedLenFeature(shape, tf.float32)
    else:
        feature = tf.io.FixedLenFeature([], tf.string)
    label = tf.io.FixedLenFeature(config.label_shape, tf.as_dtype(config.label_dtype))
    spec = {config.feature_key: feature, config.label_key: label}

    def parse(serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        example = tf.io.parse_single_example(serialized, spec)
        value = example[config.feature_key]
        if encoding == "raw":
            value = tf.cast(tf.reshape(tf.io.decode_raw(value, tf.uint8), shape), tf.float32) / 255
        elif encoding in ("png", "jpeg"):
            image = tf.io.decode_image(value, channels=shape[-1], expand_animations=False)
            value = tf.cast(tf.reshape(image, shape), tf.float32) / 255
        return value, example[config.label_key]

    return parse


def tfrecord_split(config: DataConfig, pattern: str,
                   what: str) -> tuple[FileSplit, int | None]:
    """A TFRecord split and its class count (from the metadata or ``--num-classes``; None for
    float or shaped labels)."""
    files = expand(pattern, what)
    metadata = read_metadata(files)
    shape = tuple(config.feature_shape or metadata.get("shape", []))
    if not shape:
        raise FileDataError("the TFRecord feature shape is unknown; set --feature-shape "
                            "(or write the files with 'hvdtrain convert')")
    encoding = metadata.get("encoding", config.feature_encoding)
    parse = tfrecord_parser(config, shape, encoding)
    num_classes = None
    if config.label_dtype == "int64" and not config.label_shape:
        num_classes = config.num_classes or metadata.get("num_classes")
        if not num_classes:
            raise FileDataError("the number of classes is unknown; set --num-classes (or write "
                                "the files with 'hvdtrain convert'), or --label-dtype float32 "
                                "for regression targets")
        parse = checked_labels(parse, int(num_classes))
    split = FileSplit(files, count_tfrecords(files, metadata), tf.data.TFRecordDataset, parse,
                      shape, config.shuffle_buffer, config.cache, tuple(config.label_shape),
                      tf.as_dtype(config.label_dtype))
    return split, None if num_classes is None else int(num_classes)


def checked_labels(parse: Parser, num_classes: int) -> Parser:
    """Fail on a label outside [0, num_classes) instead of training on garbage."""

    def checked(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        features, label = parse(record)
        in_range = tf.logical_and(label >= 0, label < num_classes)
        with tf.control_dependencies([tf.debugging.Assert(in_range, [LABEL_RANGE_MESSAGE,
                                                                     label])]):
            return tf.identity(features), tf.identity(label)

    return checked


def numeric_rows(name: str, header: list[str]) -> list[list[float]]:
    """A CSV file's data rows as numbers. Every cell is checked here, so a bad one is named by
    file, line and column before training; TensorFlow's CSV decoder would fail mid-epoch
    without saying which file, or read an empty cell as 0."""
    with open(name, newline="") as handle:
        lines = list(csv.reader(handle))[1:]
    rows = []
    for line, cells in enumerate(lines, start=2):
        if len(cells) != len(header):
            raise FileDataError(f"{name}: line {line} has {len(cells)} columns, the header "
                                f"{len(header)}; every row needs every column")
        row = []
        for column, cell in zip(header, cells):
            try:
                row.append(_number(cell))
            except ValueError:
                raise FileDataError(f"{name}: line {line}, column '{column}': {cell!r} is not "
                                    "a number; every cell must be a number (fix or remove the "
                                    "row)") from None
        rows.append(row)
    return rows


def _number(cell: str) -> float:
    """The cell as TensorFlow's CSV decoder reads it (Python's float also takes 1_000)."""
    if "_" in cell:
        raise ValueError(cell)
    return float(cell)


def csv_split(config: DataConfig, pattern: str,
              what: str) -> tuple[FileSplit, int | None]:
    """A CSV split: a header row, numeric feature columns and a numeric label column: whole
    numbers are class ids, any other value makes the column a float regression target."""
    files = expand(pattern, what)
    with open(files[0], newline="") as handle:
        header = next(csv.reader(handle), [])
    if config.label_column not in header:
        raise FileDataError(f"{files[0]} has no column '{config.label_column}' (columns: "
                            f"{', '.join(header)}); set --label-column")
    label_index = header.index(config.label_column)
    counts, labels = [], []
    for name in files:
        rows = numeric_rows(name, header)
        counts.append(len(rows))
        labels += [row[label_index] for row in rows]
    if sum(counts) == 0:
        raise FileDataError(f"the CSV files matching '{pattern}' hold no rows")
    defaults = [tf.constant(0.0)] * len(header)
    features = [i for i in range(len(header)) if i != label_index]

    classes = all(label.is_integer() for label in labels)
    label_dtype = tf.int64 if classes else tf.float32

    def parse(line: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        columns = tf.io.decode_csv(line, record_defaults=defaults)
        return (tf.stack([columns[i] for i in features]),
                tf.cast(columns[label_index], label_dtype))

    num_classes = int(config.num_classes or max(labels, default=0) + 1) if classes else None
    split = FileSplit(files, tuple(counts), lambda f: tf.data.TextLineDataset(f).skip(1),
                      checked_labels(parse, num_classes) if classes else parse, (len(features),),
                      config.shuffle_buffer, config.cache, (), label_dtype)
    return split, num_classes
