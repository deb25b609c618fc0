"""A user's script driving hvdtrain from Python, launched by horovodrun (or run alone):

    python api_script.py OUT_JSON RUN_DIR

Every rank calls ``hvdtrain.fit`` with a model object and arrays; rank 0 writes what every rank
got back, so the test can check that all ranks returned the same exact metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import keras

import hvdtrain
from workloads import regression_data


def main() -> None:
    out, run_dir = Path(sys.argv[1]), sys.argv[2]
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(loss="mse", metrics=[keras.metrics.RootMeanSquaredError(name="rmse")])
    result = hvdtrain.fit(model, regression_data(), epochs=3, batch_size=16, run_dir=run_dir,
                          optimizer="adam", learning_rate=0.01, progress=False)
    # A second run in the same process starts clean (global state restored by the first).
    again = hvdtrain.fit(model, regression_data(), epochs=1, batch_size=16,
                         run_dir=run_dir + "-again", optimizer="adam", learning_rate=0.01,
                         progress=False)
    from hvdtrain.collectives import init_collectives

    collectives = init_collectives()
    everyone = collectives.allgather_object(
        {"metrics": result.metrics, "again": again.metrics, "run_dir": str(result.run_dir),
         "fingerprints": result.fingerprints, "policy": keras.mixed_precision.global_policy().name})
    if collectives.world.is_chief:
        out.write_text(json.dumps(everyone))


if __name__ == "__main__":
    main()
