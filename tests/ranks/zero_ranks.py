"""ZeRO (``zero_stage=``) on every rank of one job, each case against what one process computes
(``mpirun -np 2 python -m zero_ranks OUT_DIR BACKEND CASES``, or ``python -m zero_ranks OUT_DIR
none CASES`` for one process):

- ``optimizers``: SGD, momentum, Nesterov, Adam, AdamW (biases excluded from weight decay),
  RMSprop, Adagrad, Lion, a user's own elementwise optimizer, Adam with ``clipnorm`` and
  momentum with ``global_clipnorm``, each at stage 2 or 3 (``optimizer_stage``) on a model
  with a kernel constraint, against Keras ``fit`` in one process with the global batch;
- ``variants``: Adam at stages 1, 2 and 3 with two accumulated micro-steps (against Keras with
  the four-times batch), in the custom loop, under mixed precision (a loss-scale optimizer,
  stages 2 and 3), a model's own ``train_step`` with two optimizers (a GAN's shape; stages 2
  and 3), and at stage 3 regularizers, a constraint, ``add_loss`` and a Dropout inside a
  layer's call, with ``--remat full`` (against stage 0 with it on the same ranks: one
  process draws other masks);
- ``diverged``: a sharded run whose loss diverges stops every rank, its optimizer whole again;
- ``resume-from FROM STAGE EPOCHS`` / ``checkpoint-to TO STAGE``: continue at STAGE to EPOCHS
  the run in FROM (written by another world size), and write a one-epoch run into TO.

Every rank writes what it saw to ``OUT_DIR/zero-<rank>.json``: per case the largest relative
difference from the reference, the optimizer state's and the weights' shapes during training
and after. Every rank
trains every case (the collectives need them all), but the one-process reference of the i-th
optimizer or variant case is fitted on rank ``i % SIZE`` alone, which writes that case (the test
reads the cases from every rank's file): the reference is the same on every rank, so fitting it
on each repeated the work, and a rank fitting one overlaps the next case's setup on the others.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import hvdtrain
from hvdtrain.keras_internals import automatic_names_kept

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
BATCH = 16            # per rank at two ranks: a global batch of 32
EXAMPLES = 128


def data() -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(0)
    x = generator.normal(size=(EXAMPLES, 8)).astype(np.float32)
    return x, (x @ generator.normal(size=(8, 1))).astype(np.float32)


class SignMomentum(keras.optimizers.Optimizer):
    """A user's own elementwise optimizer: a momentum of the gradients' signs."""

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.velocities = [self.add_variable_from_reference(v, "velocity") for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        velocity = self.velocities[self._get_variable_index(variable)]
        self.assign(velocity, 0.5 * velocity + tf.sign(gradient))
        self.assign_sub(variable, tf.cast(learning_rate, variable.dtype) * velocity)


def adamw() -> keras.optimizers.Optimizer:
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": adamw,
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "lion": lambda: keras.optimizers.Lion(0.003),
    "own": lambda: SignMomentum(0.01),
    # Norm clipping (the mean gradients' norms are about 1: both clip every step).
    "adam-clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.05),
    "momentum-global-clipnorm": lambda: keras.optimizers.SGD(0.05, momentum=0.9,
                                                             global_clipnorm=0.05),
}


def model(optimizer: keras.optimizers.Optimizer) -> keras.Model:
    keras.utils.set_random_seed(3)
    built = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(12, activation="tanh",
                           kernel_constraint=keras.constraints.MaxNorm(0.9)),
        keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)])
    built.compile(optimizer=optimizer, loss="mse")
    return built


class TwoOptimizers(keras.Model):
    """A model's own ``train_step`` with two optimizers, as a GAN has: the first layer's
    weights by ``optimizer``, the rest by ``head_optimizer``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = keras.layers.Dense(12, activation="tanh")
        self.head = keras.layers.Dense(1)
        self.head_optimizer = keras.optimizers.RMSprop(0.01)

    def call(self, x):
        return self.head(self.body(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        self.optimizer.apply(tape.gradient(loss, self.body.trainable_weights),
                             self.body.trainable_weights)
        self.head_optimizer.apply(tape.gradient(loss, self.head.trainable_weights),
                                  self.head.trainable_weights)
        return {"loss": loss}


def two_optimizers() -> keras.Model:
    keras.utils.set_random_seed(3)
    built = TwoOptimizers()
    built.compile(optimizer=keras.optimizers.Adam(0.01))
    built(np.zeros((1, 8), np.float32))
    return built


class StateShapes(keras.callbacks.Callback):
    """The shapes of every optimizer variable at the last epoch's end (while sharded)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list = []
        self.weight_shapes: list = []

    def on_epoch_end(self, epoch, logs=None):
        self.shapes = [list(v.shape) for optimizer in optimizers_of(self.model)
                       for v in optimizer.variables]
        self.weight_shapes = [list(w.shape) for w in self.model.trainable_weights]


def optimizers_of(built: keras.Model) -> list[keras.optimizers.Optimizer]:
    return [built.optimizer] + ([built.head_optimizer] if isinstance(built, TwoOptimizers)
                                else [])


def difference(ours: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    """The largest difference of two lists of arrays, relative to the reference's scale."""
    return max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
               for a, b in zip(ours, theirs))


def state(built: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v) for optimizer in optimizers_of(built)
            for v in optimizer.variables]


