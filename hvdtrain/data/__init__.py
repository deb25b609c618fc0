"""Data sources and the sharded input pipeline. ``contract`` is what training asks of a source
(a leaf: no source imports it back); the built-in sources (``sources``, over ``arrays``,
``files`` with ``records``, ``keras_files``) and a user's data (``user``, over ``datasets``) are
chosen by ``load``; ``pipeline`` shards by rank, shuffles, batches and prefetches;
``equal_steps`` gives every rank the same number of steps with nothing made up; ``order``
keeps a user's dataset in one order on every rank; ``convert`` is ``hvdtrain convert``."""

# Written by ``hvdtrain convert`` beside TFRecord shards: shape, encoding, classes, counts.
METADATA_FILE = "hvdtrain-dataset.json"
