"""A user's script that trains with ``hvdtrain.fit`` and handles a stop as the README says:

    python fit_stop_script.py RUN_DIR

A SIGTERM mid-run (to the launcher, which forwards it) stops every rank at one step with a
checkpoint; ``fit`` raises ``StoppedBySignal`` and the script exits with its code (75). Each
rank then prints whether the signal handlers are back to what they were before ``fit``.
"""

from __future__ import annotations

import signal
import sys
import time

import keras

import hvdtrain
from hvdtrain.errors import StoppedBySignal
from workloads import regression_data


def main() -> int:
    run_dir = sys.argv[1]
    hvdtrain.init()   # before the model: the TensorFlow backend starts TensorFlow's runtime
    before = [signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)]
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(loss="mse")
    # Slow steps (a user's callback; timing, not the math), so the job is still running when
    # the signal comes, whatever the backend and the machine.
    slow = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: time.sleep(0.05))
    code = 0
    try:
        hvdtrain.fit(model, regression_data(), epochs=40, batch_size=16, run_dir=run_dir,
                     checkpoint_every_steps=4, optimizer="adam", progress=False,
                     callbacks=[slow])
    except StoppedBySignal as stop:
        print(f"fit stopped: {stop}", flush=True)
        code = stop.exit_code
    after = [signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)]
    print(f"handlers restored: {after == before}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