def sharded_run(out: Path, name: str, make, x, y, epochs: int, **options):
    shapes = StateShapes()
    trained = make()
    hvdtrain.fit(trained, x, y, batch_size=BATCH, epochs=epochs, shuffle=False,
                 callbacks=[shapes], run_dir=str(out / f"run-{name}"), progress=False,
                 tensorboard=False, lr_scaling="none", warmup_epochs=0, deterministic=True,
                 **options)
    return trained, shapes


def reference_fit(make, x, y, batch_size: int, epochs: int) -> keras.Model:
    """Keras ``fit`` in this process, on one rank only: the automatic names it takes (dense_7...)
    are given back, so the next run's layers, whose paths name their collectives, are named as
    on the ranks that did not fit it."""
    with automatic_names_kept():
        reference = make()
        reference.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return reference


def case(out: Path, name: str, make, x, y, reference_batch: int | None, epochs: int = 2,
         against_stage_0: bool = False, compared: bool = True, **options) -> dict | None:
    """One sharded run on the job's ranks against Keras ``fit`` in this process (no collective:
    the same numbers on every rank; ``reference_batch`` None: no such reference, a model
    whose ranks draw their own dropout masks); ``against_stage_0``: also against the same run
    unsharded on these ranks. ``compared`` False: this rank only trains its part (the runs'
    collectives), and another rank compares; None."""
    trained, shapes = sharded_run(out, name, make, x, y, epochs, **options)
    if against_stage_0:
        unsharded, _ = sharded_run(out, name + "-stage-0", make, x, y, epochs,
                                   **{**options, "zero_stage": 0})
    if not compared:
        return None
    seen = {"shapes_while_training": shapes.shapes,
            "weight_shapes_while_training": shapes.weight_shapes,
            "weight_shapes": [list(w.shape) for w in trained.trainable_weights],
            "shapes_after": [list(v.shape) for v in state(trained)]}
    if reference_batch is not None:
        reference = reference_fit(make, x, y, reference_batch, epochs)
        seen.update(weights=difference(trained.get_weights(), reference.get_weights()),
                    state=difference(state(trained), state(reference)))
    if against_stage_0:
        seen["weights_vs_stage_0"] = difference(trained.get_weights(), unsharded.get_weights())
        seen["state_vs_stage_0"] = difference(state(trained), state(unsharded))
    return seen


# Optimizers that divide by the root of a sum of squared gradients, which magnifies float32
# rounding: their sharded runs are also compared with the unsharded run on the same ranks,
# where only sharding can differ.
MAGNIFIED = ("rmsprop", "adagrad")


def on_this_rank(cases: dict) -> dict:
    """The cases this rank compared (``case`` returns None for the others)."""
    return {name: seen for name, seen in cases.items() if seen is not None}


def optimizer_stage(index: int, backend: str) -> int:
    """Each optimizer at stage 2 on one backend and at stage 3 on the other (alternating by
    its place in ``OPTIMIZERS``): their update of the pieces is the same code, and both stages
    meet every optimizer without a second run of each."""
    return 2 + (index + (backend == "tensorflow")) % 2


