"""The Python API: ``hvdtrain.fit(model, x, y, ...)``, Keras' ``model.fit`` run data-parallel.

It takes what ``model.fit`` takes (data in every form Keras accepts, ``epochs``,
``batch_size``, ``callbacks``, ``validation_data``/``validation_split``/``validation_freq``,
``class_weight``, ``sample_weight``, ``initial_epoch``, ``steps_per_epoch``, ``shuffle``,
``verbose``) and does what one process would do, on every rank of a job started by horovodrun,
mpirun or srun, or alone in one process: the model's own ``train_step`` if it has one, its
compiled loss, metrics and optimizer, Keras' callbacks deciding from exact global metrics (the
same on every rank) and writing from rank 0. On top: hvdtrain's options (every option of
``hvdtrain --help``, by its YAML name: ``run_dir=...``, ``optimizer="adam"``,
``lr_scaling="none"``), exact global-batch math and metrics, step checkpoints, clean stops on
signals (``StoppedBySignal``, exit code 75, after a checkpoint), the stall limit and a run
directory.

    import hvdtrain
    result = hvdtrain.fit(model, x_train, y_train, epochs=5, batch_size=64,
                          validation_data=(x_val, y_val), callbacks=[EarlyStopping()])
    result.history.history["val_loss"], result.metrics, result.run_dir

``model``: a ``keras.Model`` (each rank builds its own; rank 0's weights are broadcast), a
function ``(input_shape, num_classes) -> keras.Model`` or ``() -> keras.Model`` (needed for
mixed precision, which builds under the policy), or a model option string (``"mlp"``,
``"package.module:build_fn"``). ``x``: arrays (or dicts/lists of them), a ``tf.data.Dataset``,
a ``keras.utils.PyDataset``, ``hvdtrain.Arrays``, ``hvdtrain.Pipeline``, or a dataset option
string (``"digits"``, ``"package.module:fn"``). ``batch_size`` is per rank (the global batch is
``batch_size`` times the number of ranks), and the rate is scaled to the world size unless
``lr_scaling="none"``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from hvdtrain.config import PYTHON_OBJECT, ConfigError, build_config, flatten_options


def _model_factory(model: Any, precision: str) -> Callable[[Any, Any], Any] | None:
    """A factory for the run, or None when ``model`` names a model option."""
    import keras

    if isinstance(model, str):
        return None
    if isinstance(model, keras.Model):
        if precision != "float32":
            raise ConfigError(f"precision={precision!r} builds the model under that policy; "
                              "pass a function that builds the model instead of a model")
        return lambda input_shape, num_classes: model
    if callable(model):
        takes_shape = len(inspect.signature(model).parameters) >= 2
        return lambda input_shape, num_classes: (model(input_shape, num_classes) if takes_shape
                                                 else model())
    raise ConfigError(f"model must be a keras.Model, a function that builds one or a model "
                      f"name, not {type(model).__name__}")


def init(backend: str = "auto", threads: int | None = None) -> Any:
    """Join the job's collectives now, before the script builds a model or any tensor: the
    TensorFlow backend (``backend="tensorflow"``, or auto without Horovod) turns TensorFlow's
    runtime into a cluster, which must happen before anything else uses it. Returns this
    rank's ``World`` (rank, size, local rank...). ``hvdtrain.fit`` calls it itself, so a script
    that builds its model inside a function passed to ``fit`` need not."""
    from hvdtrain.config import build_config
    from hvdtrain.collectives import init_collectives, place_devices

    chosen = build_config({"backend": backend}).train.backend   # checked like the option
    return init_collectives(chosen, lambda world: place_devices(world, threads)).world


def fit(model: Any, x: Any = "digits", y: Any = None, *, batch_size: int | None = None,
        epochs: int | None = None, verbose: int | str = "auto",
        callbacks: Sequence[Any] = (), validation_split: float | None = None,
        validation_data: Any = None, shuffle: bool | None = None,
        class_weight: dict | None = None, sample_weight: Any = None,
        initial_epoch: int | None = None, steps_per_epoch: int | None = None,
        validation_steps: int | None = None, validation_batch_size: int | None = None,
        validation_freq: int | list[int] = 1, **options: Any):
    """Train ``model`` data-parallel as ``model.fit`` would in one process; return a
    ``RunResult`` (run directory, exact global metrics, Keras ``History`` with the keys one
    process's would have, weight fingerprints of every rank, the trained model, the run's own
    per-epoch columns) on every rank. See the module doc."""
    from hvdtrain.data.user import KerasData, user_bundle
    from hvdtrain.training.run import Run

    overrides = flatten_options(options, "hvdtrain.fit")
    given = {"batch_size": batch_size, "epochs": epochs, "initial_epoch": initial_epoch,
             "steps_per_epoch": steps_per_epoch, "shuffle": shuffle,
             "validation_split": validation_split}
    overrides.update({name: value for name, value in given.items() if value is not None})
    if verbose != "auto":
        overrides.setdefault("progress", verbose == 1)
    if validation_batch_size is not None and validation_batch_size != (batch_size or 0):
        raise ConfigError("validation_batch_size: hvdtrain validates in batches of batch_size "
                          "per rank (evaluation is exact whatever the batch); drop it")
    overrides["model"] = model if isinstance(model, str) else PYTHON_OBJECT
    overrides["dataset"] = x if isinstance(x, str) else PYTHON_OBJECT
    data = KerasData(x, y, sample_weight, class_weight, validation_data, validation_split,
                     validation_steps)

    def data_factory(data_config: Any, seed: int) -> Any:
        return user_bundle(data, data_config, seed)

    if isinstance(validation_freq, int):
        overrides["validation_freq"] = validation_freq
    config = build_config(overrides)
    factory = _model_factory(model, config.train.precision)
    label = None if isinstance(model, str) else getattr(model, "__name__", type(model).__name__)
    return Run(config, factory, None if isinstance(x, str) else data_factory, callbacks,
               label, validation_freq).execute()
