"""Run on several ranks: each records the example ids the real pipeline gives it for two
epochs, and rank 0 writes everyone's record as JSON to the file named by the third argument
(a file, because launchers split long output lines)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from hvdtrain.data.pipeline import ShardSpec, array_dataset
from hvdtrain.world import init_collectives


def main() -> None:
    num_examples, batch = int(sys.argv[1]), int(sys.argv[2])
    collectives = init_collectives()
    world = collectives.world
    ids = np.arange(num_examples)
    spec = ShardSpec(num_examples, world, batch, "pad", True, seed=3)
    record = {"rank": world.rank, "steps": [], "ids": []}
    for epoch in range(2):
        seen: list[int] = []
        steps = 0
        for _, labels, weights in array_dataset(ids[:, None].astype(np.float32), ids, spec,
                                                epoch, epoch + 1):
            seen += labels.numpy()[weights.numpy() > 0].tolist()
            steps += 1
        record["steps"].append(steps)
        record["ids"].append(seen)
    everyone = collectives.allgather_object(record)
    if world.is_chief:
        Path(sys.argv[3]).write_text(json.dumps(everyone))


if __name__ == "__main__":
    main()
