"""Run on several ranks: each records the example ids (the labels) and the per-step loss
weights the real pipeline gives it for two epochs, and rank 0 writes everyone's record as JSON
to the output file (a file, because launchers split long output lines).

    python -m shard_probe arrays NUM_EXAMPLES BATCH OUT
    python -m shard_probe tfrecord DIR BATCH OUT       (DIR/train-*; labels: the example ids)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from hvdtrain.collectives import init_collectives
from hvdtrain.config import DataConfig
from hvdtrain.data.contract import ArraySplit
from hvdtrain.data.files import tfrecord_split
from hvdtrain.data.pipeline import ShardSpec


def main() -> None:
    kind, what, batch, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    collectives = init_collectives()
    world = collectives.world
    if kind == "arrays":
        ids = np.arange(int(what))
        split = ArraySplit(ids[:, None].astype(np.float32), ids)
    else:
        split, _ = tfrecord_split(DataConfig(dataset="tfrecord", shuffle_buffer=7),
                                  str(Path(what) / "train-*"), "glob")
    spec = ShardSpec(split.num_examples, world, batch, "pad", True, seed=3)
    record = {"rank": world.rank, "steps": [], "ids": [], "weight_sums": [],
              "mode": getattr(split, "mode", lambda size: "arrays")(world.size)}
    for epoch in range(2):
        seen: list[int] = []
        sums: list[float] = []
        for _, labels, _, weights in split.dataset(spec, epoch, epoch + 1):
            seen += labels.numpy()[weights.numpy() > 0].tolist()
            sums.append(float(weights.numpy().sum()))
        record["steps"].append(len(sums))
        record["ids"].append(seen)
        record["weight_sums"].append(sums)
    everyone = collectives.allgather_object(record)
    if world.is_chief:
        out.write_text(json.dumps(everyone))


if __name__ == "__main__":
    main()
