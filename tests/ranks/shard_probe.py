"""Run on several ranks: each records the example ids (the labels) and the per-step loss
weights the real pipeline gives it for two epochs, and rank 0 writes everyone's record as JSON
to the output file (a file, because launchers split long output lines).

    python -m shard_probe arrays NUM_EXAMPLES BATCH OUT
    python -m shard_probe tfrecord DIR BATCH OUT       (DIR/train-*; labels: the example ids)

Several probes, one after the other in the same ranks (one launch): their four arguments in a
row, ``KIND WHAT BATCH OUT KIND WHAT BATCH OUT ...``.
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


def probe(collectives, kind: str, what: str, batch: int, out: Path) -> None:
    """One probe: rank 0 writes every rank's record to ``out``."""
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


def main() -> None:
    collectives = init_collectives()
    args = sys.argv[1:]
    for start in range(0, len(args), 4):
        kind, what, batch, out = args[start:start + 4]
        probe(collectives, kind, what, int(batch), Path(out))


if __name__ == "__main__":
    main()