def optimizer_cases(out: Path, x, y, backend: str) -> dict:
    return on_this_rank({
        name: case(out, name, lambda make=make: model(make()), x, y, BATCH * SIZE,
                   against_stage_0=name in MAGNIFIED, compared=index % SIZE == RANK,
                   zero_stage=optimizer_stage(index, backend))
        for index, (name, make) in enumerate(OPTIMIZERS.items())})


def mixed_precision_model() -> keras.Model:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return model(keras.optimizers.Adam(0.01))
    finally:
        keras.mixed_precision.set_global_policy("float32")


class Penalized(keras.layers.Layer):
    """A layer of its own with a Dropout and ``add_loss`` inside its call: at stage 3 the
    call is recomputed for the gradient, which must draw the same mask and keep the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = keras.layers.Dropout(0.3)

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 6), initializer="glorot_uniform")

    def call(self, x, training=None):
        out = self.drop(x @ self.w, training=training)
        self.add_loss(0.01 * keras.ops.mean(keras.ops.square(out)))
        return keras.ops.tanh(out)


def layers_in_their_calls() -> keras.Model:
    """Weight and activity regularizers, a constraint, a string regularizer, and
    ``Penalized``: what stage 3 moves into each layer's gathering call; and layers without
    weights (a Dropout, an activation), which ``--remat full`` recomputes."""
    keras.utils.set_random_seed(3)
    built = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(12, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01),
                           activity_regularizer=keras.regularizers.L1(0.001),
                           kernel_constraint=keras.constraints.MaxNorm(0.9)),
        Penalized(), keras.layers.Dropout(0.2), keras.layers.Activation("relu"),
        keras.layers.Dense(1, kernel_regularizer="l1")])
    built.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return built


# Stage-3 variants run on Horovod's collectives only: on TensorFlow's, stage 3 is met by half
# the optimizers, mixed precision and the layers case (the suite pays for its time).
HOROVOD_ONLY = ("accumulated-stage-3", "own-step-two-optimizers-stage-3")


def variant_cases(out: Path, x, y, backend: str) -> dict:
    adam = lambda: model(keras.optimizers.Adam(0.01))  # noqa: E731
    variants = {   # name: (run name, model, reference batch, options)
        "accumulated-stage-1": ("acc1", adam, 2 * BATCH * SIZE,
                                dict(zero_stage=1, accumulation_steps=2)),
        "accumulated-stage-2": ("acc2", adam, 2 * BATCH * SIZE,
                                dict(zero_stage=2, accumulation_steps=2)),
        "custom-loop": ("custom", adam, BATCH * SIZE, dict(zero_stage=2, loop="custom")),
        "mixed-precision": ("mixed", mixed_precision_model, BATCH * SIZE,
                            dict(against_stage_0=True, zero_stage=2)),
        "own-step-two-optimizers": ("own-step", two_optimizers, BATCH * SIZE,
                                    dict(against_stage_0=True, zero_stage=2)),
        "accumulated-stage-3": ("acc3", adam, 2 * BATCH * SIZE,
                                dict(zero_stage=3, accumulation_steps=2)),
        "own-step-two-optimizers-stage-3": ("own-step3", two_optimizers, BATCH * SIZE,
                                            dict(zero_stage=3)),
        "mixed-precision-stage-3": ("mixed3", mixed_precision_model, BATCH * SIZE,
                                    dict(against_stage_0=True, zero_stage=3)),
        "layers-stage-3": ("layers3", layers_in_their_calls, None,
                           dict(against_stage_0=True, zero_stage=3, remat="full")),
    }
    first = len(OPTIMIZERS)    # numbered on from the optimizer cases: the ranks share evenly
    if backend == "tensorflow":
        variants = {name: v for name, v in variants.items() if name not in HOROVOD_ONLY}
    return on_this_rank({
        name: case(out, run, make, x, y, batch, compared=(first + index) % SIZE == RANK,
                   **options)
        for index, (name, (run, make, batch, options)) in enumerate(variants.items())})


def diverged_case(out: Path, x, y) -> dict:
    """A run every rank stops together (its loss diverges): the optimizer leaves whole."""
    from hvdtrain.errors import TrainingDiverged

    trained = model(keras.optimizers.Adam(0.01))
    try:   # squared errors of about 1e60: infinite in float32
        hvdtrain.fit(trained, x, y * 1e30, batch_size=BATCH, epochs=2, shuffle=False,
                     run_dir=str(out / "run-diverged"), progress=False, tensorboard=False,
                     lr_scaling="none", warmup_epochs=0, zero_stage=2)
        stopped = ""
    except TrainingDiverged as error:
        stopped = type(error).__name__
    return {"stopped": stopped, "shapes_after": [list(v.shape) for v in state(trained)],
            "weights": [list(w.shape) for w in trained.get_weights()]}


def resume_case(out: Path, source: Path, stage: int, epochs: int, x, y) -> dict | None:
    """Continue at ``stage`` to ``epochs`` the run in ``source``, whose newest checkpoint
    another world size wrote with the same global batch (32), without ``accept_changes``:
    the same run. Before, half that global batch is refused (its one line kept), leaving the
    run as it was. And how many ranks held the state that checkpoint records, and whether its
    optimizer state went straight into pieces. Rank 0 alone says it (the others: None)."""
    import logging

    from hvdtrain.errors import UserError

    records = [json.loads(path.read_text()).get("sharded")
               for path in sorted(source.rglob("state.json"))]
    options = dict(epochs=epochs, shuffle=False, run_dir=str(source), resume="required",
                   progress=False, tensorboard=False, lr_scaling="none", warmup_epochs=0,
                   deterministic=True, zero_stage=stage)
    try:
        hvdtrain.fit(model(keras.optimizers.Adam(0.01)), x, y, batch_size=16 // SIZE, **options)
        refused = ""
    except UserError as error:
        refused = str(error)
    trained = model(keras.optimizers.Adam(0.01))
    lines: list[str] = []
    seen = logging.Handler()
    seen.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("hvdtrain").addHandler(seen)
    try:
        hvdtrain.fit(trained, x, y, batch_size=32 // SIZE, **options)
    finally:
        logging.getLogger("hvdtrain").removeHandler(seen)
    if RANK:        # rank 0 compares: the reference is the same on every rank
        return None
    reference = reference_fit(lambda: model(keras.optimizers.Adam(0.01)), x, y, 32, epochs)
    return {"weights": difference(trained.get_weights(), reference.get_weights()),
            "state": difference(state(trained), state(reference)),
            "held_by": records[-1] and records[-1]["ranks"], "refused": refused,
            "into_pieces": any("into each rank's pieces" in line for line in lines)}


def checkpoint_to(target: Path, stage: int, x, y) -> None:
    """One epoch at ``stage`` into ``target`` (a checkpoint another world size resumes)."""
    hvdtrain.fit(model(keras.optimizers.Adam(0.01)), x, y, batch_size=32 // SIZE, epochs=1,
                 shuffle=False, run_dir=str(target), progress=False, tensorboard=False,
                 lr_scaling="none", warmup_epochs=0, deterministic=True, zero_stage=stage)


def main() -> None:
    out, backend, cases = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if backend != "none":
        os.environ["HVDTRAIN_BACKEND"] = backend
        hvdtrain.init()    # TensorFlow's collectives start before any tensor exists
    x, y = data()
    seen: dict = {}
    while cases:
        name = cases.pop(0)
        if name == "optimizers":
            seen["optimizers"] = optimizer_cases(out, x, y, backend)
        elif name == "variants":
            seen["variants"] = variant_cases(out, x, y, backend)
        elif name == "diverged":
            seen["diverged"] = diverged_case(out, x, y)
        elif name == "resume-from":   # DIRECTORY STAGE EPOCHS
            resumed = resume_case(out, Path(cases.pop(0)), int(cases.pop(0)),
                                  int(cases.pop(0)), x, y)
            if resumed is not None:
                seen["resumed"] = resumed
        elif name == "checkpoint-to":   # DIRECTORY STAGE
            checkpoint_to(Path(cases.pop(0)), int(cases.pop(0)), x, y)
    (out / f"zero-{RANK}.json").write_text(json.dumps(seen, indent=1))


if __name__ == "__main__":
    main()
