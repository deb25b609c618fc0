"""``hvdtrain convert``: write a ``.npz`` or an image folder as sharded TFRecord files.

Sharded TFRecords are the fast path: ranks read whole files in parallel instead of holding the
dataset in memory. Each example is a ``tf.train.Example`` with the feature (``image``) and an
integer ``label``. ``uint8`` arrays are stored as raw bytes, other numbers as a float list, and
image files keep their PNG/JPEG bytes (decoded in the training pipeline). The converter also
writes ``hvdtrain-dataset.json`` beside the shards: shape, encoding, class count and the record
count of every file, so training needs no counting pass and no feature flags.
"""

from __future__ import annotations

import argparse
import json
import math
import zipfile
from pathlib import Path

import numpy as np

from hvdtrain.data import METADATA_FILE
from hvdtrain.errors import UserError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}


class ConvertError(UserError):
    """The input cannot be converted as given."""


def _example(feature: bytes | np.ndarray, label: int, tf) -> bytes:
    if isinstance(feature, bytes):
        value = tf.train.Feature(bytes_list=tf.train.BytesList(value=[feature]))
    else:
        value = tf.train.Feature(float_list=tf.train.FloatList(value=feature.ravel().tolist()))
    label_feature = tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)]))
    return tf.train.Example(features=tf.train.Features(
        feature={"image": value, "label": label_feature})).SerializeToString()


def write_shards(features: list, labels: np.ndarray, output: Path, prefix: str,
                 shards: int, seed: int) -> dict[str, int]:
    """Write examples in a seeded random order, split evenly across ``shards`` files."""
    import tensorflow as tf

    order = np.random.default_rng(seed).permutation(len(labels))
    shards = max(1, min(shards, len(labels)))
    per_shard = math.ceil(len(labels) / shards)
    counts: dict[str, int] = {}
    for index in range(shards):
        chosen = order[index * per_shard:(index + 1) * per_shard]
        name = f"{prefix}-{index:05d}-of-{shards:05d}.tfrecord"
        with tf.io.TFRecordWriter(str(output / name)) as writer:
            for i in chosen:
                writer.write(_example(features[i], labels[i], tf))
        counts[name] = len(chosen)
    return counts


def _npz_parts(path: Path) -> tuple[dict[str, tuple[list, np.ndarray]], dict]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise ConvertError(f"{path} is not a readable .npz file ({error})") from error
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise ConvertError(f"{path} has only one of 'x_val' and 'y_val'; give both or neither")
    if "x" not in arrays or "y" not in arrays:
        raise ConvertError(f"{path} needs arrays 'x' and 'y'; write it with "
                           "numpy.savez(path, x=..., y=...)")
    raw = arrays["x"].dtype == np.uint8
    parts = {}
    for prefix, (x_key, y_key) in {"train": ("x", "y"), "validation": ("x_val", "y_val")}.items():
        if x_key in arrays:
            x = arrays[x_key]
            features = [row.tobytes() if raw else row.astype(np.float32) for row in x]
            parts[prefix] = (features, arrays[y_key].astype(np.int64).reshape(-1))
    labels = np.concatenate([p[1] for p in parts.values()])
    shape = list(arrays["x"].shape[1:]) or [1]
    return parts, {"shape": shape, "encoding": "raw" if raw else "float",
                   "num_classes": int(labels.max()) + 1}


def _image_folder_parts(path: Path) -> tuple[dict[str, tuple[list, np.ndarray]], dict]:
    import tensorflow as tf

    classes = sorted(p.name for p in path.iterdir() if p.is_dir())
    features, labels = [], []
    for label, name in enumerate(classes):
        for image in sorted((path / name).iterdir()):
            if image.suffix.lower() in IMAGE_SUFFIXES:
                features.append(image.read_bytes())
                labels.append(label)
    if not features:
        raise ConvertError(f"{path} holds no images in class folders (expected "
                           f"{path}/<class>/<image>.png or .jpg)")
    shape = list(tf.io.decode_image(features[0], expand_animations=False).shape)
    return {"train": (features, np.array(labels))}, {
        "shape": shape, "encoding": "png", "num_classes": len(classes), "classes": classes}


def convert(source: Path, output: Path, shards: int, seed: int = 0) -> dict:
    """Convert and return the metadata written beside the shards."""
    if source.is_dir():
        parts, metadata = _image_folder_parts(source)
    elif source.suffix == ".npz" and source.is_file():
        parts, metadata = _npz_parts(source)
    else:
        raise ConvertError(f"{source} is neither a .npz file nor a folder of class folders")
    output.mkdir(parents=True, exist_ok=True)
    metadata["counts"] = {}
    for prefix, (features, labels) in parts.items():
        metadata["counts"].update(write_shards(features, labels, output, prefix, shards, seed))
    # With the sizes, training takes a file at its count without reading it, yet still
    # notices a file cut or changed since.
    metadata["bytes"] = {name: (output / name).stat().st_size for name in metadata["counts"]}
    (output / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    return metadata


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, type=Path,
                        help=".npz with x, y (and x_val, y_val), or a folder of class folders")
    parser.add_argument("--output", required=True, type=Path, help="directory for the shards")
    parser.add_argument("--shards", type=int, default=8, help="files per split (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the record order")


def main(args: argparse.Namespace) -> int:
    metadata = convert(args.input, args.output, args.shards, args.seed)
    total = sum(metadata["counts"].values())
    has_validation = any(name.startswith("validation-") for name in metadata["counts"])
    validation = (f"--val-data-path '{args.output}/validation-*'" if has_validation else
                  "--val-data-path (validation files of your own: none were converted)")
    print(f"wrote {total} examples in {len(metadata['counts'])} files to {args.output} "
          f"(shape {metadata['shape']}, {metadata['encoding']}, {metadata['num_classes']} "
          f"classes); train with --dataset tfrecord --data-path '{args.output}/train-*' "
          f"{validation}")
    return 0
