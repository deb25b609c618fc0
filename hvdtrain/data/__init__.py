"""Data sources and the sharded input pipeline."""

# Written by ``hvdtrain convert`` beside TFRecord shards: shape, encoding, classes, counts.
METADATA_FILE = "hvdtrain-dataset.json"
